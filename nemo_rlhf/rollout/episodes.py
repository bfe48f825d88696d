"""Multi-turn episodes on the megatron actor: the policy and an :class:`Environment` take
turns, the KV cache is kept across turns (#51).

:func:`run_episodes` runs one DP rank's batch of episodes. Each episode starts with
``env.reset(problem)`` (its text tokenised by ``encode_prompt``), then alternates a policy
turn (sampled until EOS, a stop token / stop string -- e.g. the end of a tool call --, or
``rollout.max_new_tokens``) with ``env.step(trajectory, decoded turn)``, whose observation is
tokenised **alone** by ``encode_observation`` (the chat template's tool/user message and the
next assistant header included: the caller's function) and appended. Nothing is decoded and
re-encoded; the policy's ids are the sampled ids (token-in/token-out,
:mod:`nemo_rlhf.rollout.trajectory`). The result is one
:class:`~nemo_rlhf.rollout.trajectory.Trajectory` per episode (loss mask 0 on the prompt and
the environment tokens, behaviour log-probs on the policy tokens) with its rewards and
infos (:class:`Episode`); :func:`~nemo_rlhf.rollout.trajectory.to_padded_batch` lays them
out for the trainer.

**KV cache kept across turns** (``recompute_prefix=False``, the default). The batch is
static and column-synchronous, as in :func:`~nemo_rlhf.rollout.generate.generate`: prompts
left-padded to ``P``, then every row's tokens contiguous from column ``P`` -- exactly
:func:`to_padded_batch`'s layout, so a training forward over the final sequences sees the
same columns (RoPE is applied by column in megatron) and the same positions. Each row is in
one of three phases at every step: *policy* (its next token is sampled from the last
step's logits), *environment* (its next token is the next id of the pending observation,
fed to the model without sampling: teacher forcing, the observation's keys and values go
into the same cache), or *done* (pad tokens, never read). When no row is in the policy
phase, the environment tokens are prefilled in one chunk (the shortest pending observation
of the batch; the other rows continue the next step); otherwise one column per step. So a
turn costs the forward of the tokens it appends, never of the prefix again. Episodes of a
batch end at different turns: a finished row stops sampling and calling its environment
(its columns are pad, masked), and the loop ends when every row is done. Rows whose policy
turn ends while others still generate start reading their observation at once (no waiting
for the batch's slowest turn).

**Recompute** (``recompute_prefix=True``): each turn is one :func:`generate` call whose
prompts are the whole conversations so far (prefill of the entire prefix each turn, a new
cache per turn), the rows of the batch that are still running; the reference the tests
compare against and the baseline of ``benchmarks/bench_multiturn.py``. Same tokens under
greedy decoding (log-probs to rounding); sampled tokens are drawn in another order, so not
the same draws.

**Limits** (:class:`~nemo_rlhf.envs.base.EnvLimits`); an episode cut at one has
``trajectory.truncated`` and ``Episode.stop_reason`` naming it:

* ``max_turns``: after that many policy turns, an environment that is not done ends the
  episode (its observation is not appended);
* ``max_total_tokens``: a turn is cut when the episode reaches it (the environment is not
  stepped on the cut turn), and an observation that leaves no room for one more policy
  token is not appended;
* ``max_tool_time_s``: the wall time of the episode's ``env.step`` calls, all together;
  past it an environment that is not done ends the episode (the environment's own tool
  budget, e.g. :class:`~nemo_rlhf.envs.ToolEnvironment`'s, refuses calls before that).

An environment's own ``done`` with ``info["truncated"]`` also ends the episode truncated
(reason ``info["reason"]`` or ``"environment"``). A turn cut at ``rollout.max_new_tokens``
(no stop) is a complete turn: the environment answers it.

**Append-only check**: at the start of every policy turn the ids in the row's cache (what
the model reads) are checked with :func:`check_prefix_extension` against the previous
turn's input, and must equal the trajectory's ``token_ids`` (an error names the episode and
the turn).

Parallelism: every rank of one model-parallel (TP x PP) group runs the same episodes (the
same problems; the prompts are checked to agree) and holds the same trajectories. The
rank that samples (TP rank 0 of the last stage) also steps the environments; each step's
outcomes (result, time, observation ids) are broadcast to the group as pickled host
objects (gloo), so an environment with a time budget or side effects runs once and every
rank appends the same ids. The other ranks' environment instances are reset but never
stepped. Each DP rank runs its own episodes. Context parallelism
(``parallel.context_parallel_size`` > 1, TP = PP = 1): every CP rank decodes the whole
episodes (the incremental path, as :func:`generate` under CP); CP rank 0 samples and steps
the environments, its choices and outcomes broadcast over the CP group. Expert parallelism: as :func:`generate`, a
rank whose rows are done keeps stepping until its expert-exchange group is done.

**``rollout.min_new_tokens`` is per policy turn**: EOS and the ``rollout.stop_token_ids``
cannot be sampled before a turn has that many tokens, and a ``rollout.stop_strings`` string
does not end it before then (as :func:`generate`'s rule for one response: each turn is the
policy's response to what it read); the behaviour log-probs are the policy's own, before the
suppression. A turn cut at its cap (``rollout.max_new_tokens`` or ``env.max_total_tokens``)
ends there even when shorter. The recompute path gives each turn's :func:`generate` the
same ``min_new_tokens`` (at most that call's ``max_new_tokens``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable, List, Optional, Sequence

import torch
import torch.distributed as dist

from nemo_rlhf.distributed import cpu_compat
from nemo_rlhf.envs.base import EnvLimits, Environment, StepResult
from nemo_rlhf.models.actor_critic import ActorCriticModel
from nemo_rlhf.models.engine import causal_padding_mask, position_ids_for, unwrap
from nemo_rlhf.models.moe import all_done_in_group, expert_exchange_group
from nemo_rlhf.rollout.config import RolloutConfig
from nemo_rlhf.rollout.generate import (
    _CALL_COUNTER,
    _check_prompts_agree,
    _share_choice,
    _StageRunner,
    RolloutBatch,
    generate,
    left_pad,
    sampler_seed,
)
from nemo_rlhf.rollout.sampling import choose_tokens
from nemo_rlhf.rollout.trajectory import POLICY, Trajectory, check_prefix_extension

__all__ = ["Episode", "EpisodeRolloutBatch", "run_episodes"]

EncodeFn = Callable[[str], List[int]]
DecodeFn = Callable[[List[int]], str]


@dataclass
class Episode:
    """One finished episode."""

    trajectory: Trajectory
    """The token sequence, its loss mask and behaviour log-probs, ``truncated``."""
    turn_rewards: List[Optional[float]] = field(default_factory=list)
    """``env.step``'s reward for each policy turn the environment answered (None: no
    reward that turn), in turn order; a turn cut at ``max_total_tokens`` has none. The
    reward of turn ``k`` belongs on the last token of ``trajectory``'s ``k``-th policy
    segment."""
    infos: List[dict] = field(default_factory=list)
    """``env.step``'s info of each answered turn."""
    stop_reason: str = ""
    """``done`` (the environment ended it), or the limit that cut it: ``max_turns``,
    ``max_total_tokens``, ``max_tool_time_s``, or the environment's own reason."""
    env_time_s: float = 0.0
    """Wall time of this episode's ``env.step`` calls."""
    messages: List[dict] = field(default_factory=list)
    """The episode as a conversation, text only (what a served reward model reads,
    ``reward.rm_input=conversation``): ``{"role": "user", "content": <the text
    env.reset returned>}``, then per policy turn ``{"role": "assistant", "content": <the
    turn decoded, as env.step read it>}`` and per appended observation ``{"role":
    env.observation_role, "content": <its text, before env.observation_template>}``. The
    same on every rank of a model-parallel group."""
    values: Optional[List[float]] = None
    """With ``run_episodes(..., with_values=True)``, on the last pipeline stage: the
    actor-critic's value of the state before each token after the prompt (``len(trajectory)
    - prompt_length`` floats; the value head on the decode's final hidden state of the
    previous column, as :func:`generate`'s ``with_values``), 0 on the environment's tokens.
    None otherwise (not carried by the async transport)."""


class _Row:
    """Bookkeeping of one episode while the batch runs."""

    def __init__(self, env: Environment, traj: Trajectory):
        self.env, self.traj = env, traj
        self.episode = Episode(traj)
        self.turn_ids: List[int] = []
        self.turn_lps: List[float] = []
        self.pending: List[int] = []  # observation ids still to feed (environment phase)
        self.done = False
        self.prev_input: List[int] = []  # the previous turn's input (append-only check)

    def end(self, reason: str, truncated: bool) -> None:
        self.done = True
        self.episode.stop_reason = reason
        if truncated:
            self.traj.mark_truncated()


def _check_args(dims, envs, problems, cfg: RolloutConfig, limits: EnvLimits, max_sequence_length,
                decode_fn) -> None:
    cfg.validate()
    if len(envs) != len(problems) or not envs:
        raise ValueError(f"run_episodes: {len(envs)} environments for {len(problems)} problems; "
                         f"give one environment instance per episode (at least one)")
    if len({id(e) for e in envs}) != len(envs):
        raise ValueError("run_episodes: the same Environment instance serves two episodes; "
                         "give one instance per episode (an environment keeps episode state)")
    if cfg.max_new_tokens < 1:
        raise ValueError(f"rollout.max_new_tokens={cfg.max_new_tokens}: a policy turn needs at "
                         f"least one token; set rollout.max_new_tokens >= 1")
    if decode_fn is None:
        raise ValueError("run_episodes: decode_fn (token ids -> str) is required: the "
                         "environment reads each turn's text")
    if limits.max_total_tokens > max_sequence_length:
        raise ValueError(f"env.max_total_tokens={limits.max_total_tokens} exceeds the model's "
                         f"max_sequence_length={max_sequence_length}; lower env.max_total_tokens")


def _start(envs, problems, encode_prompt, limits: EnvLimits, vocab_size: int) -> List[_Row]:
    rows = []
    for i, (env, problem) in enumerate(zip(envs, problems)):
        first = env.reset(problem)
        ids = list(encode_prompt(first))
        if not ids:
            raise ValueError(f"run_episodes: episode {i}'s prompt encodes to no tokens")
        if len(ids) >= limits.max_total_tokens:
            raise ValueError(f"run_episodes: episode {i}'s prompt has {len(ids)} tokens, "
                             f"env.max_total_tokens={limits.max_total_tokens} leaves no room "
                             f"for a policy token")
        if min(ids) < 0 or max(ids) >= vocab_size:
            raise ValueError(f"run_episodes: episode {i}'s prompt has an id outside the "
                             f"vocabulary [0, {vocab_size})")
        row = _Row(env, Trajectory(ids))
        row.episode.messages.append({"role": "user", "content": first})
        rows.append(row)
    return rows


def _turn_cap(row: _Row, cfg: RolloutConfig, limits: EnvLimits) -> int:
    """Tokens this row's current turn may still reach: the per-turn and the episode bound."""
    return min(cfg.max_new_tokens, limits.max_total_tokens - len(row.traj))


def _leader(dims) -> bool:
    """The rank that samples (TP rank 0 and CP rank 0 of the last stage) also steps the
    environments."""
    return dims.is_last_stage and dims.tp_rank == 0 and getattr(dims, "cp_rank", 0) == 0


def _share_objects(dims, objs: list) -> list:
    """``objs`` from the leader to every rank of its model-parallel group and its CP group
    (host objects, pickled: gloo; the same route as ``generate``'s token broadcast: the
    CP group, then TP, then the pipeline)."""
    cp = getattr(dims, "cp", 1)
    if dims.tp * dims.pp * cp == 1:
        return objs
    box = [objs]
    if dims.is_last_stage and cp > 1:
        dist.broadcast_object_list(box, group=dims.cp_group, group_src=0, device=torch.device("cpu"))
    if dims.is_last_stage and dims.tp > 1:
        dist.broadcast_object_list(box, group=dims.tp_group, group_src=0, device=torch.device("cpu"))
    if dims.pp > 1:
        dist.broadcast_object_list(box, group=dims.pp_group, group_src=dims.pp - 1,
                                   device=torch.device("cpu"))
    return box[0]


def _step_env(row: _Row, i: int, text: str, encode_observation: EncodeFn, vocab_size: int) -> tuple:
    """Leader only: ``env.step`` on the turn (its decoded ``text``), its observation
    tokenised alone. Returns ``(result, seconds, observation ids or None, error message or
    None)`` (an error is raised on every rank after the broadcast, so no rank waits for the
    others forever)."""
    t0 = time.perf_counter()
    result: StepResult = row.env.step(row.traj, text)
    dt = time.perf_counter() - t0
    if result.done:
        return result, dt, None, None
    obs = [int(t) for t in encode_observation(result.observation)]
    turn = row.traj.turns
    if obs and (min(obs) < 0 or max(obs) >= vocab_size):
        return result, dt, None, (f"run_episodes: episode {i} turn {turn}: the observation encodes "
                                  f"to an id outside the vocabulary [0, {vocab_size})")
    if not obs:
        return result, dt, None, (f"run_episodes: episode {i} turn {turn}: the environment's "
                                  f"observation {result.observation!r} encodes to no tokens; the "
                                  f"policy cannot take two turns in a row (encode_observation "
                                  f"should add the template's headers)")
    return result, dt, obs, None


def _finish_turns(ended: List[tuple], dims, limits: EnvLimits, encode_observation: EncodeFn,
                  decode_fn: DecodeFn, vocab_size: int) -> None:
    """Rows whose policy turn is over (``ended``: ``(index, row, stopped)``, the same on
    every rank): append the turn, step the environments (on the leader, the outcomes
    shared with the group), queue the observations or end the episodes. Shared by both
    paths (the same decisions)."""
    asked = []
    for i, row, stopped in ended:
        traj = row.traj
        traj.append_policy(row.turn_ids, row.turn_lps)
        text = decode_fn(list(row.turn_ids))  # every rank: the episode's messages are everyone's
        row.episode.messages.append({"role": "assistant", "content": text})
        row.turn_ids, row.turn_lps = [], []
        if not stopped and len(traj) >= limits.max_total_tokens:
            row.end("max_total_tokens", truncated=True)  # cut mid-turn: no environment step
            continue
        asked.append((i, row, text))
    if not asked:
        return
    outcomes = None
    if _leader(dims):
        outcomes = [_step_env(row, i, text, encode_observation, vocab_size)
                    for i, row, text in asked]
    outcomes = _share_objects(dims, outcomes)
    for (i, row, _ids), (result, dt, obs, error) in zip(asked, outcomes):
        if error is not None:
            raise ValueError(error)
        traj = row.traj
        row.episode.env_time_s += dt
        row.episode.turn_rewards.append(result.reward)
        row.episode.infos.append(dict(result.info))
        if result.done:
            if result.info.get("truncated"):
                row.end(str(result.info.get("reason", "environment")), truncated=True)
            else:
                row.end("done", truncated=False)
        elif traj.turns >= limits.max_turns:
            row.end("max_turns", truncated=True)
        elif row.episode.env_time_s > limits.max_tool_time_s:
            row.end("max_tool_time_s", truncated=True)
        elif len(traj) + len(obs) >= limits.max_total_tokens:  # no room for a policy token after it
            row.end("max_total_tokens", truncated=True)
        else:
            traj.append_env(obs)
            row.episode.messages.append({"role": getattr(row.env, "observation_role", "user"),
                                         "content": result.observation})
            row.pending = list(obs)


def _check_turn_input(row: _Row, i: int, model_input: List[int]) -> None:
    """At a policy turn's start: the model's input extends the previous turn's and is the
    trajectory (token-in/token-out)."""
    turn = row.traj.turns + 1
    check_prefix_extension(row.prev_input, model_input, turn)
    if model_input != row.traj.token_ids:
        ids = row.traj.token_ids
        pos = next((k for k, (a, b) in enumerate(zip(model_input, ids)) if a != b),
                   min(len(model_input), len(ids)))
        raise AssertionError(f"run_episodes: episode {i} turn {turn}: the model's input "
                             f"({len(model_input)} ids) is not the trajectory ({len(ids)} ids): "
                             f"first difference at position {pos} (model {model_input[pos:pos + 4]}, "
                             f"trajectory {ids[pos:pos + 4]})")
    row.prev_input = list(model_input)


def run_episodes(model, dims, envs: Sequence[Environment], problems: Sequence[Any],
                 cfg: RolloutConfig, limits: EnvLimits, *, encode_prompt: EncodeFn,
                 encode_observation: EncodeFn, decode_fn: DecodeFn, eos_token_id: int,
                 pad_token_id: int, vocab_size: int, max_sequence_length: int,
                 call_index: Optional[int] = None,
                 recompute_prefix: bool = False, with_values: bool = False) -> List[Episode]:
    """Run one DP rank's episodes to the end (see the module docstring).

    Args:
        model: this rank's actor (megatron ``GPTModel`` / ``ActorCriticModel``, optionally
            DDP-wrapped); put in eval mode for the call, restored afterwards.
        dims: :class:`~nemo_rlhf.distributed.ParallelDims`.
        envs: one :class:`Environment` instance per episode.
        problems: ``envs[i].reset(problems[i])`` starts episode ``i``.
        cfg: sampling and per-turn stopping (``max_new_tokens`` per turn, ``stop_token_ids``
            and ``stop_strings`` end a turn, e.g. at ``</tool_call>``, not before
            ``min_new_tokens`` tokens of the turn).
        limits: per-episode limits (config section ``env``).
        encode_prompt: first observation text -> prompt ids (the chat template applied).
        encode_observation: an observation text -> its ids, tokenised alone (the template's
            tool/user message and the next assistant header included).
        decode_fn: a turn's ids -> text for ``env.step`` (and ``stop_strings``).
        eos_token_id, pad_token_id, vocab_size, max_sequence_length: as :func:`generate`.
        call_index: mixes into the sampler seed (None: a per-process counter).
        recompute_prefix: recompute the whole prefix each turn (one :func:`generate` per
            turn) instead of keeping the KV cache: the reference path.
        with_values: also record the actor-critic's values of the policy tokens
            (:attr:`Episode.values`, last pipeline stage; the old values of
            ``ppo.old_logprobs_from_rollout``). Kept-cache path only.

    Returns:
        ``len(envs)`` :class:`Episode` s in order, the same on every rank of the
        model-parallel group.

    Raises:
        ValueError: bad config (naming the key), mismatched ``envs`` / ``problems``, a
            prompt or observation id outside the vocabulary, a prompt that leaves no room,
            model-parallel ranks given different problems.
        PrefixMismatch / AssertionError: a turn's model input is not the trajectory
            extended (a bug: the engine only appends).
        ValueError: ``with_values`` with ``recompute_prefix`` or a model without a value head.
    """
    _check_args(dims, envs, problems, cfg, limits, max_sequence_length, decode_fn)
    if with_values and (recompute_prefix or not isinstance(unwrap(model), ActorCriticModel)
                        or type(unwrap(model)).head_name != "value_head"):
        raise ValueError("run_episodes(with_values=True): the values come from an actor-critic's value "
                         "head on the kept-cache path (recompute_prefix=False)")
    for name, tok in (("eos_token_id", eos_token_id), ("pad_token_id", pad_token_id)):
        if not 0 <= tok < vocab_size:
            raise ValueError(f"run_episodes: {name}={tok} is outside the vocabulary [0, {vocab_size})")
    for k, tok in enumerate(cfg.stop_token_ids):
        if tok >= vocab_size:
            raise ValueError(f"rollout.stop_token_ids[{k}]={tok} is outside the vocabulary "
                             f"[0, {vocab_size})")
    if call_index is None:
        call_index = next(_CALL_COUNTER)
    rows = _start(envs, problems, encode_prompt, limits, vocab_size)
    if recompute_prefix:
        _run_recompute(model, dims, rows, cfg, limits, encode_observation, decode_fn,
                       eos_token_id, pad_token_id, vocab_size, max_sequence_length, call_index)
        return [r.episode for r in rows]
    core = unwrap(model)
    was_training = core.training
    core.eval()
    try:
        with torch.no_grad(), cpu_compat.suspended():
            _run_cached(core, dims, rows, cfg, limits, encode_observation, decode_fn,
                        eos_token_id, pad_token_id, vocab_size, call_index, with_values)
    finally:
        core.train(was_training)
        if not dims.is_first_stage:
            core.set_input_tensor(None)
    return [r.episode for r in rows]


def _step_mask(key_pad_BL: Optional[torch.Tensor], c0: int, s: int, dev) -> Optional[torch.Tensor]:
    """``[B or 1, 1, s, c0+s]`` bool, True = masked out: left padding and causal within the
    ``s`` new tokens; None for one token and no left padding (nothing to mask)."""
    if key_pad_BL is None and s == 1:
        return None
    later = (torch.arange(c0 + s, device=dev).unsqueeze(0)
             > torch.arange(c0, c0 + s, device=dev).unsqueeze(1))  # [s, c0+s]
    if key_pad_BL is None:
        return later.view(1, 1, s, c0 + s)
    return (key_pad_BL[:, :c0 + s].unsqueeze(1) | later.unsqueeze(0)).unsqueeze(1)


def _run_cached(model, dims, rows: List[_Row], cfg: RolloutConfig, limits: EnvLimits,
                encode_observation, decode_fn, eos_token_id, pad_token_id, vocab_size,
                call_index, with_values: bool = False) -> None:
    dev = dims.device
    B = len(rows)
    prompt_ids, prompt_mask, prompt_lengths = left_pad([r.traj.prompt_ids for r in rows],
                                                       pad_token_id)
    _check_prompts_agree(dims, prompt_ids)
    P = prompt_ids.shape[1]
    # every row's tokens end within max_total_tokens of its own start
    L = P + max(limits.max_total_tokens - int(n) for n in prompt_lengths)
    starts = [P - int(n) for n in prompt_lengths]
    seq = torch.full((B, L), pad_token_id, dtype=torch.long)  # host copy of the model's input
    seq[:, :P] = prompt_ids
    key_pad = None
    if not bool(prompt_mask.all()):
        key_pad = torch.zeros(B, L, dtype=torch.bool, device=dev)
        key_pad[:, :P] = ~prompt_mask.to(dev)
    offset_B1 = (prompt_lengths - P).to(dev).unsqueeze(1)  # position = column + offset
    stop_ids = torch.tensor(sorted({eos_token_id, *cfg.stop_token_ids}), dtype=torch.long, device=dev)
    generator = None
    if _leader(dims) and not cfg.greedy:
        generator = torch.Generator(device=dev).manual_seed(
            sampler_seed(cfg.seed, dims.dp_rank, call_index))
    packed = torch.zeros(3, B, dtype=torch.float64, device=dev)
    runner = _StageRunner(model, dims, B, True, L)
    ep_group = expert_exchange_group(model)
    values = None  # [B, L-P]: the value of the state before each column from P (policy tokens)
    if with_values and dims.is_last_stage:
        if runner.stage is None:
            raise RuntimeError("run_episodes(with_values=True): this model stage does not take the "
                               "incremental decode path (IncrementalStage.for_model), which computes the values")
        runner.stage.value_head = model.value_head
        values = torch.zeros(B, L - P, dtype=torch.float32, device=dev)

    for i, r in enumerate(rows):  # turn 1's input is the prompt
        _check_turn_input(r, i, r.traj.token_ids)
    max_pos = limits.max_total_tokens - 1  # finished rows' pad columns may run past it
    # the prompts' prefill: as generate's (a left-pad query attends to itself)
    logits_BV = runner(prompt_ids.to(dev), position_ids_for(prompt_mask).to(dev),
                       None if key_pad is None else causal_padding_mask(prompt_mask.to(dev)))
    col = P  # columns [0, col) are in the cache
    while True:
        if col >= L:  # only reachable at EP > 1 with every row of this rank done
            raise RuntimeError(f"run_episodes: the cache ({L} columns) is full while the "
                               f"expert-parallel group is still running")
        policy = [not r.done and not r.pending for r in rows]
        if not any(policy):
            # only environment tokens (and finished rows) this step: prefill a chunk
            s = min([len(r.pending) for r in rows if not r.done] or [1])
            s = min(s, L - col)
            chunk = torch.full((B, s), pad_token_id, dtype=torch.long)  # host; to dev at the model call
            for b, r in enumerate(rows):
                if not r.done:
                    chunk[b] = torch.tensor(r.pending[:s])
                    del r.pending[:s]
            seq[:, col:col + s] = chunk
            step_ids = chunk
            _start_turns(rows, seq, starts, col + s)
        else:
            if values is not None:  # the last call ended at column col - 1: its state chooses col
                rows_B = torch.tensor(policy, dtype=torch.bool, device=dev)
                values[:, col - P] = torch.where(rows_B, runner.stage.last_values.float(), 0.0)
            step_ids, s = _policy_step(rows, logits_BV, seq, col, dims, cfg, limits, packed,
                                       stop_ids, generator, encode_observation, decode_fn,
                                       pad_token_id, vocab_size)
            _start_turns(rows, seq, starts, col + 1)
        all_done = all(r.done for r in rows)
        if ep_group is None and all_done:
            break  # the last step's tokens need no forward
        if ep_group is not None and all_done_in_group(all_done, ep_group, dev):
            break
        pos = (torch.arange(col, col + s, device=dev).unsqueeze(0) + offset_B1).clamp(0, max_pos)
        logits_BV = runner(step_ids.to(dev), pos, _step_mask(key_pad, col, s, dev))
        col += s
    if values is not None:  # every row's tokens sit from column P: to_padded_batch's columns
        host = values.cpu()
        for b, r in enumerate(rows):
            r.episode.values = host[b, :len(r.traj) - r.traj.prompt_length].tolist()


def _policy_step(rows, logits_BV, seq, col, dims, cfg, limits, packed, stop_ids, generator,
                 encode_observation, decode_fn, pad_token_id, vocab_size):
    """One column: policy rows sample, environment rows feed their next observation id.
    Returns the step's ``[B, 1]`` ids (host) and 1."""
    B = len(rows)
    if _leader(dims):
        early = None  # rows within rollout.min_new_tokens of their turn: no stop id (per turn)
        if cfg.min_new_tokens:
            early = torch.tensor([not r.done and not r.pending and len(r.turn_ids) < cfg.min_new_tokens
                                  for r in rows], dtype=torch.bool, device=logits_BV.device)
        tokens, lp = choose_tokens(
            logits_BV, vocab_size=vocab_size, greedy=cfg.greedy, temperature=cfg.temperature,
            top_k=cfg.top_k, top_p=cfg.top_p, generator=generator,
            suppress_ids=stop_ids if early is not None else None, suppress_rows=early)
        packed[0] = tokens.to(torch.float64)
        packed[1] = lp.to(torch.float64)
        packed[2] = torch.isin(tokens, stop_ids).to(torch.float64)
    _share_choice(dims, packed)
    host = packed.cpu()  # one device->host copy per step: the environments are host code
    step = torch.full((B, 1), pad_token_id, dtype=torch.long)  # host; to dev at the model call
    ended = []
    for b, r in enumerate(rows):
        if r.done:
            continue
        if r.pending:  # environment phase: feed the next observation id
            step[b, 0] = r.pending.pop(0)
            continue
        tok = int(host[0, b])
        step[b, 0] = tok
        r.turn_ids.append(tok)
        r.turn_lps.append(float(host[1, b]))
        stopped = bool(host[2, b])  # never within min_new_tokens: suppressed above
        if not stopped and cfg.stop_strings and len(r.turn_ids) > cfg.min_new_tokens:
            text = decode_fn(list(r.turn_ids))
            stopped = any(x in text for x in cfg.stop_strings)
        if stopped or len(r.turn_ids) >= _turn_cap(r, cfg, limits):
            ended.append((b, r, stopped))
    _finish_turns(ended, dims, limits, encode_observation, decode_fn, vocab_size)
    seq[:, col:col + 1] = step
    return step, 1


def _start_turns(rows: List[_Row], seq: torch.Tensor, starts: List[int], end: int) -> None:
    """Rows whose observation was fed completely by column ``end``: their next policy turn
    starts; check its input."""
    for b, r in enumerate(rows):
        if (not r.done and not r.pending and not r.turn_ids
                and len(r.prev_input) < len(r.traj) and starts[b] + len(r.traj) == end):
            _check_turn_input(r, b, seq[b, starts[b]:end].tolist())


def _run_recompute(model, dims, rows: List[_Row], cfg: RolloutConfig, limits: EnvLimits,
                   encode_observation, decode_fn, eos_token_id, pad_token_id, vocab_size,
                   max_sequence_length, call_index) -> None:
    turn = 0
    for i, r in enumerate(rows):
        _check_turn_input(r, i, r.traj.token_ids)
    while True:
        live = [(i, r) for i, r in enumerate(rows) if not r.done]
        if not live:
            return
        caps = [_turn_cap(r, cfg, limits) for _, r in live]
        R = max(caps)
        # one generate() per turn; a row whose conversation + R would not fit the model
        # gets a call of its own (generate decodes every row to R)
        fit = [k for k, (_, r) in enumerate(live) if len(r.traj) + R <= max_sequence_length]
        groups = ([fit] if fit else []) + [[k] for k in range(len(live)) if k not in fit]
        outs = {}
        for g, ks in enumerate(groups):
            batch = generate(model, dims, [live[k][1].traj.token_ids for k in ks],
                             replace(cfg, max_new_tokens=max(caps[k] for k in ks),
                                     min_new_tokens=min(cfg.min_new_tokens, max(caps[k] for k in ks))),
                             eos_token_id=eos_token_id, pad_token_id=pad_token_id,
                             vocab_size=vocab_size, max_sequence_length=max_sequence_length,
                             decode_fn=decode_fn,
                             call_index=(call_index * 1_000_003 + turn) * 1_009 + g)
            for j, k in enumerate(ks):
                outs[k] = (batch, j)
        turn += 1
        ended = []
        for k, ((i, r), cap) in enumerate(zip(live, caps)):
            batch, j = outs[k]
            n = min(int(batch.response_lengths[j]), cap)
            r.turn_ids = batch.response_ids[j, :n].tolist()
            r.turn_lps = batch.logprobs[j, :n].tolist()
            ended.append((i, r, bool(batch.ended[j]) and n == int(batch.response_lengths[j])))
        _finish_turns(ended, dims, limits, encode_observation, decode_fn, vocab_size)
        for i, r in live:
            if not r.done:
                r.pending = []  # generate's next call reads the whole trajectory
                _check_turn_input(r, i, r.traj.token_ids)


@dataclass
class EpisodeRolloutBatch(RolloutBatch):
    """A ``RolloutBatch`` of episodes (tensor fields on ``dims.device``, laid out by
    :func:`~nemo_rlhf.rollout.trajectory.to_padded_batch`: ``response_mask`` is the loss
    mask with holes on environment tokens) with the episodes themselves (host objects).
    Built by :class:`~nemo_rlhf.trainers.ppo.episode_source.EpisodeRolloutSource`; here, in
    the rollout layer, so the async transport can rebuild it."""

    episodes: List[Episode] = field(default_factory=list)
    """One :class:`~nemo_rlhf.rollout.episodes.Episode` per row, in row order."""

    episode_texts: List[str] = field(default_factory=list)
    """Each row's whole episode after the prompt (policy turns and observations) decoded,
    EOS dropped; filled by :meth:`EpisodeRolloutSource.generate_episodes` (the held-out
    evaluation's samples), empty for a training rollout."""

    def final_texts(self, decode, eos_id: int) -> list[str]:
        """Each row's final answer: its last policy turn decoded, EOS dropped."""
        out = []
        for ep in self.episodes:
            tr = ep.trajectory
            last = [s for s in tr.segments if s.kind == POLICY][-1]
            out.append(decode([t for t in tr.token_ids[last.start:last.end] if t != eos_id]))
        return out

    def turn_reward_placements(self) -> list[list[tuple[int, float]]]:
        """Per row, ``(response column, reward)`` of each turn the environment rewarded: the
        ``k``-th reward of ``Episode.turn_rewards`` at the last token of the ``k``-th policy
        segment (column = trajectory index - prompt length, :func:`to_padded_batch`'s layout);
        turns rewarded None are left out (the input of
        :func:`~nemo_rlhf.algorithms.ppo.token_rewards.turn_reward_tensor`)."""
        out = []
        for ep in self.episodes:
            tr = ep.trajectory
            ends = [s.end - 1 - tr.prompt_length for s in tr.segments if s.kind == POLICY]
            out.append([(end, float(r)) for end, r in zip(ends, ep.turn_rewards) if r is not None])
        return out
