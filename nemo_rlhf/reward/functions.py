"""Reward functions and the one reward interface the PPO trainer calls.

A reward function is a plain callable
``fn(prompts: list[str], responses: list[str], extras: list[dict]) -> list[float]``
(one float per sample; ``extras[i]`` is the dataset row's extra fields, e.g. ``answer``).
A config names one by its path ``"package.module:function"`` (imported when it is
resolved) or, for the demo tasks' checkers, by a short name of the fixed table
:data:`BUILTIN_REWARD_FUNCTIONS`; nothing is registered at import, so a config is valid or
not whatever the process imported before.

:class:`CombinedReward` sums weighted *sources* -- the remote reward model
(:class:`RemoteRewardModel`) and/or reward functions (:class:`RewardFunctionScorer`) --
each optionally normalised first, and returns the total ``[batch]`` tensor plus the
per-source values for metrics.

Simplified on purpose: sources are called one after another (the remote RM is the slow
one and batches on its side).
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Protocol, Sequence

import torch

from nemo_rlhf.config import callable_path, check_choice, resolve_callable
from nemo_rlhf.data.answers import check_lengths
from nemo_rlhf.reward.normalization import RewardNormalizer

__all__ = [
    "CONVERSATION_EXTRA",
    "CombinedReward",
    "RM_INPUTS",
    "RemoteRewardModel",
    "RewardFn",
    "RewardFunctionScorer",
    "RewardOutput",
    "RewardSource",
    "WeightedSource",
    "BUILTIN_REWARD_FUNCTIONS",
    "check_reward_function_spec",
    "get_reward_function",
    "means_from_sums",
    "rm_items",
    "score_with_client",
]

RewardFn = Callable[[list[str], list[str], list[dict]], list[float]]

BUILTIN_REWARD_FUNCTIONS: dict[str, str] = {
    "arithmetic_exact_match": "nemo_rlhf.tasks.precedence:arithmetic_exact_match",
    "two_digit_addition": "nemo_rlhf.tasks.addition:two_digit_addition",
    "just_the_number": "nemo_rlhf.tasks.addition:just_the_number",
    "env": "nemo_rlhf.envs.builtin:env_reward",
}
"""Short name -> ``"package.module:function"`` of the demo tasks' checkers (and ``env``: the
environment's episode reward of a multi-turn rollout, ``env.name``): the only short
names a config may use (``reward.functions[i].name``, ``trainer.eval_checker``,
``checker``, ...); every other reward function is named by its path. A fixed table, so
whether a config is valid does not depend on what the process imported before; the
modules are imported only when a function is resolved (:func:`get_reward_function`)."""


def _path_of(spec: Any) -> str | None:
    """``spec``'s ``"package.module:function"`` path (a built-in name's from the table), or
    None when ``spec`` is neither a built-in name nor of that form."""
    return callable_path(spec, BUILTIN_REWARD_FUNCTIONS)


def _bad_spec(key: str, spec: Any) -> str:
    return (f"{key}={spec!r}: valid choices are {sorted(BUILTIN_REWARD_FUNCTIONS)} (the built-in "
            f"short names) or a 'package.module:function' path")


def check_reward_function_spec(key: str, spec: Any) -> None:
    """Config-time check of a reward function spec (``reward.functions[i].name``, a
    checker): a name of :data:`BUILTIN_REWARD_FUNCTIONS` or a ``package.module:function``
    path. Nothing is imported here (a path's module is imported when the function is
    resolved, :func:`get_reward_function`), so the answer does not depend on what the
    process imported.

    Raises:
        ValueError: naming ``key``, the value and the valid short names.
    """
    if _path_of(spec) is None:
        raise ValueError(_bad_spec(key, spec))


def get_reward_function(spec: str, key: str = "reward function") -> RewardFn:
    """The reward function a built-in short name (:data:`BUILTIN_REWARD_FUNCTIONS`) or a
    ``"package.module:function"`` path names (``function`` may be dotted, e.g.
    ``module:TASK.score``); imports the module.

    Args:
        spec: the name or path.
        key: the config key ``spec`` came from, named in the errors.

    Raises:
        ValueError: ``spec`` is neither (naming ``key``, the value and the short names);
        ImportError / AttributeError: the module cannot be imported / has no such
        attribute (naming ``key``, the value and the module or attribute tried);
        TypeError: the target is not callable.
    """
    path = _path_of(spec)
    if path is None:
        raise ValueError(_bad_spec(key, spec))
    return resolve_callable(spec, path, key)


# --------------------------------------------------------------------------- sources
class RewardSource(Protocol):
    """Anything :class:`CombinedReward` can sum: one float per sample."""

    def score(self, prompts: list[str], responses: list[str], extras: list[dict]) -> list[float]:
        """``[batch]`` floats for parallel lists of prompts, responses and extras."""
        ...


def _check_source_output(values: Any, n: int, who: str, allow_nonfinite: bool = False) -> list[float]:
    values = list(values.tolist() if hasattr(values, "tolist") else values)
    if len(values) != n:
        raise ValueError(f"{who} returned {len(values)} rewards for {n} samples")
    for i, v in enumerate(values):
        if isinstance(v, bool) or not isinstance(v, numbers.Real):
            raise ValueError(f"{who} returned {v!r} at position {i}; expected a finite float")
        if not allow_nonfinite and not math.isfinite(v):
            raise ValueError(f"{who} returned {v!r} at position {i}; expected a finite float "
                             f"(reward.invalid_scores=error; 'skip' leaves such samples out of the step)")
    return [float(v) for v in values]


INVALID_SCORE_ACTIONS = ("error", "skip")
"""``reward.invalid_scores``: what a NaN / Inf / too large score does (:class:`CombinedReward`)."""


class RewardFunctionScorer:
    """Adapts a reward function (callable, built-in name or ``package.module:function``
    path, :func:`get_reward_function`; ``key``: the config key a name came from, named in
    its errors) to :class:`RewardSource`.

    ``score`` checks the function returned one float per sample (finite, unless
    ``allow_nonfinite``: :class:`CombinedReward` judges NaN / Inf) and raises
    ``ValueError`` naming the function otherwise.
    """

    def __init__(self, fn: RewardFn | str, key: str = "reward function") -> None:
        self.fn = get_reward_function(fn, key) if isinstance(fn, str) else fn
        self.name = fn if isinstance(fn, str) else getattr(fn, "__name__", repr(fn))
        self.allow_nonfinite = False

    def score(self, prompts: list[str], responses: list[str], extras: list[dict]) -> list[float]:
        """``[batch]`` floats from the wrapped function."""
        return _check_source_output(self.fn(prompts, responses, extras), len(prompts),
                                    f"reward function {self.name!r}", self.allow_nonfinite)


RM_INPUTS = ("conversation", "final_answer")
"""``reward.rm_input``: what the served RM reads of a multi-turn episode (:func:`rm_items`)."""

CONVERSATION_EXTRA = "conversation"
"""The ``extras`` key of a multi-turn row's whole conversation (set by the PPO trainer,
``episode_extras``): ``{"messages": [{"role", "content"}, ...], "prompt_ids": [int],
"response_ids": [int]}`` -- the prompt and every turn as messages (policy turns
``assistant``, observations the environment's role), and the trajectory's own ids (the
prompt's; everything after it, policy and environment tokens)."""


def rm_items(prompts: Sequence[str], responses: Sequence[str], extras: Sequence[dict], rm_input: str,
             send_ids: bool) -> list[dict] | None:
    """The served RM's wire items (``POST /score``) of a batch, or None when every row is
    the single-turn text item (then the caller sends today's request, ``score_texts``).

    A row whose ``extras`` hold :data:`CONVERSATION_EXTRA` (a multi-turn episode) with
    ``rm_input="conversation"``: the trajectory's ids (``{"prompt_ids", "response_ids"}``)
    when ``send_ids`` (the RM shares the policy's tokenizer, chat template and system
    prompt, so these are the ids its rendering gives, and the policy's tokens are not
    decoded and re-encoded), else its ``messages`` (the server renders them with the RM's
    chat template). Every other row, and every row with ``rm_input="final_answer"``:
    ``{"prompt", "response"}``, the response being the episode's final answer.

    Raises:
        ValueError: an unknown ``rm_input`` (naming ``reward.rm_input`` and the choices).
    """
    check_choice("reward.rm_input", rm_input, RM_INPUTS)
    convs = [e.get(CONVERSATION_EXTRA) for e in extras]
    if rm_input == "final_answer" or all(c is None for c in convs):
        return None
    out = []
    for prompt, response, conv in zip(prompts, responses, convs):
        if conv is None:
            out.append({"prompt": prompt, "response": response})
        elif send_ids:
            out.append({"prompt_ids": list(conv["prompt_ids"]), "response_ids": list(conv["response_ids"])})
        else:
            out.append({"messages": [dict(m) for m in conv["messages"]]})
    return out


def score_with_client(client: Any, prompts: Sequence[str], responses: Sequence[str], extras: Sequence[dict],
                      rm_input: str, send_ids: bool) -> list[float]:
    """``client``'s scores of a batch: ``score_texts`` (the single-turn request, unchanged)
    unless :func:`rm_items` gives conversation items, then ``score`` of those."""
    items = rm_items(prompts, responses, extras, rm_input, send_ids)
    if items is None:
        return client.score_texts(list(prompts), list(responses))
    return client.score(items)


class RemoteRewardModel:
    """The served reward model as a :class:`RewardSource`.

    Args:
        client: a :class:`~nemo_rlhf.reward.client.RewardModelClient`; its
            ``RewardServiceError`` propagates -- a failed score is never replaced.
        rm_input: what it reads of a multi-turn episode (:data:`RM_INPUTS`, ``reward.rm_input``):
            ``conversation`` (the whole episode) or ``final_answer`` (its last policy turn,
            as a single-turn response). Single-turn rows are the (prompt, response) texts
            either way.
        send_ids: send a conversation as the trajectory's own ids rather than messages
            (:func:`rm_items`; decided from the RM's ``/metadata`` in
            :func:`~nemo_rlhf.trainers.ppo.scoring.build_reward`).
    """

    def __init__(self, client: Any, rm_input: str = "final_answer", send_ids: bool = False) -> None:
        check_choice("reward.rm_input", rm_input, RM_INPUTS)
        self.client = client
        self.rm_input = rm_input
        self.send_ids = send_ids

    def score(self, prompts: list[str], responses: list[str], extras: list[dict]) -> list[float]:
        """``[batch]`` RM scores: of the (prompt, response) texts, or of the episodes'
        conversations (:func:`rm_items`)."""
        return score_with_client(self.client, prompts, responses, extras, self.rm_input, self.send_ids)


@dataclass
class WeightedSource:
    """One term of :class:`CombinedReward`: ``weight * normalizer(source.score(...))``."""

    name: str
    """Key of this source in metrics and in the state dict, e.g. ``rm`` or ``exact_match``."""
    source: RewardSource
    """Produces the raw ``[batch]`` rewards."""
    weight: float = 1.0
    """Multiplier of the (normalised) rewards in the sum."""
    normalizer: RewardNormalizer | None = None
    """Applied to the raw rewards before weighting; None: raw rewards."""
    identity: dict[str, Any] | None = None
    """What this source is, JSON-able (the served RM: ``checkpoint_path`` and
    ``checkpoint_step`` from its ``/metadata``); None: fixed by its name (a function).
    A resumed run compares it with the saved one: statistics of another reward model are
    not carried over (:meth:`CombinedReward.load_state_dict`)."""


@dataclass
class RewardOutput:
    """Result of :meth:`CombinedReward.score`.

    ``scores``: ``[batch]`` float32, the weighted sum. ``per_source``: name -> ``[batch]``
    float32 raw rewards; ``per_source_normalized``: name -> ``[batch]`` after
    normalisation and clipping, before weighting; ``raw_scores``: ``[batch]`` float32,
    the weighted sum of the raw rewards (no normalisation: comparable across steps).
    """

    scores: torch.Tensor
    per_source: dict[str, torch.Tensor] = field(default_factory=dict)
    per_source_normalized: dict[str, torch.Tensor] = field(default_factory=dict)
    raw_scores: torch.Tensor | None = None
    valid: torch.Tensor | None = None
    """``[batch]`` bool (host): False where a source's score was invalid (NaN, Inf, past
    ``max_abs_score``) under ``invalid_scores="skip"``; ``scores`` and ``raw_scores`` are
    NaN there. None: every score valid (``"error"`` raises instead)."""
    invalid: list[tuple[str, int, float]] = field(default_factory=list)
    """``(source name, position, value)`` of every invalid score (``"skip"``)."""
    skipping: bool = False
    """Whether invalid scores were judged and skipped (``invalid_scores="skip"``)."""
    diagnostics: dict[str, torch.Tensor] = field(default_factory=dict)
    """``{source}_{key}`` -> ``[batch]`` float32 per-sample numbers a source reports beside
    its scores (a source's ``diagnostics()``, e.g. ``rm_ensemble_std``): not summed,
    reported as their means over the valid samples."""

    def metric_sums(self, prefix: str = "reward/") -> tuple[list[str], torch.Tensor]:
        """The sums behind :meth:`metrics`, for a reduction over ranks.

        Returns:
            ``(names, sums)``: the metric names (``{prefix}total``, then per source
            ``{prefix}{name}`` and ``{prefix}{name}_normalized``, then the diagnostics, in
            that order: the same on every rank of one config) and a ``[len(names) + 1]``
            float64 host tensor of their sums over the valid samples, the valid samples'
            count last. Summed over ranks and divided by the summed count they give the
            mean over every rank's valid samples (not a mean of the ranks' means).
        """
        keep = self.valid if self.valid is not None else torch.ones(len(self.scores), dtype=torch.bool)  # host, as the scores
        names, columns = [f"{prefix}total"], [self.scores]
        for name, values in self.per_source.items():
            names += [f"{prefix}{name}", f"{prefix}{name}_normalized"]
            columns += [values, self.per_source_normalized[name]]
        for key, values in self.diagnostics.items():
            names.append(f"{prefix}{key}")
            columns.append(values)
        sums = [c[keep].double().sum() for c in columns]
        return names, torch.stack([*sums, keep.sum().double()])  # host

    def metrics(self, prefix: str = "reward/") -> dict[str, float]:
        """Batch means over the valid samples: ``{prefix}total`` and, per source,
        ``{prefix}{name}`` (raw) and ``{prefix}{name}_normalized``, and each diagnostic
        (e.g. ``{prefix}rm_ensemble_std``: the mean over samples of each sample's spread over
        the ensemble's members). NaN with no valid sample. This batch alone: the trainer
        reduces :meth:`metric_sums` over its scoring ranks instead
        (:func:`~nemo_rlhf.trainers.ppo.scoring.step_scores`)."""
        names, sums = self.metric_sums(prefix)
        return means_from_sums(names, sums)


def means_from_sums(names: Sequence[str], sums: torch.Tensor) -> dict[str, float]:
    """``{name: sum / count}`` from :meth:`RewardOutput.metric_sums`' ``(names, sums)`` (or
    their sums over ranks); NaN where the count is 0."""
    count = float(sums[-1])
    return {name: float(sums[i]) / count if count else float("nan") for i, name in enumerate(names)}


class CombinedReward:
    """The reward the PPO trainer calls: a weighted sum of sources.

    ``score(prompts, responses, extras)`` -> :class:`RewardOutput` with ``scores``
    ``[batch]`` float32. Any source's failure propagates; nothing is filled in.
    ``state_dict`` holds every running normaliser's statistics, keyed by source name.

    ``score`` is :meth:`fetch` (the sources' raw values: I/O, may fail, no collective)
    then :meth:`combine` (normalise and sum). With data parallelism, ``gather`` maps this
    rank's running-normaliser moments ``[3] float64`` to every scoring rank's ``[n, 3]``
    (see :meth:`RewardNormalizer.update`), so all ranks normalise with one statistic;
    :meth:`combine` with ``update_stats=True`` is then a collective over those ranks.
    """

    def __init__(self, sources: Sequence[WeightedSource],
                 gather: Callable[[torch.Tensor], torch.Tensor] | None = None,
                 max_abs_score: float | None = None, invalid_scores: str = "error") -> None:
        if max_abs_score is not None and not max_abs_score > 0:
            raise ValueError(f"reward.max_abs_score={max_abs_score}: must be > 0 (or null: off)")
        check_choice("reward.invalid_scores", invalid_scores, INVALID_SCORE_ACTIONS)
        self.max_abs_score = max_abs_score
        """A raw source value with ``|value| > max_abs_score`` is invalid (None: no limit)."""
        self.invalid_scores = invalid_scores
        """``error``: an invalid value (NaN, Inf, past ``max_abs_score``) raises in
        :meth:`fetch`; ``skip``: :meth:`combine` marks its sample invalid
        (:attr:`RewardOutput.valid`) and leaves it out of the sums and the statistics."""
        if not sources:
            raise ValueError("CombinedReward needs at least one source")
        names = [s.name for s in sources]
        if len(set(names)) != len(names):
            raise ValueError(f"CombinedReward: duplicate source names in {names}")
        self.sources = list(sources)
        self.gather = gather
        for src in self.sources:
            if invalid_scores == "skip" and hasattr(src.source, "allow_nonfinite"):
                src.source.allow_nonfinite = True  # judged here, counted, not raised

    def score(self, prompts: Sequence[str], responses: Sequence[str], extras: Sequence[dict] | None = None,
              update_stats: bool = True, normalize: bool = True) -> RewardOutput:
        """Scores a batch. ``extras`` defaults to ``{}`` per sample; ``update_stats=False``
        leaves running normalisers' statistics unchanged (e.g. for validation);
        ``normalize=False`` sums the *raw* source values (evaluation: scores comparable
        across steps, independent of running statistics)."""
        return self.combine(self.fetch(prompts, responses, extras), update_stats=update_stats,
                            normalize=normalize)

    def fetch(self, prompts: Sequence[str], responses: Sequence[str],
              extras: Sequence[dict] | None = None) -> dict[str, torch.Tensor]:
        """Every source's raw values: name -> ``[batch]`` float32 (host), and the
        diagnostics of sources that have a ``diagnostics()`` method under
        ``{name}_{key}`` (:attr:`RewardOutput.diagnostics`). No collective.

        Raises:
            ValueError: mismatched lengths, or a source returned a wrong count, a
                non-number, or (``invalid_scores="error"``) a non-finite value or one past
                ``max_abs_score`` (named with its position); any source's own error (e.g.
                ``RewardServiceError``).
        """
        prompts, responses = list(prompts), list(responses)
        extras = [{} for _ in prompts] if extras is None else list(extras)
        check_lengths(prompts, responses, extras, "CombinedReward.score")
        raw = {}
        skip = self.invalid_scores == "skip"
        for src in self.sources:
            values = src.source.score(prompts, responses, extras)
            values = _check_source_output(values, len(prompts), f"reward source {src.name!r}",
                                          allow_nonfinite=skip)
            if self.max_abs_score is not None and not skip:
                for i, v in enumerate(values):
                    if abs(v) > self.max_abs_score:
                        raise ValueError(
                            f"reward source {src.name!r} returned {v!r} at position {i}: past "
                            f"reward.max_abs_score={self.max_abs_score:g} (a broken reward model or "
                            f"function?); raise reward.max_abs_score if such scores are meant, or set "
                            f"reward.invalid_scores=skip to leave such samples out of the step")
            raw[src.name] = torch.tensor(values, dtype=torch.float32, device="cpu")  # host
            for key, extra in getattr(src.source, "diagnostics", dict)().items():
                raw[f"{src.name}_{key}"] = extra.to(device="cpu", dtype=torch.float32)  # host
        return raw

    def combine(self, raw: Mapping[str, torch.Tensor], update_stats: bool = True,
                normalize: bool = True) -> RewardOutput:
        """Normalise (optionally) and sum :meth:`fetch`'s raw values into a :class:`RewardOutput`.

        With ``update_stats`` and a running normaliser this calls ``gather`` (when set):
        every scoring rank must call it together.
        """
        n = len(next(iter(raw.values())))
        total = torch.zeros(n, dtype=torch.float32, device="cpu")  # host
        raw_total = torch.zeros(n, dtype=torch.float32, device="cpu")  # host
        out = RewardOutput(scores=total, raw_scores=raw_total)
        valid = torch.ones(n, dtype=torch.bool, device="cpu")  # host
        out.skipping = self.invalid_scores == "skip"
        if out.skipping:
            for src in self.sources:
                values = raw[src.name]
                bad = ~torch.isfinite(values)
                if self.max_abs_score is not None:
                    bad |= values.abs() > self.max_abs_score
                out.invalid += [(src.name, i, float(values[i])) for i in bad.nonzero().flatten().tolist()]
                valid &= ~bad
        for src in self.sources:
            values = raw[src.name]
            norm = src.normalizer if normalize else None
            if norm is not None and bool(valid.all()):
                normed = norm(values, update=update_stats, gather=self.gather)
            elif norm is not None:
                # only the valid samples enter the statistics; an empty set still joins the
                # scoring ranks' gather, and nothing raises here (a step with no valid
                # sample on any rank is stopped by the caller, on every rank)
                if update_stats and norm.mode == "running":
                    norm.update(values[valid], gather=self.gather)
                normed = torch.zeros(n, dtype=torch.float32, device="cpu")  # host
                if bool(valid.any()) and (norm.mode != "running" or norm.count > 0):
                    normed[valid] = norm(values[valid], update=False)
            else:
                normed = torch.where(valid, values, 0.0)
            out.per_source[src.name] = values
            out.per_source_normalized[src.name] = normed
            total += src.weight * normed
            raw_total += src.weight * torch.where(valid, values, 0.0)
        names = {src.name for src in self.sources}
        out.diagnostics = {k: v for k, v in raw.items() if k not in names}
        if not bool(valid.all()):
            out.valid = valid
            total[~valid] = float("nan")
            raw_total[~valid] = float("nan")
        return out

    def state_dict(self) -> dict[str, Any]:
        """``{source name: normaliser state}`` for sources with a normaliser."""
        return {s.name: s.normalizer.state_dict() for s in self.sources if s.normalizer is not None}

    def identities(self) -> dict[str, dict[str, Any]]:
        """``{source name: identity}`` for sources that have one (see :attr:`WeightedSource.identity`)."""
        return {s.name: dict(s.identity) for s in self.sources if s.identity is not None}

    def changed_sources(self, saved: Mapping[str, Any]) -> dict[str, tuple[Any, Any]]:
        """Sources whose identity differs from ``saved`` (a previous :meth:`identities`):
        ``{name: (saved identity or None, current identity)}``. A source with an identity
        and no saved one counts as changed only when ``saved`` records other sources (a
        checkpoint written before identities were recorded records none)."""
        changed = {}
        for name, now in self.identities().items():
            before = saved.get(name)
            if before is None and not saved:
                continue
            if before != now:
                changed[name] = (before, now)
        return changed

    def load_state_dict(self, state: Mapping[str, Any], reset: Sequence[str] = ()) -> None:
        """Restores :meth:`state_dict`, except the sources named in ``reset``, whose
        normalisers start over (e.g. the RM was replaced by a refreshed one: its score
        scale is not the old one's). Raises ``KeyError`` naming a source missing from
        ``state``, or a ``reset`` name that is not a source."""
        unknown = set(reset) - {s.name for s in self.sources}
        if unknown:
            raise KeyError(f"CombinedReward.load_state_dict: reset names unknown sources {sorted(unknown)}; "
                           f"sources: {[s.name for s in self.sources]}")
        for s in self.sources:
            if s.normalizer is None or s.name in reset:
                continue
            if s.name not in state:
                raise KeyError(f"CombinedReward.load_state_dict: no state for source {s.name!r}; present: {sorted(state)}")
            s.normalizer.load_state_dict(state[s.name])
