"""Run many ``python -m MODULE ARGV...`` command lines, each in its own process, forked from
one interpreter that has already imported what ``MODULE`` imports before it runs.

For command-line tests that start the same entry point many times (a table of bad inputs):
each command pays only its own work, not the entry point's imports (about 2 s of CPU each
for ``nemo_rlhf.tools.ckpt``, which imports torch). Run by :func:`run_forked` from the
repository root, as the commands would be:

    python -m tests.forked_cli MODULE JOBS.json OUTDIR PARALLEL

It imports ``MODULE``'s own imports (``MODULE.__main__`` is not run) with its stdout and
stderr captured at the file-descriptor level, then forks one child per job (``PARALLEL`` at
a time). A child sends its stdout and stderr to its own files and runs ``MODULE`` as
``python -m`` does (:func:`runpy.run_module` as ``__main__``, ``sys.argv[0]`` the module's
file), and exits the way the interpreter exits: an uncaught exception prints its
traceback and exits 1, ``SystemExit`` gives its code, atexit handlers run. What the shared
imports printed is put before each job's own output, as if it had imported them itself.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace


REPO = Path(__file__).resolve().parents[1]


def run_forked(module: str, jobs: dict[str, list[str]], outdir: Path, parallel: int = 2,
               timeout: float = 300) -> dict[str, SimpleNamespace]:
    """Run each job's ``python -m module *argv`` (see the module docstring); returns
    name -> ``returncode``, ``stdout``, ``stderr`` and ``args`` (the equivalent command line).

    Raises:
        RuntimeError: the driver itself failed (its output is in the message).
    """
    outdir.mkdir(parents=True, exist_ok=True)
    spec = outdir / "jobs.json"
    spec.write_text(json.dumps({name: [str(a) for a in argv] for name, argv in jobs.items()}))
    proc = subprocess.run([sys.executable, "-m", "tests.forked_cli", module, str(spec), str(outdir),
                           str(parallel)], capture_output=True, text=True, cwd=REPO, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"forked_cli driver exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}")
    codes = json.loads((outdir / "codes.json").read_text())
    pre_out, pre_err = (outdir / "import.out").read_text(), (outdir / "import.err").read_text()
    return {name: SimpleNamespace(returncode=codes[name],
                                  stdout=pre_out + (outdir / f"{name}.out").read_text(),
                                  stderr=pre_err + (outdir / f"{name}.err").read_text(),
                                  args=[sys.executable, "-m", module, *map(str, argv)])
            for name, argv in jobs.items()}


def _redirect(out: Path, err: Path) -> None:
    for path, fd in ((out, 1), (err, 2)):
        f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(f, fd)
        os.close(f)


def _driver(module: str, spec: str, outdir: str, parallel: int) -> None:
    import importlib.util
    import runpy

    out = Path(outdir)
    jobs = json.loads(Path(spec).read_text())
    _redirect(out / "import.out", out / "import.err")
    main_spec = importlib.util.find_spec(f"{module}.__main__")
    # what `python -m module` imports before it runs: the __main__ file's own imports
    # (compiled, run in a throwaway namespace without __name__ == "__main__")
    code = compile(Path(main_spec.origin).read_text(), main_spec.origin, "exec")
    exec(code, {"__name__": f"{module}.__forked_cli_preload__", "__file__": main_spec.origin})
    sys.stdout.flush()
    sys.stderr.flush()
    codes: dict[str, int] = {}
    running: dict[int, str] = {}
    pending = list(jobs)
    while pending or running:
        while pending and len(running) < parallel:
            name = pending.pop(0)
            pid = os.fork()
            if pid == 0:  # the job: as `python -m module *argv`, then the interpreter's exit
                _redirect(out / f"{name}.out", out / f"{name}.err")
                sys.argv = [main_spec.origin, *jobs[name]]
                runpy.run_module(module, run_name="__main__", alter_sys=True)
                sys.exit(0)
            running[pid] = name
        pid, status = os.wait()
        codes[running.pop(pid)] = os.waitstatus_to_exitcode(status)
    (out / "codes.json").write_text(json.dumps(codes))


if __name__ == "__main__":
    _driver(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]))
