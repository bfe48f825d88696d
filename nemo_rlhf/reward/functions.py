"""Reward functions and the one reward interface the PPO trainer calls.

A reward function is a plain callable
``fn(prompts: list[str], responses: list[str], extras: list[dict]) -> list[float]``
(one float per sample; ``extras[i]`` is the dataset row's extra fields, e.g. ``answer``).
They live in a small registry and are selected by registered name or by a dotted path
``"package.module:function"``.

:class:`CombinedReward` sums weighted *sources* -- the remote reward model
(:class:`RemoteRewardModel`) and/or reward functions (:class:`RewardFunctionScorer`) --
each optionally normalised first, and returns the total ``[batch]`` tensor plus the
per-source values for metrics.

Simplified on purpose: sources are called one after another (the remote RM is the slow
one and batches on its side); the checkers parse decimal integers only.
"""

from __future__ import annotations

import importlib
import math
import numbers
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Protocol, Sequence

import torch

from nemo_rlhf.reward.normalization import RewardNormalizer

__all__ = [
    "CombinedReward",
    "RemoteRewardModel",
    "RewardFn",
    "RewardFunctionScorer",
    "RewardOutput",
    "RewardSource",
    "WeightedSource",
    "arithmetic_exact_match",
    "first_integer",
    "get_reward_function",
    "register_reward_function",
    "registered_reward_functions",
    "addition_answer",
    "just_the_number",
    "two_digit_addition",
]

RewardFn = Callable[[list[str], list[str], list[dict]], list[float]]
_REGISTRY: dict[str, RewardFn] = {}


def register_reward_function(name: str) -> Callable[[RewardFn], RewardFn]:
    """Decorator registering ``fn`` under ``name``; raises ``ValueError`` on a duplicate name."""

    def decorate(fn: RewardFn) -> RewardFn:
        if name in _REGISTRY and _REGISTRY[name] is not fn:
            raise ValueError(f"reward function {name!r} is already registered ({_REGISTRY[name].__module__})")
        _REGISTRY[name] = fn
        return fn

    return decorate


def registered_reward_functions() -> list[str]:
    """Registered reward function names, sorted."""
    return sorted(_REGISTRY)


def get_reward_function(spec: str) -> RewardFn:
    """The reward function for a registered name or a ``"package.module:function"`` path.

    Raises ``KeyError`` listing the registered names for an unknown name, ``ImportError``
    / ``AttributeError`` naming the module or attribute for a bad path, ``TypeError`` when
    the target is not callable.
    """
    if not isinstance(spec, str) or not spec:
        raise TypeError(f"reward function spec must be a non-empty string, got {spec!r}")
    if ":" not in spec:
        if spec not in _REGISTRY:
            raise KeyError(
                f"unknown reward function {spec!r}; registered: {', '.join(registered_reward_functions())} "
                f"(or give a dotted path 'package.module:function')"
            )
        return _REGISTRY[spec]
    module_name, _, attr = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ImportError(f"reward function {spec!r}: cannot import module {module_name!r}: {exc}") from exc
    fn: Any = module
    for part in attr.split("."):
        if not hasattr(fn, part):
            raise AttributeError(f"reward function {spec!r}: module {module_name!r} has no attribute {attr!r}")
        fn = getattr(fn, part)
    if not callable(fn):
        raise TypeError(f"reward function {spec!r} is a {type(fn).__name__}, not a callable")
    return fn


# --------------------------------------------------------------------------- checkers
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def first_integer(text: str, anchored: bool = False) -> int | None:
    """The first number in ``text`` if it is an integer, else None.

    A number is ``-?digits`` with an optional ``.digits`` fraction; a number with a
    fraction (``21.5``) is not an integer, so it yields None, but a trailing period
    (``21.``) is punctuation. ``anchored=True``: the number must start ``text`` after
    whitespace is stripped (``" 21\\n"`` -> 21, ``"x 21"`` -> None).
    """
    text = text.strip()
    match = _NUMBER.match(text) if anchored else _NUMBER.search(text)
    if match is None or "." in match.group():
        return None
    return int(match.group())


def _answers(extras: Sequence[Mapping[str, Any]], fn_name: str) -> list[int]:
    answers = []
    for i, ex in enumerate(extras):
        if "answer" not in ex:
            raise KeyError(f"{fn_name}: extras[{i}] has no 'answer'; keys present: {sorted(ex)}")
        try:
            answers.append(int(str(ex["answer"]).strip()))
        except ValueError:
            raise ValueError(f"{fn_name}: extras[{i}]['answer']={ex['answer']!r} is not an integer") from None
    return answers


def _check_lengths(prompts: Sequence, responses: Sequence, extras: Sequence, fn_name: str) -> None:
    if not len(prompts) == len(responses) == len(extras):
        raise ValueError(f"{fn_name}: {len(prompts)} prompts, {len(responses)} responses, {len(extras)} extras; "
                         f"they must have the same length")


@register_reward_function("arithmetic_exact_match")
def arithmetic_exact_match(prompts: list[str], responses: list[str], extras: list[dict]) -> list[float]:
    """1.0 when the response *starts* (after whitespace) with the integer ``extras[i]["answer"]``.

    For completion prompts like ``"3+3*6="`` with ``{"answer": "21"}``: ``"21"``, ``" 21\\n"``
    and ``"21."`` score 1.0; ``"36"``, ``""``, ``"21.5"`` and ``"is 21"`` score 0.0;
    ``"-3"`` scores 1.0 for answer ``"-3"``. Raises ``KeyError`` / ``ValueError`` naming
    the index when an answer is missing or not an integer.
    """
    _check_lengths(prompts, responses, extras, "arithmetic_exact_match")
    answers = _answers(extras, "arithmetic_exact_match")
    return [1.0 if first_integer(r, anchored=True) == a else 0.0 for r, a in zip(responses, answers)]


_ADDITION = re.compile(r"(-?\d+)\s*\+\s*(-?\d+)")
_JUST_A_NUMBER = re.compile(r"-?\d+\.?")


def _expected_sums(prompts: Sequence[str], extras: Sequence[Mapping[str, Any]], fn_name: str) -> list[int]:
    out = []
    for i, (prompt, ex) in enumerate(zip(prompts, extras)):
        if "answer" in ex:
            out.append(_answers([ex], fn_name)[0])
            continue
        match = _ADDITION.search(prompt)
        if match is None:
            raise ValueError(f"{fn_name}: extras[{i}] has no 'answer' and prompts[{i}] has no 'a+b': {prompt[:80]!r}")
        out.append(int(match.group(1)) + int(match.group(2)))
    return out


def addition_answer(response: str) -> int | None:
    """The integer a chat answer to ``"What is a+b?"`` gives, or None.

    Restatements of a sum (``a+b``, ``a + b``) are removed first, then the first integer
    left is the answer: ``"54"``, ``"The answer is 54."`` and ``"26 + 28 = 54"`` give 54;
    ``"26+28 is 26+28, which is"`` gives None; ``"54 or 55"`` gives 54 (first answer wins,
    so hedging does not pay).
    """
    return first_integer(_ADDITION.sub(" ", response))


@register_reward_function("two_digit_addition")
def two_digit_addition(prompts: list[str], responses: list[str], extras: list[dict]) -> list[float]:
    """1.0 when a chat answer states the sum asked for (:func:`addition_answer`), else 0.0.

    For prompts like ``"What is 26+28? Answer with just the number."``: the expected value
    is ``extras[i]["answer"]`` when present, else the ``a+b`` found in the prompt.
    ``"54"``, ``"The answer is 54."`` and ``"26+28=54"`` score 1.0; ``"55"``, ``"26+28"``
    and ``""`` score 0.0. Raises ``ValueError`` naming the index when neither source gives
    an answer.
    """
    _check_lengths(prompts, responses, extras, "two_digit_addition")
    expected = _expected_sums(prompts, extras, "two_digit_addition")
    return [1.0 if addition_answer(r) == e else 0.0 for r, e in zip(responses, expected)]


@register_reward_function("just_the_number")
def just_the_number(prompts: list[str], responses: list[str], extras: list[dict]) -> list[float]:
    """Format compliance: 1.0 when the whole response is one integer (``"54"``, ``" 54.\n"``),
    right or wrong; 0.0 otherwise (``"The answer is 54."``, ``"26+28=54"``, ``""``)."""
    _check_lengths(prompts, responses, extras, "just_the_number")
    return [1.0 if _JUST_A_NUMBER.fullmatch(r.strip()) else 0.0 for r in responses]


# --------------------------------------------------------------------------- sources
class RewardSource(Protocol):
    """Anything :class:`CombinedReward` can sum: one float per sample."""

    def score(self, prompts: list[str], responses: list[str], extras: list[dict]) -> list[float]:
        """``[batch]`` floats for parallel lists of prompts, responses and extras."""
        ...


def _check_source_output(values: Any, n: int, who: str) -> list[float]:
    values = list(values.tolist() if hasattr(values, "tolist") else values)
    if len(values) != n:
        raise ValueError(f"{who} returned {len(values)} rewards for {n} samples")
    for i, v in enumerate(values):
        if isinstance(v, bool) or not isinstance(v, numbers.Real) or not math.isfinite(v):
            raise ValueError(f"{who} returned {v!r} at position {i}; expected a finite float")
    return [float(v) for v in values]


class RewardFunctionScorer:
    """Adapts a reward function (callable, registered name or dotted path) to :class:`RewardSource`.

    ``score`` checks the function returned one finite float per sample and raises
    ``ValueError`` naming the function otherwise.
    """

    def __init__(self, fn: RewardFn | str) -> None:
        self.fn = get_reward_function(fn) if isinstance(fn, str) else fn
        self.name = fn if isinstance(fn, str) else getattr(fn, "__name__", repr(fn))

    def score(self, prompts: list[str], responses: list[str], extras: list[dict]) -> list[float]:
        """``[batch]`` floats from the wrapped function."""
        return _check_source_output(self.fn(prompts, responses, extras), len(prompts), f"reward function {self.name!r}")


class RemoteRewardModel:
    """The served reward model as a :class:`RewardSource` (text form; extras are unused).

    ``client``: a :class:`~nemo_rlhf.reward.client.RewardModelClient`; its
    ``RewardServiceError`` propagates -- a failed score is never replaced.
    """

    def __init__(self, client: Any) -> None:
        self.client = client

    def score(self, prompts: list[str], responses: list[str], extras: list[dict]) -> list[float]:
        """``[batch]`` RM scores for the (prompt, response) texts."""
        return self.client.score_texts(prompts, responses)


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

    def metrics(self, prefix: str = "reward/") -> dict[str, float]:
        """Batch means: ``{prefix}total`` and, per source, ``{prefix}{name}`` (raw) and
        ``{prefix}{name}_normalized``."""
        out = {f"{prefix}total": self.scores.mean().item()}
        for name, values in self.per_source.items():
            out[f"{prefix}{name}"] = values.mean().item()
            out[f"{prefix}{name}_normalized"] = self.per_source_normalized[name].mean().item()
        return out


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
                 gather: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        if not sources:
            raise ValueError("CombinedReward needs at least one source")
        names = [s.name for s in sources]
        if len(set(names)) != len(names):
            raise ValueError(f"CombinedReward: duplicate source names in {names}")
        self.sources = list(sources)
        self.gather = gather

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
        """Every source's raw values: name -> ``[batch]`` float32 (host). No collective.

        Raises:
            ValueError: mismatched lengths, or a source returned a wrong count or a
                non-finite value; any source's own error (e.g. ``RewardServiceError``).
        """
        prompts, responses = list(prompts), list(responses)
        extras = [{} for _ in prompts] if extras is None else list(extras)
        _check_lengths(prompts, responses, extras, "CombinedReward.score")
        raw = {}
        for src in self.sources:
            values = src.source.score(prompts, responses, extras)
            raw[src.name] = torch.tensor(  # host
                _check_source_output(values, len(prompts), f"reward source {src.name!r}"),
                dtype=torch.float32, device="cpu")
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
        for src in self.sources:
            values = raw[src.name]
            normed = (src.normalizer(values, update=update_stats, gather=self.gather)
                      if src.normalizer is not None and normalize else values)
            out.per_source[src.name] = values
            out.per_source_normalized[src.name] = normed
            total += src.weight * normed
            raw_total += src.weight * values
        return out

    def state_dict(self) -> dict[str, Any]:
        """``{source name: normaliser state}`` for sources with a normaliser."""
        return {s.name: s.normalizer.state_dict() for s in self.sources if s.normalizer is not None}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restores :meth:`state_dict`; raises ``KeyError`` naming a source missing from ``state``."""
        for s in self.sources:
            if s.normalizer is None:
                continue
            if s.name not in state:
                raise KeyError(f"CombinedReward.load_state_dict: no state for source {s.name!r}; present: {sorted(state)}")
            s.normalizer.load_state_dict(state[s.name])
