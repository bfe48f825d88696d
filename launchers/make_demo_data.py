"""Write a tiny demo dataset and the character-level tokenizer.

    python launchers/make_demo_data.py --out data/reversal                      # the tiny demo's task
    python launchers/make_demo_data.py --task precedence --out data/demo --seed 0

Tasks: ``reversal`` (:mod:`nemo_rlhf.tasks.reversal`, the task of ``launchers.demo
--task tiny``) and ``precedence`` (:mod:`nemo_rlhf.tasks.precedence`, the tests' fixture
task). Each task's config fields are flags (``--n-sft``, ``--sft-copy-rate``, ...; a flag
of the other task is refused). Deterministic in ``--seed``; idempotent (identical files are
left alone); refuses to overwrite a different existing dataset unless ``--force``.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import fields

from nemo_rlhf.tasks.precedence import DemoTaskConfig, make_demo_dataset
from nemo_rlhf.tasks.reversal import ReversalTaskConfig, make_reversal_dataset

TASKS = {"reversal": (ReversalTaskConfig, make_reversal_dataset),
         "precedence": (DemoTaskConfig, make_demo_dataset)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", choices=sorted(TASKS), default="reversal", help="default reversal")
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--force", action="store_true",
                        help="overwrite an existing, different dataset")
    flags: dict[str, type] = {}
    for cls, _ in TASKS.values():
        defaults = cls()
        for f in fields(cls):
            flags.setdefault(f.name, type(getattr(defaults, f.name)))
    for name, kind in flags.items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=kind, default=None,
                            help="a field of " + " / ".join(t for t, (c, _) in TASKS.items()
                                                            if name in {f.name for f in fields(c)}))
    args = parser.parse_args(argv)
    cls, make = TASKS[args.task]
    own = {f.name for f in fields(cls)}
    foreign = [f"--{n.replace('_', '-')}" for n in flags if n not in own and getattr(args, n) is not None]
    if foreign:
        parser.error(f"{', '.join(foreign)}: not a setting of --task {args.task}")
    try:
        cfg = cls(**{n: getattr(args, n) for n in own if getattr(args, n) is not None})
    except ValueError as exc:
        parser.error(str(exc))
    start = time.perf_counter()
    try:
        status = make(args.out, cfg, force=args.force)
    except FileExistsError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    for name, state in status.items():
        print(f"{state:>11}  {args.out}/{name}")
    print(f"done in {time.perf_counter() - start:.2f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
