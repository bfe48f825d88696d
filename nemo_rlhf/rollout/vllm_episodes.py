"""Multi-turn episodes on the vLLM engine (``rollout.engine=vllm``, #51).

:func:`run_episodes_vllm` runs one DP rank's batch of episodes with an
:class:`~nemo_rlhf.envs.base.Environment`, as
:func:`~nemo_rlhf.rollout.episodes.run_episodes` does on the megatron actor, and returns the
same :class:`~nemo_rlhf.rollout.episodes.Episode` results: the same limits
(:class:`~nemo_rlhf.envs.base.EnvLimits`), stop reasons, per-turn rewards and infos, the
same append-only check at every policy turn. The environment stepping, the limits and the
check are ``episodes``' own helpers (``_start``, ``_finish_turns``, ``_check_turn_input``,
``_turn_cap``), so both engines take the same decisions.

**Token-in/token-out.** Each policy turn is one ``LLM.generate`` call over the episodes
still running, each request's prompt the episode's token ids so far
(``{"prompt_token_ids": trajectory.token_ids}``: no text, nothing re-tokenised); the returned
ids and their log-probs (vLLM's ``processed_logprobs``, see
:mod:`~nemo_rlhf.rollout.vllm_engine`) are appended with ``Trajectory.append_policy``, the
environment's observation, tokenised alone by ``encode_observation``, with ``append_env``.

**KV reuse across turns: vLLM's automatic prefix caching** (the engine is built with
``enable_prefix_caching=True``). Turn ``k + 1``'s prompt starts with turn ``k``'s prompt and
response, so vLLM finds their keys/values in its block cache and computes only the rest.
It reuses **full KV blocks only** (vLLM's CPU backend: 128 tokens a block), so up to
``block_size - 1`` tokens of the prefix are recomputed per turn, and cached blocks can be
evicted under memory pressure (then recomputed: slower, the same tokens). What was reused is
counted in ``engine.cached_prompt_tokens``. A refit resets the cache (the keys/values of the
old weights).

**Turns.** A turn ends at EOS or a ``rollout.stop_token_ids`` id (vLLM stops there), at a
``rollout.stop_strings`` string (applied to the returned ids: the turn is cut after the
first token at which its decoded text contains one, whatever vLLM's own stop was, as the
megatron engine's per-token rule), or at the turn's bound ``min(rollout.max_new_tokens,
env.max_total_tokens - len(trajectory))`` (vLLM's ``max_tokens`` of that request).

**Sampling.** Each request gets the engine's per-row seed (``row_seed``) of
``(rollout.seed, dp_rank, (call_index * 1_000_003 + turn) * 1_009, row)`` with ``row`` the
episode's place among the episodes still running that turn: reproducible for the same
inputs; not the megatron engine's draws (greedy: the same tokens up to ties within rounding).

**Parallelism.** As the single-turn vLLM engine (PP = 1; the TP ranks of one DP group hold
``tp / vllm_tp`` engines that split the rows and share the results): every rank holds the
same trajectories. Each episode stays on one engine for all its turns (the engines take
contiguous shares of the episodes, not of each turn's running rows), so that its next turn
finds its prefix in that engine's cache. TP rank 0 steps the environments and broadcasts
the outcomes (``_finish_turns``). Tested at training TP=1 and TP=2 with vLLM TP=1
(``tests/vllm_engine/test_vllm_episodes.py``).

Not covered (an error naming it): ``rollout.min_new_tokens`` > 0 (per turn on the megatron
engine, :mod:`~nemo_rlhf.rollout.episodes`; here it would need vLLM's ``min_tokens`` capped
at each turn's ``max_tokens`` and the per-token stop-string rule from it, untested); no ``recompute`` path
(vLLM's cache is its own business).
"""

from __future__ import annotations

from typing import Any, List, Optional, Sequence

from nemo_rlhf.distributed.split import dp_slice
from nemo_rlhf.envs.base import EnvLimits, Environment
from nemo_rlhf.rollout.config import RolloutConfig
from nemo_rlhf.rollout.episodes import (
    DecodeFn,
    EncodeFn,
    Episode,
    _check_args,
    _check_turn_input,
    _finish_turns,
    _start,
    _turn_cap,
)
from nemo_rlhf.rollout.generate import _CALL_COUNTER, _check_prompts_agree, left_pad
from nemo_rlhf.rollout.vllm_engine import cut_at_stop_strings

__all__ = ["run_episodes_vllm"]


def run_episodes_vllm(engine, model, envs: Sequence[Environment], problems: Sequence[Any],
                      cfg: RolloutConfig, limits: EnvLimits, *, encode_prompt: EncodeFn,
                      encode_observation: EncodeFn, decode_fn: DecodeFn, weights_version: int,
                      call_index: Optional[int] = None) -> List[Episode]:
    """Run one DP rank's episodes to the end on the vLLM engine (see the module docstring).

    Args:
        engine: a :class:`~nemo_rlhf.rollout.vllm_engine.VLLMRolloutEngine` (its
            ``eos_token_id``, ``pad_token_id`` and model config are used).
        model: this rank's actor; the engine is refit from it first when
            ``weights_version`` differs from the last refit's (collective over TP).
        envs: one :class:`Environment` instance per episode.
        problems: ``envs[i].reset(problems[i])`` starts episode ``i``.
        cfg: sampling and per-turn stopping, as :func:`~nemo_rlhf.rollout.episodes.run_episodes`
            (``min_new_tokens`` must be 0: raises ValueError naming it).
        limits: per-episode limits (config section ``env``).
        encode_prompt: first observation text -> prompt ids (the chat template applied).
        encode_observation: an observation text -> its ids, tokenised alone.
        decode_fn: a turn's ids -> text for ``env.step`` (and ``stop_strings``).
        weights_version: the trainer's weights version (refit when it changed).
        call_index: mixes into the sampling seeds (None: a per-process counter).

    Returns:
        ``len(envs)`` :class:`Episode` s in order, the same on every rank of the TP group.

    Raises:
        ValueError: as :func:`~nemo_rlhf.rollout.episodes.run_episodes` (bad config naming
            the key, mismatched ``envs`` / ``problems``, ids outside the vocabulary, a
            prompt that leaves no room).
        PrefixMismatch / AssertionError: a turn's input is not the trajectory extended.
    """
    mcfg = engine.model_cfg
    vocab_size, max_seq = mcfg.vocab_size, mcfg.max_position_embeddings
    _check_args(engine.dims, envs, problems, cfg, limits, max_seq, decode_fn)
    if cfg.min_new_tokens:
        raise ValueError(f"rollout.min_new_tokens={cfg.min_new_tokens} with rollout.engine=vllm: the "
                         f"vLLM engine's episodes do not apply it per turn yet (the megatron engine's do); "
                         f"set rollout.min_new_tokens=0 or rollout.engine=megatron")
    for k, tok in enumerate(cfg.stop_token_ids):
        if tok >= vocab_size:
            raise ValueError(f"rollout.stop_token_ids[{k}]={tok} is outside the vocabulary "
                             f"[0, {vocab_size})")
    if call_index is None:
        call_index = next(_CALL_COUNTER)
    rows = _start(envs, problems, encode_prompt, limits, vocab_size)
    _check_prompts_agree(engine.dims, left_pad([r.traj.prompt_ids for r in rows],
                                               engine.pad_token_id)[0])
    # each episode stays on one engine of the DP group (its contiguous share of the
    # episodes), so that its next turn finds its keys/values in that engine's prefix cache
    n_engines = engine.dims.tp // engine.vtp
    engine_of = [0] * len(rows)
    for e in range(n_engines):
        for i in range(len(rows))[dp_slice(len(rows), e, n_engines)]:
            engine_of[i] = e
    engine.refit(model, weights_version)
    engine._wake()
    try:
        turn = 0
        while True:
            live = [(i, r) for i, r in enumerate(rows) if not r.done]
            if not live:
                break
            prompts = []
            for i, r in live:  # each turn's input: the trajectory so far, as ids
                _check_turn_input(r, i, r.traj.token_ids)
                prompts.append(list(r.traj.token_ids))
            caps = [_turn_cap(r, cfg, limits) for _, r in live]
            ids, lps, stopped = engine._generate_rows(
                prompts, cfg, (call_index * 1_000_003 + turn) * 1_009, max_tokens=caps,
                engine_of_row=[engine_of[i] for i, _ in live])
            turn += 1
            ended = []
            for k, (i, r) in enumerate(live):
                n = len(ids[k])
                if cfg.stop_strings:  # the first token whose text holds a stop string ends it
                    cut = cut_at_stop_strings(ids[k], cfg.stop_strings, decode_fn, 0)
                    if cut is not None:
                        n, stopped[k] = cut, True
                if n < 1:
                    raise RuntimeError(f"run_episodes_vllm: episode {i} turn {r.traj.turns + 1}: "
                                       f"vLLM returned no token (max_tokens={caps[k]})")
                r.turn_ids, r.turn_lps = ids[k][:n], lps[k][:n]
                ended.append((i, r, bool(stopped[k])))
            _finish_turns(ended, engine.dims, limits, encode_observation, decode_fn, vocab_size)
            for _, r in live:
                r.pending = []  # the next request carries the whole trajectory
    finally:
        engine._sleep()
    return [r.episode for r in rows]
