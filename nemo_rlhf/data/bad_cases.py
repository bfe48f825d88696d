"""Bad-case replay: the policy's own samples on which the reward model and the labeller
disagree, as new preference pairs for the next round of RM training.

The RLHF loop of the textbook chapter (and of InstructGPT's later rounds): when the RM's
reward and a trusted metric diverge, collect the policy's current outputs, have them
labelled, keep the cases the RM gets wrong and train the RM on them. Here the labeller is
whatever scored the samples (``correct``: a rule checker in the demo, human or judge labels
in general) and the RM's opinion is ``rm_score``; both come from one JSONL written by
``python -m nemo_rlhf.evaluate ... rm_checkpoint=<rm> samples_out=<file>``.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Mapping, Sequence

from nemo_rlhf.data.sample_rows import row_extras

__all__ = ["DisagreementStats", "disagreement_pairs", "labelled_pairs"]


@dataclass
class DisagreementStats:
    """What :func:`disagreement_pairs` found.

    ``prompts``: distinct prompts in the samples; ``comparable_prompts``: prompts with at
    least two responses the labeller ranks differently; ``candidate_pairs``: every
    (labeller-preferred, labeller-dispreferred) pair of distinct responses of one prompt;
    ``disagreements``: candidate pairs the RM ranks the other way or ties;
    ``disagreement_rate``: their fraction (0.0 when there is no candidate pair);
    ``kept_pairs``: pairs returned after the per-prompt cap.
    """

    prompts: int
    comparable_prompts: int
    candidate_pairs: int
    disagreements: int
    disagreement_rate: float
    kept_pairs: int

    def as_dict(self) -> dict:
        return dict(self.__dict__)


def disagreement_pairs(samples: Sequence[Mapping], max_pairs_per_prompt: int = 4,
                       extra_keys: Sequence[str] = (), seed: int = 0
                       ) -> tuple[list[dict], DisagreementStats]:
    """Preference pairs from the samples on which the RM contradicts the labeller.

    For every prompt, each response the labeller scores higher (``correct``) is compared with
    each one it scores lower; the RM disagrees when ``rm_score(preferred) <=
    rm_score(dispreferred)`` (a tie counts as a disagreement, as in the RM's own accuracy).
    Identical response texts of one prompt are merged first (the first row's scores kept).

    Args:
        samples: rows ``{"prompt", "response", "correct", "rm_score", ...}`` (``correct``:
            the labeller's score, as :mod:`nemo_rlhf.evaluate` writes it).
        max_pairs_per_prompt: at most this many disagreeing pairs per prompt (shuffled by
            ``seed``), so that one prompt's many samples do not dominate the new data.
        extra_keys: fields of the prompt (e.g. ``answer``; a row's ``extras``) copied from its first row into
            its pairs.
        seed: seed of the shuffle.

    Returns:
        ``(pairs, stats)``: ``pairs`` are ``{"prompt", "chosen", "rejected", **extra_keys,
        "chosen_rm_score", "rejected_rm_score"}`` (chosen = the labeller's preference);
        ``stats`` a :class:`DisagreementStats`.

    Raises:
        KeyError: a row without ``prompt``, ``response``, ``correct`` or ``rm_score``, naming
            the row index and the keys it has.
        ValueError: ``max_pairs_per_prompt < 1``.
    """
    if max_pairs_per_prompt < 1:
        raise ValueError(f"max_pairs_per_prompt={max_pairs_per_prompt}: must be >= 1")
    by_prompt: dict[str, dict[str, Mapping]] = {}
    for i, row in enumerate(samples):
        missing = [k for k in ("prompt", "response", "correct", "rm_score") if k not in row]
        if missing:
            raise KeyError(f"samples[{i}]: missing {missing} (keys: {sorted(row)}); write the file "
                           f"with nemo_rlhf.evaluate rm_checkpoint=<rm> samples_out=<file>")
        by_prompt.setdefault(row["prompt"], {}).setdefault(row["response"], row)
    rng = random.Random(seed)
    pairs: list[dict] = []
    comparable = candidates = disagreements = 0
    for prompt, responses in by_prompt.items():
        rows = list(responses.values())
        found = []
        for better in rows:
            for worse in rows:
                if float(better["correct"]) <= float(worse["correct"]):
                    continue
                candidates += 1
                if float(better["rm_score"]) <= float(worse["rm_score"]):
                    found.append((better, worse))
        if any(float(a["correct"]) != float(b["correct"]) for a in rows for b in rows):
            comparable += 1
        disagreements += len(found)
        rng.shuffle(found)
        fields = row_extras(rows[0])
        extras = {k: fields[k] for k in extra_keys if k in fields}
        for better, worse in found[:max_pairs_per_prompt]:
            pairs.append({**extras, "prompt": prompt, "chosen": better["response"],
                          "rejected": worse["response"], "chosen_rm_score": float(better["rm_score"]),
                          "rejected_rm_score": float(worse["rm_score"])})
    stats = DisagreementStats(prompts=len(by_prompt), comparable_prompts=comparable,
                              candidate_pairs=candidates, disagreements=disagreements,
                              disagreement_rate=disagreements / candidates if candidates else 0.0,
                              kept_pairs=len(pairs))
    return pairs, stats


def labelled_pairs(samples: Sequence[Mapping], max_pairs_per_prompt: int = 2,
                   extra_keys: Sequence[str] = (), seed: int = 0) -> list[dict]:
    """Every pair the labeller orders, per prompt: a check set for an RM on the policy's
    own answers (the demo's refresh validates a refreshed RM on the answers to prompts it
    did not train on).

    Identical response texts of one prompt are merged first (the first row kept); for each
    prompt, every (labeller-preferred, labeller-dispreferred) pair of distinct responses,
    shuffled by ``seed``, at most ``max_pairs_per_prompt`` kept (so that a prompt with many
    distinct answers does not dominate).

    Args:
        samples: rows ``{"prompt", "response", "correct", ...}`` (``rm_score`` not needed).
        max_pairs_per_prompt: pairs kept per prompt (>= 1).
        extra_keys: fields of the prompt (a row's ``extras``, e.g. ``answer``) copied from its
            first row into its pairs.
        seed: seed of the shuffle.

    Returns:
        ``[{"prompt", "chosen", "rejected", **extra_keys}]`` (chosen = the labeller's
        preference), prompts in first-seen order.

    Raises:
        KeyError: a row without ``prompt``, ``response`` or ``correct``, naming the row index.
        ValueError: ``max_pairs_per_prompt < 1``.
    """
    if max_pairs_per_prompt < 1:
        raise ValueError(f"max_pairs_per_prompt={max_pairs_per_prompt}: must be >= 1")
    by_prompt: dict[str, dict[str, Mapping]] = {}
    for i, row in enumerate(samples):
        missing = [k for k in ("prompt", "response", "correct") if k not in row]
        if missing:
            raise KeyError(f"samples[{i}]: missing {missing} (keys: {sorted(row)})")
        by_prompt.setdefault(row["prompt"], {}).setdefault(row["response"], row)
    rng = random.Random(seed)
    pairs: list[dict] = []
    for prompt, responses in by_prompt.items():
        rows = list(responses.values())
        ordered = [(a, b) for a in rows for b in rows if float(a["correct"]) > float(b["correct"])]
        rng.shuffle(ordered)
        fields = row_extras(rows[0])
        extras = {k: fields[k] for k in extra_keys if k in fields}
        pairs += [{**extras, "prompt": prompt, "chosen": a["response"], "rejected": b["response"]}
                  for a, b in ordered[:max_pairs_per_prompt]]
    return pairs
