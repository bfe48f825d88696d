"""Can the reward model still tell the policy's right answers from its wrong ones, prompt by
prompt? Each answer of a sample file is paired with itself, only its answer changed by the
task's counterfactual rule (:attr:`nemo_rlhf.tasks.task.Task.edit_answer`; for addition, the
stated number: a right sum made a near miss, a wrong one made right), and the served RM scores
both::

    python -m nemo_rlhf.serve_rm checkpoint=experiments/smollm2/rm/checkpoints/step_77 \\
        server.port=0 server.address_file=/tmp/rm_address &
    python -m nemo_rlhf.tools.rm_edit_probe --task nemo_rlhf.tasks.addition:TASK \\
        --rm-address-file /tmp/rm_address \\
        experiments/smollm2/ppo/eval_samples/step_000000.jsonl \\
        experiments/smollm2/ppo/eval_samples/step_000010.jsonl

It prints, per file, the share of pairs the RM ranks the right way (ties count 1/2), over all
pairs and by edit label (``Task.edit_labels``: the right answer made wrong, the wrong made
right), and with ``--out DIR`` writes every pair with its two scores. Unlike the RM's held-out
same-form pairs, made once from the imported model's samples, this measures the RM on the
answers the policy gives *now*: where it falls to 0.5, the RM no longer tells the policy's
answers apart within a prompt, and PPO against it has nothing left to learn (docs/demo.md,
"Five seeds of the default"). ``eval/reward_auc`` measures the same across prompts, with no edits.

Sample files: the schema of :mod:`nemo_rlhf.data.sample_rows` (the PPO trainer's
``eval_samples/``, ``nemo_rlhf.evaluate``'s ``samples_out``).

Exit codes: 0 printed; 2 bad input (a missing file; a line that is not a JSON object or lacks
``prompt`` / ``response`` / ``correct``: file and line named; a task without ``edit_answer``);
1 the reward service failed.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Callable, Mapping, Sequence

from nemo_rlhf.reward.client import RewardModelClient, RewardServiceError
from nemo_rlhf.tasks.task import Task, edit_pairs, load_task

ScoreFn = Callable[[Sequence[str], Sequence[str]], Sequence[float]]
"""``(prompts, responses) -> scores``: one float per response (``RewardModelClient.score_texts``)."""


def read_sample_rows(path: str | Path) -> list[dict]:
    """The rows of a sample file (JSONL, :mod:`nemo_rlhf.data.sample_rows`), blank lines skipped.

    Raises:
        ValueError: a missing file, or a line that is not a JSON object with ``prompt``,
            ``response`` and ``correct`` (``<file>:<line>`` named).
    """
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{path}: no such file")
    rows = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}:{n}: not JSON ({exc.msg})") from None
        missing = [k for k in ("prompt", "response", "correct") if not isinstance(row, dict) or k not in row]
        if missing:
            raise ValueError(f"{path}:{n}: a sample row needs {missing} (nemo_rlhf.data.sample_rows)")
        rows.append(row)
    return rows


def probe(task: Task, rows: Sequence[Mapping], score: ScoreFn, seed: int = 0) -> list[dict]:
    """Every answer of ``rows`` against its edit, scored.

    Args:
        task: a task with ``edit_answer`` (its ``check`` re-checks each edit).
        rows: sample rows; every distinct answer of a prompt gives at most one pair.
        score: the reward, ``(prompts, responses) -> [n]`` floats.
        seed: seed of the edit rule's random choices (:func:`nemo_rlhf.tasks.task.edit_pairs`).

    Returns:
        ``edit_pairs``' rows plus ``chosen_score`` and ``rejected_score`` (floats).

    Raises:
        ValueError: a task without ``edit_answer``; ``score`` returning the wrong count.
    """
    pairs = edit_pairs(task, rows, per_prompt=len(rows) or 1, seed=seed)
    prompts = [p["prompt"] for p in pairs for _ in range(2)]
    responses = [text for p in pairs for text in (p["chosen"], p["rejected"])]
    scores = list(score(prompts, responses)) if pairs else []
    if len(scores) != len(responses):
        raise ValueError(f"the reward returned {len(scores)} scores for {len(responses)} responses")
    return [{**p, "chosen_score": float(scores[2 * i]), "rejected_score": float(scores[2 * i + 1])}
            for i, p in enumerate(pairs)]


def edit_accuracy(scored: Sequence[Mapping]) -> dict[str, tuple[int, float]]:
    """``{"all" | edit label: (pairs, share ranked right)}`` of :func:`probe`'s rows; a tie
    counts 1/2. A label with no pair is absent; ``{}`` for no pairs."""
    groups: dict[str, list[float]] = {}
    for p in scored:
        c, r = p["chosen_score"], p["rejected_score"]
        won = 1.0 if c > r else 0.5 if c == r else 0.0
        for key in ("all", str(p.get("edit", "?"))):
            groups.setdefault(key, []).append(won)
    return {k: (len(v), sum(v) / len(v)) for k, v in groups.items()}


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m nemo_rlhf.tools.rm_edit_probe",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("samples", nargs="+", help="sample files (JSONL, nemo_rlhf.data.sample_rows)")
    ap.add_argument("--task", required=True, help="package.module:TASK with Task.edit_answer "
                                                  "(the demo's: nemo_rlhf.tasks.addition:TASK)")
    ap.add_argument("--rm-address-file", required=True,
                    help="the address file of a running RM server (serve_rm server.address_file=...)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the edit rule's choices")
    ap.add_argument("--out", default=None, help="a folder: every scored pair of each sample file goes to "
                                               "<out>/<the file's stem>.pairs.jsonl")
    a = ap.parse_args(argv)
    try:
        task, _ = load_task(a.task)
        if task.edit_answer is None:
            raise ValueError(f"--task {a.task}: the task has no Task.edit_answer, so no edited pairs")
        files = {path: read_sample_rows(path) for path in a.samples}
        stems = [Path(path).stem for path in a.samples]
        if a.out and len(set(stems)) < len(stems):
            raise ValueError(f"--out {a.out}: two sample files share a name {sorted(stems)}; probe them "
                             f"one at a time")
    except (ValueError, ImportError, AttributeError) as exc:
        print(f"rm_edit_probe: {exc}", file=sys.stderr)
        return 2
    try:
        client = RewardModelClient.from_address_file(a.rm_address_file, wait_s=5.0)
        for path, rows in files.items():
            scored = probe(task, rows, client.score_texts, seed=a.seed)
            acc = edit_accuracy(scored)
            parts = [f"{key} {acc[key][1]:.3f} of {acc[key][0]}" for key in ("all", *task.edit_labels)
                     if key in acc]
            print(f"{path}: RM right on edited pairs: " + (", ".join(parts) if parts else "no pair"))
            if a.out:
                out = Path(a.out) / f"{Path(path).stem}.pairs.jsonl"
                out.parent.mkdir(parents=True, exist_ok=True)
                out.write_text("".join(json.dumps(p) + "\n" for p in scored))
    except RewardServiceError as exc:
        print(f"rm_edit_probe: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
