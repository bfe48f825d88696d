"""Write the arithmetic demo datasets and the character-level tokenizer.

    python tools/make_demo_data.py --out data/demo --seed 0

Deterministic in ``--seed``; idempotent (identical files are left alone); refuses to
overwrite a different existing dataset unless ``--force``. See
:mod:`nemo_rlhf.data.demo_task` for the task and the files.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import fields

from nemo_rlhf.data.demo_task import DemoTaskConfig, make_demo_dataset


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--force", action="store_true",
                        help="overwrite an existing, different dataset")
    defaults = DemoTaskConfig()
    for f in fields(DemoTaskConfig):
        parser.add_argument(f"--{f.name.replace('_', '-')}", type=type(getattr(defaults, f.name)),
                            default=getattr(defaults, f.name), help=f"default {getattr(defaults, f.name)}")
    args = parser.parse_args(argv)
    cfg = DemoTaskConfig(**{f.name: getattr(args, f.name) for f in fields(DemoTaskConfig)})
    start = time.perf_counter()
    try:
        status = make_demo_dataset(args.out, cfg, force=args.force)
    except FileExistsError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    for name, state in status.items():
        print(f"{state:>11}  {args.out}/{name}")
    print(f"done in {time.perf_counter() - start:.2f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
