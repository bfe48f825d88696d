"""The evaluation job's config (``conf/eval.yaml``): :class:`EvalConfig`, stored in Hydra's
ConfigStore as ``eval_schema`` when this module is imported."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from omegaconf import MISSING

from nemo_rlhf.config import check_choice
from nemo_rlhf.data.templates import check_template
from nemo_rlhf.distributed.parallel import ParallelConfig
from nemo_rlhf.envs.config import EnvConfig
from nemo_rlhf.models.config import PRECISIONS
from nemo_rlhf.reward.functions import RM_INPUTS, check_reward_function_spec


@dataclass
class EvalConfig:
    """Evaluation job (``conf/eval.yaml``)."""

    checkpoint: Optional[str] = None
    """Checkpoint folder, or a ``checkpoints`` root (its newest complete checkpoint; every
    complete step with ``all_steps``). Required unless ``checkpoints`` names some."""
    data: str = MISSING
    """Prompts ``{"prompt", ...extras such as "answer"}``: JSONL, parquet, or a ``datasets``
    save_to_disk folder (:mod:`nemo_rlhf.data.tables`)."""
    out: str = MISSING
    """Result JSON path (written by global rank 0)."""
    checkpoints: list[str] = field(default_factory=list)
    """More checkpoint folders (or roots: their newest) to evaluate, e.g. ``[sft/checkpoints,
    ppo/checkpoints]``; with ``checkpoint`` too both are evaluated. Rows are sorted by step."""
    all_steps: bool = False
    """Evaluate every complete ``step_<N>`` under the ``checkpoint`` root, in step order."""
    rm_checkpoint: Optional[str] = None
    """Reward-model checkpoint folder (or root: its newest); scores every response in process
    with the RM's own chat template and system prompt: ``rm_reward``, per-sample ``rm_score``.
    With ``env.name`` it reads each episode as ``rm_input`` says."""
    rm_input: str = "conversation"
    """What the RM reads of a multi-turn episode (``env.name`` set), as PPO's
    ``reward.rm_input`` (:data:`~nemo_rlhf.reward.functions.RM_INPUTS`): ``conversation``
    (the whole episode, as PPO's served RM reads it: the trajectory's own ids when the RM
    checkpoint has the policy's tokenizer, chat template and system prompt, else the
    episode's messages rendered with the RM's chat template) or ``final_answer`` (the last
    policy turn alone, as a single-turn response). Single-turn rows: the (prompt, response)
    texts either way."""
    reference: Optional[str] = None
    """Reference (initial policy) checkpoint folder (or root: its newest): ``kl_to_reference``."""
    forward_micro_batch_size: int = 8
    """Rows per forward micro-batch of the log-prob passes (``reference``) and the RM."""
    checker: str = ""
    """Reward function scoring each response: ``package.module:function`` or a short name of
    :data:`~nemo_rlhf.reward.functions.BUILTIN_REWARD_FUNCTIONS` (required;
    ``conf/eval.yaml`` names the tiny demo's ``arithmetic_exact_match``)."""
    max_new_tokens: int = 8
    """Longest response in tokens."""
    batch_size: int = 64
    """Prompts per generate call on one DP rank."""
    num_examples: int = 10
    """Examples (prompt, response, score) stored in the JSON and printed."""
    tokenizer_dir: Optional[str] = None
    """Override the checkpoint's ``data.tokenizer_dir``."""
    precision: str = "32"
    """``32``, ``bf16-mixed`` or ``fp16-mixed``."""
    seed: int = 1234
    """Seed of distributed init and of sampling (greedy decoding draws nothing)."""
    temperature: float = 0.0
    """0 = greedy decoding; > 0 samples at this temperature (e.g. to collect RM data)."""
    num_samples: int = 1
    """Responses per prompt (> 1 needs ``temperature > 0``)."""
    samples_out: Optional[str] = None
    """Also write every response as JSONL in the schema the trainer's ``eval_samples`` use
    (:mod:`nemo_rlhf.data.sample_rows`: ``prompt``, ``response``, ``correct`` (the checker's
    score), ``length``, ``extras`` (the row's fields); plus ``sample``, ``ended``, the extra
    checkers' scores, ``rm_score`` / ``kl_to_reference`` when measured; ``step`` and
    ``checkpoint`` when more than one checkpoint is evaluated: one file, rows in checkpoint
    order)."""
    extra_checkers: list[str] = field(default_factory=list)
    """More reward functions (as ``checker``) averaged into the result (e.g. ``just_the_number``)."""
    chat_template: Optional[str] = None
    """Override the checkpoint's ``data.chat_template`` (e.g. ``chatml`` for an imported model)."""
    system_prompt: Optional[str] = None
    """Override the checkpoint's ``data.system_prompt``."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    env: EnvConfig = field(default_factory=EnvConfig)
    """Multi-turn evaluation (#51): with ``env.name`` set each prompt row is one episode with
    that environment (the PPO trainer's :func:`~nemo_rlhf.trainers.ppo.episode_source.run_episode_batch`,
    the same ``env.*`` keys as PPO's; ``max_new_tokens`` is per policy turn); the checker
    scores the final answer (the last policy turn). Null: single-turn decoding."""

    def __post_init__(self) -> None:
        self.precision = str(self.precision)
        check_choice("precision", self.precision, PRECISIONS)
        check_reward_function_spec("checker", self.checker)
        for i, name in enumerate(self.extra_checkers):
            check_reward_function_spec(f"extra_checkers[{i}]", name)
        if self.chat_template is not None:  # null: the checkpoint's
            check_template(self.chat_template, "chat_template")
        for key in ("max_new_tokens", "batch_size", "num_samples", "forward_micro_batch_size"):
            if getattr(self, key) < 1:
                raise ValueError(f"{key}={getattr(self, key)}: must be >= 1")
        if self.temperature < 0:
            raise ValueError(f"temperature={self.temperature}: must be >= 0 (0 = greedy)")
        if self.num_samples > 1 and self.temperature == 0:
            raise ValueError(f"num_samples={self.num_samples} with temperature=0: greedy decoding gives "
                             f"one response per prompt; set temperature > 0")
        if not self.checkpoint and not self.checkpoints:
            raise ValueError("checkpoint is missing: set checkpoint=<checkpoint folder or checkpoints "
                             "root> (or checkpoints=[<folder>, ...])")
        if self.all_steps and not self.checkpoint:
            raise ValueError("all_steps=true needs checkpoint=<checkpoints root> (its steps are evaluated)")
        for i, c in enumerate(self.checkpoints):
            if not isinstance(c, str) or not c:
                raise ValueError(f"checkpoints[{i}]={c!r}: must be a checkpoint folder path")
        for key in ("rm_checkpoint", "reference"):
            if getattr(self, key) == "":
                raise ValueError(f"{key}='': give a checkpoint folder or null")
        check_choice("rm_input", self.rm_input, RM_INPUTS)
        if self.env.enabled and self.reference:
            raise ValueError(f"reference={self.reference!r} with env.name={self.env.name!r}: the KL to a "
                             f"reference is not measured on episodes yet; drop reference or env.name")


def register_configs() -> None:
    """Store :class:`EvalConfig` in Hydra's ConfigStore as ``eval_schema``."""
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name="eval_schema", node=EvalConfig)


register_configs()

