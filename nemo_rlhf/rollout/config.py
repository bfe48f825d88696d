"""Rollout (generation) config: the ``rollout`` section of the PPO job.

Its defaults live in :class:`RolloutConfig` only; a job config states what differs
(``conf/ppo.yaml``, ``conf/ppo_tiny.yaml``: ``rollout.max_new_tokens``), and ``generate`` callers build one directly.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from nemo_rlhf.config import check_choice

ENGINES = ("megatron", "vllm")
MODES = ("sync", "async")


@dataclass
class VLLMConfig:
    """The vLLM rollout engine's own settings (config section ``rollout.vllm``), read when
    ``rollout.engine=vllm`` (:mod:`nemo_rlhf.rollout.vllm_engine`)."""

    tensor_parallel_size: int = 1
    """vLLM's TP size; may differ from training TP but must divide
    ``parallel.tensor_model_parallel_size`` (the engines of one DP group then split its
    prompts)."""
    gpu_memory_utilization: float = 0.5
    """Fraction of the GPU vLLM may take for weights + KV cache (CUDA only); in (0, 1)."""
    kv_cache_space_gib: float = 1.0
    """KV cache of each engine on a CPU (``VLLM_CPU_KVCACHE_SPACE``), GiB; > 0."""
    enable_sleep_mode: bool = True
    """On CUDA: free the engine's weights and KV cache during training and wake it for the
    rollout (vLLM's sleep mode), so colocation does not double the memory. Ignored on a CPU."""
    enforce_eager: bool = True
    """No CUDA graphs (faster start-up); set false on a GPU for decode speed."""


@dataclass
class RolloutConfig:
    """Sampling and stopping rules of rollout generation (config section ``rollout``)."""

    max_new_tokens: int = 32
    """Most tokens generated per prompt (the response length bound R); >= 0."""
    min_new_tokens: int = 0
    """EOS and stop tokens are suppressed until a response has this many tokens (and a
    ``stop_strings`` string does not end it before). Multi-turn episodes (``env.name``): per
    policy turn, on the megatron engine only (the vLLM engine's episodes refuse it)."""
    temperature: float = 1.0
    """Logits are divided by it before sampling and before the recorded log-prob; > 0."""
    top_k: int = 0
    """Sample only from the k most likely tokens; 0 = off."""
    top_p: float = 1.0
    """Nucleus sampling: the smallest set of tokens whose mass reaches top_p; in (0, 1]."""
    greedy: bool = False
    """Argmax decoding (temperature, top_k, top_p unused; log-probs at temperature 1)."""
    stop_token_ids: list[int] = field(default_factory=list)
    """Token ids that end a response, in addition to the EOS id."""
    stop_strings: list[str] = field(default_factory=list)
    """Strings that end a response once the decoded response contains one (needs decode_fn)."""
    seed: int = 1234
    """Base seed of the sampler's torch.Generator (offset by DP rank and call index)."""
    use_kv_cache: bool = True
    """KV-cached decoding; False recomputes the whole sequence each step (reference)."""
    n_samples_per_prompt: int = 1
    """Responses sampled per prompt in a PPO step (a group, kept contiguous and on one DP
    rank; ``grpo`` / ``rloo`` need >= 2). Read by the PPO trainer, not by ``generate``."""
    engine: str = "megatron"
    """Which engine generates: ``megatron`` (the training model itself, KV-cached decode)
    or ``vllm`` (an in-process vLLM engine per DP group, refit from the actor's weights in
    memory before each rollout; needs the ``vllm`` package, ``make vllm-env``)."""
    vllm: VLLMConfig = field(default_factory=VLLMConfig)
    """Settings of ``engine=vllm``."""
    mode: str = "sync"
    """``sync``: the trainer's ranks generate, then train (colocated). ``async``: rollout
    workers on their own processes and devices (``python -m nemo_rlhf.rollout_worker``,
    started by ``launchers.local`` and the Slurm launcher) generate while the trainer
    trains; weights go to them after every step and samples come back through a bounded
    buffer (:mod:`nemo_rlhf.rollout.remote`)."""
    max_staleness: int = 1
    """``mode=async``: how many policy versions a sample may lag the policy it trains (0:
    on-policy, the synchronous schedule with generation on the workers); >= 0. Above 0 the
    samples are off-policy: ``ppo.rollout_is_cap`` is required (the decoupled objective). It also
    bounds the rollout buffer: at most ``max_staleness + 1`` steps' samples are in flight
    or waiting (a worker waits for the weights its next step needs)."""
    num_workers: int = 1
    """``mode=async``: rollout worker processes (each a full TP=1 copy of the actor); >= 1."""
    worker_timeout_s: float = 300.0
    """``mode=async``: a worker that sends no heartbeat, or answers no weights message, for
    this long is reported dead and the job stops (> 0)."""
    worker_start_timeout_s: float = 900.0
    """``mode=async``: how long the trainer waits for its workers to connect (their start-up:
    imports and model build) before it stops naming the missing ones (> 0)."""
    wait_timeout_s: float = 3600.0
    """``mode=async``: how long the trainer waits for one step's samples (and, when it
    saves a checkpoint, for the buffered steps' samples) while the workers are alive; past
    it the job stops naming the steps, DP ranks and what each worker was doing (> 0). A
    wait for samples that were never requested fails at once."""
    controller_port: int = 0
    """``mode=async``: TCP port of the controller on the trainer's rank 0 (0: a free one,
    written to ``<exp_dir>/rollout_controller`` for the workers)."""

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Check the fixed rules (called by ``__post_init__`` and again by ``generate``).

        Raises:
            ValueError: naming ``rollout.<key>``, the value and what is valid.
        """
        for key in ("max_new_tokens", "min_new_tokens", "top_k", "seed", "n_samples_per_prompt"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"rollout.{key}={value!r}: must be an integer")
        if self.max_new_tokens < 0:
            raise ValueError(f"rollout.max_new_tokens={self.max_new_tokens}: must be >= 0")
        if self.min_new_tokens < 0:
            raise ValueError(f"rollout.min_new_tokens={self.min_new_tokens}: must be >= 0")
        if self.min_new_tokens > self.max_new_tokens:
            raise ValueError(
                f"rollout.min_new_tokens={self.min_new_tokens} is larger than "
                f"rollout.max_new_tokens={self.max_new_tokens}: valid values are "
                f"0 .. {self.max_new_tokens}"
            )
        if self.n_samples_per_prompt < 1:
            raise ValueError(f"rollout.n_samples_per_prompt={self.n_samples_per_prompt}: must be >= 1")
        if self.top_k < 0:
            raise ValueError(f"rollout.top_k={self.top_k}: must be >= 0 (0 = off)")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"rollout.top_p={self.top_p}: must be in (0, 1] (1 = off)")
        if not self.greedy and not self.temperature > 0.0:
            raise ValueError(
                f"rollout.temperature={self.temperature}: must be > 0 when sampling "
                f"(or set rollout.greedy=true for argmax decoding)"
            )
        for i, t in enumerate(self.stop_token_ids):
            if isinstance(t, bool) or not isinstance(t, int) or t < 0:
                raise ValueError(
                    f"rollout.stop_token_ids[{i}]={t!r}: must be a non-negative integer token id"
                )
        for key in ("max_staleness", "num_workers", "controller_port"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < (1 if key == "num_workers" else 0):
                raise ValueError(f"rollout.{key}={value!r}: must be an integer >= "
                                 f"{1 if key == 'num_workers' else 0}")
        check_choice("rollout.mode", self.mode, MODES)
        for key in ("worker_timeout_s", "worker_start_timeout_s", "wait_timeout_s"):
            if not getattr(self, key) > 0:
                raise ValueError(f"rollout.{key}={getattr(self, key)}: must be > 0")
        check_choice("rollout.engine", self.engine, ENGINES)
        v = self.vllm
        if isinstance(v.tensor_parallel_size, bool) or not isinstance(v.tensor_parallel_size, int) \
                or v.tensor_parallel_size < 1:
            raise ValueError(f"rollout.vllm.tensor_parallel_size={v.tensor_parallel_size!r}: must be "
                             f"an integer >= 1")
        if not 0.0 < v.gpu_memory_utilization < 1.0:
            raise ValueError(f"rollout.vllm.gpu_memory_utilization={v.gpu_memory_utilization}: must be "
                             f"in (0, 1)")
        if not v.kv_cache_space_gib > 0:
            raise ValueError(f"rollout.vllm.kv_cache_space_gib={v.kv_cache_space_gib}: must be > 0")
        for i, s in enumerate(self.stop_strings):
            if not isinstance(s, str) or not s:
                raise ValueError(f"rollout.stop_strings[{i}]={s!r}: must be a non-empty string")

    @property
    def logprob_temperature(self) -> float:
        """Temperature of the recorded log-probs: ``temperature`` when sampling, 1.0 if greedy.

        The trainer passes this to :func:`nemo_rlhf.rollout.response_logprobs` so that the
        training-side log-probs are of the same distribution.
        """
        return 1.0 if self.greedy else float(self.temperature)
