"""Start ``python -m MODULE ARGV...`` jobs as processes forked from one interpreter that has
already imported torch, megatron and the entry points (:data:`PRELOAD`), instead of fresh
interpreters that each import them again (about 4-5 s of CPU per ``nemo_rlhf.train_ppo``).

For e2e tests that run many entry-point processes (:mod:`tests.e2e.test_model_families`).
:class:`ForkServer` starts the server (``python -m tests.fork_server PRELOAD...``, its own
process, never the pytest process) with the jobs' common environment; :meth:`ForkServer.start`
asks it for one job. The server forks a child that, like a fresh ``python -m MODULE``
process run by :class:`subprocess.Popen` with ``start_new_session=True``:

* leads its own session and process group (``os.killpg(pid, ...)`` reaches it and anything
  it forks);
* has the job's environment (``os.environ`` replaced), working directory, ``sys.argv``
  (``argv[0]`` the module's file) and ``sys.path[0]`` (the server's: the repository root);
* reads stdin from ``/dev/null`` and writes stdout and stderr to the job's log (preceded by
  what the preloaded imports printed, as if it had imported them itself);
* runs ``MODULE`` as ``__main__`` (:func:`runpy.run_module`) and exits the way the
  interpreter exits: an uncaught exception prints its traceback and exits 1, ``SystemExit``
  gives its code, non-daemon threads are joined and atexit handlers run; a signal's death
  is reported as ``-signum`` (what :attr:`subprocess.Popen.returncode` says).

The server reports each child's pid when it starts it and its exit code when it is reaped;
:meth:`ForkServer.poll` returns the codes. What it cannot give a job: a fresh interpreter's
own hash seed (all jobs share the server's) and an environment read at import time by the
preloaded modules (the server's, which is the jobs' common one: pass per-job differences
only for what is read at run time, such as ``NEMO_RLHF_CRASH_AT``).
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

PRELOAD = ("torch", "transformers", "nemo_rlhf.train_ppo", "nemo_rlhf.train_rm", "nemo_rlhf.train_sft",
           "nemo_rlhf.tools.ckpt.cli", "nemo_rlhf.tools.hf_convert")
"""What the server imports before it forks any job."""


class ForkServer:
    """A server process that forks ``python -m MODULE`` jobs (see the module docstring).

    Args:
        env: the server's environment, what the jobs' imports see (their common one).
        preload: modules the server imports first.
        outdir: where the server's own output (the preloaded imports') is kept.
    """

    def __init__(self, env: dict[str, str], outdir: Path, preload: tuple[str, ...] = PRELOAD):
        outdir.mkdir(parents=True, exist_ok=True)
        self._import_log = outdir / "fork_server_import.log"
        self._proc = subprocess.Popen([sys.executable, "-m", "tests.fork_server", str(self._import_log), *preload],
                                      cwd=REPO, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True, bufsize=1)
        self._buf, self._codes = "", {}
        self._lock = threading.Lock()
        ready = self._lines(None)
        if ready != ["ready"]:
            raise RuntimeError(f"fork server did not start: {ready}\n{self._import_log.read_text()}")

    def _lines(self, timeout: float | None) -> list[str]:
        """The server's complete reply lines (waiting up to ``timeout`` s for the first)."""
        fd = self._proc.stdout.fileno()
        while "\n" not in self._buf:
            if not select.select([fd], [], [], timeout)[0]:
                return []
            chunk = os.read(fd, 65536).decode()
            if not chunk:
                raise RuntimeError(f"fork server exited {self._proc.wait()}: {self._buf}")
            self._buf += chunk
            timeout = 0
        *lines, self._buf = self._buf.split("\n")
        return lines

    def start(self, module: str, argv: list[str], env: dict[str, str], log: Path, cwd: Path = REPO) -> int:
        """Starts ``python -m module *argv`` (output to ``log``); returns its pid. Exit codes
        of jobs that exited meanwhile are kept for :meth:`poll`."""
        with self._lock:
            return self._start(module, argv, env, log, cwd)

    def _start(self, module: str, argv: list[str], env: dict[str, str], log: Path, cwd: Path) -> int:
        self._proc.stdin.write(json.dumps({"module": module, "argv": [str(a) for a in argv], "env": env,
                                           "log": str(log), "cwd": str(cwd)}) + "\n")
        self._proc.stdin.flush()
        started = None
        while started is None:
            for line in self._lines(None):
                kind, pid, *code = line.split()
                if kind == "started":
                    started = int(pid)
                else:
                    self._codes[int(pid)] = int(code[0])
        return started

    def poll(self) -> dict[int, int]:
        """pid -> exit code of the jobs reaped since the last call (does not wait)."""
        with self._lock:
            for line in self._lines(0):
                kind, pid, *code = line.split()
                self._codes[int(pid)] = int(code[0])
            codes, self._codes = self._codes, {}
        return codes

    def run(self, module: str, argv: list[str], env: dict[str, str], log: Path, timeout: float,
            cwd: Path = REPO) -> int:
        """Runs ``python -m module *argv`` to its end (output to ``log``), as
        :func:`subprocess.run` would; returns its exit code. Safe to call from several threads
        at once (then do not use :meth:`poll`).

        Raises:
            subprocess.TimeoutExpired: it ran past ``timeout`` s (its process group is killed).
        """
        pid, deadline = self.start(module, argv, env, log, cwd), time.monotonic() + timeout
        while True:
            with self._lock:
                for line in self._lines(0):
                    kind, other, *code = line.split()
                    self._codes[int(other)] = int(code[0])
                if pid in self._codes:
                    return self._codes.pop(pid)
            if time.monotonic() > deadline:
                os.killpg(pid, signal.SIGKILL)
                raise subprocess.TimeoutExpired([module, *argv], timeout)
            time.sleep(0.05)

    def close(self) -> None:
        """Stops the server (its jobs are the caller's to kill before)."""
        self._proc.stdin.close()
        self._proc.wait(timeout=60)

    def __enter__(self) -> "ForkServer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _child(job: dict, reply_fd: int, import_log: str) -> None:
    """In the forked child: become the job (see the module docstring); never returns."""
    import importlib.util
    import runpy

    os.close(reply_fd)
    os.setsid()
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    log = os.open(job["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.write(log, Path(import_log).read_bytes())
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    os.chdir(job["cwd"])
    os.environ.clear()
    os.environ.update(job["env"])
    sys.argv = [importlib.util.find_spec(job["module"]).origin, *job["argv"]]
    runpy.run_module(job["module"], run_name="__main__", alter_sys=True)
    sys.exit(0)  # raised up through _serve: the interpreter's own exit (threads, atexit)


def _serve(import_log: str, preload: list[str]) -> None:
    """The server's loop: a JSON job per stdin line; ``started PID`` and ``exited PID CODE``
    lines on stdout; stops at the end of stdin once its jobs have exited."""
    import importlib

    reply = os.dup(1)
    log = os.open(import_log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    for name in preload:
        importlib.import_module(name)
    sys.stdout.flush()
    sys.stderr.flush()

    def say(line: str) -> None:
        os.write(reply, (line + "\n").encode())

    say("ready")
    buf, children, open_input = b"", set(), True
    while open_input or children:
        if open_input and select.select([0], [], [], 0.02)[0]:
            chunk = os.read(0, 65536)
            open_input = bool(chunk)
            buf += chunk
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                pid = os.fork()
                if pid == 0:
                    _child(json.loads(line), reply, import_log)
                children.add(pid)
                say(f"started {pid}")
        elif not open_input:
            select.select([], [], [], 0.02)
        while children:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            children.discard(pid)
            say(f"exited {pid} {os.waitstatus_to_exitcode(status)}")


if __name__ == "__main__":
    _serve(sys.argv[1], sys.argv[2:])
