"""One schema for the files that hold a policy's responses one by one: ``nemo_rlhf.evaluate``'s
``samples_out`` and the PPO trainer's ``<exp_dir>/eval_samples/step_<N>.jsonl``.

Every row (JSON object, one per line) has::

    prompt    str    the prompt as the dataset gives it (no chat template)
    response  str    the decoded response, EOS excluded
    correct   float  the checker's score (``checker`` / ``trainer.eval_checker``; 1.0 or 0.0
                     for the demo tasks); NaN-free
    length    int    generated tokens, EOS included (``RolloutBatch.response_lengths``)
    extras    dict   the prompt row's own fields (e.g. ``answer``), as the checker got them

and, by writer, some of (absent when not measured; never a second name for the same thing):

    <checker name>   float  each ``extra_checkers`` / ``trainer.eval_extra_checkers`` score
    sample           int    evaluate: the response's index among ``num_samples``
    ended            bool   evaluate: the response ended with EOS
    rm_score         float  evaluate with ``rm_checkpoint``: the RM's raw score
    kl_to_reference  float  evaluate with ``reference``: sequence KL to the reference
    step, checkpoint        evaluate of several checkpoints: which one
    score            float  trainer: the training reward of the response (RM and/or functions)
    sources          dict   trainer: each reward source's score
    repetition       float  trainer: 3-gram repetition rate
    judge            float  trainer with ``trainer.eval_judge``: the judge's score

Before this schema, ``nemo_rlhf.evaluate`` wrote ``response_length`` and the row's fields at
the top level; :func:`row_extras` reads the row's fields from such rows too (an experiment
folder from then continues with the same pairs).
"""

from __future__ import annotations

from typing import Any, Mapping

__all__ = ["SAMPLE_ROW_KEYS", "OPTIONAL_KEYS", "row_extras", "sample_row"]

SAMPLE_ROW_KEYS = ("prompt", "response", "correct", "length", "extras")
"""The fields every sample row has."""

OPTIONAL_KEYS = ("sample", "ended", "rm_score", "kl_to_reference", "step", "checkpoint", "score",
                 "sources", "repetition", "judge")
"""The fields some writers add (extra checkers' names come on top)."""


def sample_row(prompt: str, response: str, correct: float, length: int, extras: Mapping[str, Any],
               **more: Any) -> dict:
    """One sample row: the five :data:`SAMPLE_ROW_KEYS` (``correct`` as a float, ``length``
    as an int, a copy of ``extras``) then ``more`` (optional fields, e.g. ``rm_score``)."""
    return {"prompt": prompt, "response": response, "correct": float(correct), "length": int(length),
            "extras": dict(extras), **more}


def row_extras(row: Mapping[str, Any]) -> Mapping[str, Any]:
    """The prompt row's fields of a sample row: ``row["extras"]``; for a row written before
    the schema (or a hand-made one without ``extras``), its top-level fields."""
    extras = row.get("extras")
    return extras if isinstance(extras, Mapping) else row
