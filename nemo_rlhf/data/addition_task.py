"""The real-model task: two-digit addition asked in natural language through a chat template.

    "What is 26+28? Answer with just the number."  ->  "54"

Every ordered pair ``(a, b)`` with ``10 <= a, b <= 99`` is one problem (8,100 in all). They
are shuffled once by the seed and split, disjointly, into

* ``eval.jsonl`` (``n_eval``, default 200): the fixed held-out set, ``{"prompt", "answer"}``;
* ``rm_val_prompts.jsonl`` (``n_rm_val``): prompts whose sampled answers become the RM's
  held-out preference pairs;
* ``rm_prompts.jsonl`` (``n_rm``): prompts whose sampled answers become RM training pairs;
* ``ppo_prompts.jsonl`` (``n_ppo``): PPO prompts (InstructGPT also keeps the RM and PPO
  prompt sets apart).

and ``manifest.json`` holds the settings and each file's SHA-256. The checker is the
registered reward function ``two_digit_addition`` (the answer is the first integer once
restatements of ``a+b`` are removed); ``just_the_number`` measures the format.

Preference pairs come from the model's own samples (the InstructGPT recipe, with the
checker as the labeller): :func:`build_preference_pairs` turns scored samples into
``{"prompt", "chosen", "rejected"}`` rows, a correct answer against an incorrect one of the
same prompt.
"""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterable, Mapping, Sequence

PROMPT = "What is {a}+{b}? Answer with just the number."
SMOLLM2_SYSTEM_PROMPT = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
"""The system message SmolLM2's chat template inserts when a conversation has none."""


@dataclass
class AdditionTaskConfig:
    """Split sizes of :func:`make_addition_dataset` (counts of prompts)."""

    seed: int = 0
    n_eval: int = 200
    n_rm: int = 512
    n_rm_val: int = 64
    n_ppo: int = 4096
    low: int = 10
    high: int = 99

    def __post_init__(self) -> None:
        total = (self.high - self.low + 1) ** 2
        need = self.n_eval + self.n_rm + self.n_rm_val + self.n_ppo
        if self.low > self.high:
            raise ValueError(f"low={self.low} > high={self.high}")
        if need > total:
            raise ValueError(f"n_eval + n_rm + n_rm_val + n_ppo = {need} prompts, but only {total} "
                             f"problems have operands in [{self.low}, {self.high}]")


def _row(a: int, b: int) -> dict:
    return {"prompt": PROMPT.format(a=a, b=b), "answer": str(a + b), "a": a, "b": b}


def _write_jsonl(path: Path, rows: Iterable[Mapping]) -> str:
    text = "".join(json.dumps(r) + "\n" for r in rows)
    path.write_text(text, encoding="utf-8")
    return hashlib.sha256(text.encode()).hexdigest()


def make_addition_dataset(out: str | Path, cfg: AdditionTaskConfig = AdditionTaskConfig()) -> dict:
    """Write the prompt files and ``manifest.json`` under ``out``; return the manifest.

    Idempotent: when ``manifest.json`` exists with the same settings, nothing is rewritten.
    Deterministic in ``cfg.seed``; the splits are disjoint (tested).
    """
    out = Path(out)
    manifest_path = out / "manifest.json"
    settings = {"task": "two_digit_addition", **asdict(cfg)}
    if manifest_path.is_file():
        manifest = json.loads(manifest_path.read_text())
        if manifest.get("settings") == settings and all((out / f).is_file() for f in manifest["files"]):
            return manifest
    problems = [(a, b) for a in range(cfg.low, cfg.high + 1) for b in range(cfg.low, cfg.high + 1)]
    random.Random(cfg.seed).shuffle(problems)
    splits, i = {}, 0
    for name, n in (("eval.jsonl", cfg.n_eval), ("rm_val_prompts.jsonl", cfg.n_rm_val),
                    ("rm_prompts.jsonl", cfg.n_rm), ("ppo_prompts.jsonl", cfg.n_ppo)):
        splits[name] = problems[i:i + n]
        i += n
    out.mkdir(parents=True, exist_ok=True)
    files = {name: _write_jsonl(out / name, (_row(a, b) for a, b in rows)) for name, rows in splits.items()}
    manifest = {"settings": settings, "files": files}
    manifest_path.write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def build_preference_pairs(samples: Sequence[Mapping], max_pairs_per_prompt: int = 4,
                           seed: int = 0) -> list[dict]:
    """Chosen/rejected pairs from scored samples of the model itself.

    Args:
        samples: rows ``{"prompt", "response", "score", ...}`` (several per prompt), as
            :mod:`nemo_rlhf.evaluate` writes with ``samples_out``; ``score`` is the
            checker's 1.0 (correct) or 0.0.
        max_pairs_per_prompt: cap on pairs per prompt, so that easy prompts with many
            distinct answers do not dominate.
        seed: seed of the pairing shuffle.

    Returns:
        ``[{"prompt", "chosen", "rejected", "answer"}]``: each a distinct correct response
        against a distinct incorrect one of the same prompt (identical texts are merged
        first). Prompts whose samples are all correct or all wrong give no pair.
    """
    by_prompt: dict[str, dict] = {}
    for row in samples:
        entry = by_prompt.setdefault(row["prompt"], {"good": [], "bad": [], "answer": row.get("answer")})
        bucket = entry["good"] if float(row["score"]) > 0.5 else entry["bad"]
        if row["response"] not in bucket:
            bucket.append(row["response"])
    rng = random.Random(seed)
    pairs = []
    for prompt, entry in by_prompt.items():
        good, bad = entry["good"][:], entry["bad"][:]
        rng.shuffle(good)
        rng.shuffle(bad)
        n = min(max_pairs_per_prompt, len(good) * len(bad))
        combos = [(g, b) for b in bad for g in good][:n] if good and bad else []
        for g, b in combos:
            pairs.append({"prompt": prompt, "chosen": g, "rejected": b, "answer": entry["answer"]})
    return pairs
