"""A test-only stand-in for the interpreter: a ``python`` shim that runs ``python -m MODULE
ARGV...`` as a process forked from a server that has already imported torch, megatron and
the entry points (:data:`PRELOAD`), instead of a fresh interpreter that imports them again
(about 4.7 s of CPU per stage of ``launchers.demo``).

For e2e tests of code that starts its stages as ``[sys.executable, "-m", MODULE, ...]``
(``launchers.demo``, ``launchers.local``): the ``forked_python`` fixture
(``tests/e2e/conftest.py``) points ``sys.executable`` at the shim for the test, so that code
runs unchanged and its own process handling (pipes, process groups, signals, timeouts) is
what is exercised. Nothing in the product knows of it.

:class:`PythonForkServer` starts the server (``python -m tests.fork_python serve ...``, its
own process with the environment it is given) and writes the shim, an executable ``python``
file. The shim, started by the caller like an interpreter:

* runs any command line but ``-m MODULE ...`` (a script, ``-c``, interpreter flags) by
  ``exec`` of the real interpreter: the same process, unchanged;
* otherwise connects to the server's Unix socket and hands it its working directory,
  environment, argv and its own stdin, stdout and stderr (the descriptors themselves,
  ``SCM_RIGHTS``: the job writes into the caller's pipe or file, no copying);
* forwards SIGHUP, SIGINT, SIGQUIT, SIGTERM, SIGUSR1, SIGUSR2 and SIGALRM to the job's
  process group (the job leads its own, as under ``start_new_session=True``: a signal to
  the shim's group reaches the job and anything it started);
* exits the way the job did: its exit code, or death by the same signal (so
  :attr:`subprocess.Popen.returncode` is ``-signum``).

SIGKILL cannot be caught: when the shim dies without having seen the job's end, the server
sees its connection close and sends SIGKILL to the job's process group. And a signal sent to
the shim's group after the shim exited reaches nothing: so when the shim leads its own
session (``start_new_session=True``), what is left of the job's group when the job ends
(a killed trainer's forked checkpoint writers) is killed then, which is what the callers
that start sessions do right after the leader's exit (``launchers.local``,
``tests.ppo_helpers.end_session``).

The forked job is, like a fresh ``python -m MODULE`` (tests/unit/project/test_fork_python.py):
in the shim's working directory with its environment (``os.environ`` replaced) and
``sys.path`` (``[cwd, *PYTHONPATH, *site]``), ``sys.argv[0]`` the module's file, fresh
``sys.std*`` streams on the shim's descriptors (``PYTHONUNBUFFERED`` honoured), default
signal handlers; it runs ``MODULE`` as ``__main__`` (:func:`runpy.run_module`) and exits
as the interpreter exits (an uncaught exception prints its traceback and exits 1,
``SystemExit`` gives its code, non-daemon threads are joined, atexit handlers run). What
the preloaded imports printed is written first to its stdout and stderr, and what they set
in ``os.environ`` (torch's ``TORCHINDUCTOR_CACHE_DIR``) is set in its environment, as if it
had imported them itself.

What a fork cannot give: its own hash seed (the server's), its parent (``os.getppid()`` is
the server), and an environment read at import time by the preloaded modules (the
server's). A job whose environment differs from the server's in a variable read at start-up
(:data:`STARTUP_ENV_PREFIXES`, e.g. ``OMP_NUM_THREADS``, ``ATEN_CPU_CAPABILITY``,
``CUDA_VISIBLE_DEVICES``; ``PYTHONPATH`` and ``PYTHONUNBUFFERED`` excepted, applied to the
fork) is refused by the server, and the shim runs it with the real interpreter instead; a
value the server's own imports set (``TORCHINDUCTOR_CACHE_DIR``, which the caller's torch sets
too once it imports inductor) is no difference.
"""

from __future__ import annotations

import json
import os
import select
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

PYTHON = sys.executable
"""The real interpreter (read at import: a test may have pointed ``sys.executable`` at a shim)."""

PRELOAD = ("torch", "transformers", "nemo_rlhf.train_ppo", "nemo_rlhf.train_rm", "nemo_rlhf.train_sft",
           "nemo_rlhf.evaluate", "nemo_rlhf.serve_rm", "nemo_rlhf.rollout_worker", "launchers.recipe")
"""What the server imports before it forks any job (the demo's stage entry points, the
trainer's and the rollout worker's)."""

FORWARDED = (signal.SIGHUP, signal.SIGINT, signal.SIGQUIT, signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2,
             signal.SIGALRM)
"""Signals the shim passes on to the job's process group."""

STARTUP_ENV_PREFIXES = ("PYTHON", "ATEN_", "MKL_", "ONEDNN_", "DNNL_", "OMP_", "KMP_", "GOMP_", "LD_", "MALLOC",
                        "CUDA_", "NVIDIA_", "HIP_", "ROCR_", "TORCH", "PYTORCH_", "HF_", "TRANSFORMERS_")
"""Environment variables (by prefix) that the interpreter or the preloaded libraries read when
they start or are imported: a job that differs from the server in one of them is refused
(run by the real interpreter). ``PYTHONPATH`` and ``PYTHONUNBUFFERED`` are applied to the fork."""

_APPLIED = ("PYTHONPATH", "PYTHONUNBUFFERED")


class PythonForkServer:
    """The server process and its shim (see the module docstring).

    Args:
        env: the server's environment, what the preloaded imports see.
        workdir: where the shim (``workdir/python``) and the server's log are written.
        preload: modules the server imports before it forks any job.

    Attributes:
        shim: the shim's path, to use in place of ``sys.executable``.
        log: the server's own log (its import output, one line per job forked or refused).
    """

    def __init__(self, env: dict[str, str], workdir, preload: tuple[str, ...] = PRELOAD):
        os.makedirs(workdir, exist_ok=True)
        self._sockdir = tempfile.mkdtemp(prefix="forkpy-")  # short: a socket path has ~100 bytes
        self.socket_path = os.path.join(self._sockdir, "s")
        self.log = os.path.join(str(workdir), "fork_python_server.log")
        self.shim = os.path.join(str(workdir), "python")
        with open(self.shim, "w") as f:
            f.write(f"#!/bin/sh\nexec {shlex.quote(PYTHON)} -S {shlex.quote(os.path.abspath(__file__))} "
                    f"shim {shlex.quote(self.socket_path)} {shlex.quote(PYTHON)} \"$@\"\n")
        os.chmod(self.shim, 0o755)
        with open(self.log, "wb") as log:
            self._proc = subprocess.Popen([PYTHON, "-m", "tests.fork_python", "serve", self.socket_path,
                                           *preload], cwd=REPO, env=env, stdin=subprocess.PIPE, stdout=log,
                                          stderr=subprocess.STDOUT, start_new_session=True)
        while not os.path.exists(self.socket_path):
            if self._proc.poll() is not None:
                with open(self.log) as f:
                    raise RuntimeError(f"fork server exited {self._proc.returncode}:\n{f.read()}")
            time.sleep(0.05)

    def close(self) -> None:
        """Stops the server: its jobs still running are killed (SIGKILL to their groups)."""
        self._proc.stdin.close()
        self._proc.wait(timeout=60)
        shutil.rmtree(self._sockdir, ignore_errors=True)

    def __enter__(self) -> "PythonForkServer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# --------------------------------------------------------------------------- the shim
def _shim(sock_path: str, python: str, args: list[str]) -> None:
    """The shim's process: ``python ARGS`` through the server (see the module docstring)."""
    if len(args) < 2 or args[0] != "-m" or not all(_is_open(fd) for fd in (0, 1, 2)):
        os.execv(python, [python, *args])
    job, pending = {"pid": None}, []

    def forward(signum, frame) -> None:
        if job["pid"] is None:
            pending.append(signum)
        else:
            _killpg(job["pid"], signum)

    for sig in FORWARDED:
        signal.signal(sig, forward)
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.connect(sock_path)
    socket.send_fds(conn, [b"J"], [0, 1, 2])
    conn.sendall(json.dumps({"module": args[1], "argv": args[2:], "cwd": os.getcwd(), "env": dict(os.environ),
                             "session": os.getsid(0) == os.getpid()}).encode() + b"\n")
    replies = conn.makefile("rb")
    kind, _, value = replies.readline().decode().strip().partition(" ")
    if kind == "refused":
        for sig in FORWARDED:
            signal.signal(sig, signal.SIG_DFL)
        conn.close()
        os.execv(python, [python, *args])
    if kind != "started":
        sys.stderr.write(f"fork_python shim: no job from the server ({kind!r})\n")
        os._exit(1)
    job["pid"] = int(value)
    for sig in pending:
        _killpg(job["pid"], sig)
    kind, _, value = replies.readline().decode().strip().partition(" ")
    if kind != "exited":
        sys.stderr.write("fork_python shim: the server went away before the job ended\n")
        os._exit(1)
    _exit_as(int(value))


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


def _killpg(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:  # the job's group is gone
        pass


def _exit_as(code: int) -> None:
    """Exit with ``code`` as :attr:`subprocess.Popen.returncode` reads it (``-N``: signal N)."""
    if code >= 0:
        os._exit(code)
    import resource

    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # no core file of the shim's own
    for sig in FORWARDED:
        signal.signal(sig, signal.SIG_DFL)
    if -code not in (signal.SIGKILL, signal.SIGSTOP):  # (these two have no handler to reset)
        signal.signal(-code, signal.SIG_DFL)
    os.kill(os.getpid(), -code)
    os._exit(128 - code)  # a signal whose default is not to terminate


# --------------------------------------------------------------------------- the server
def _serve(sock_path: str, preload: list[str]) -> None:
    """The server: imports ``preload``, then forks a job per shim connection; stops (killing
    the jobs left) at the end of its stdin."""
    import importlib

    given_env = dict(os.environ)
    captured = []
    saved = [os.dup(1), os.dup(2)]
    for fd in (1, 2):  # the imports' output, replayed to each job
        tmp = tempfile.TemporaryFile()
        os.dup2(tmp.fileno(), fd)
        captured.append(tmp)
    for name in preload:
        importlib.import_module(name)
    sys.stdout.flush()
    sys.stderr.flush()
    import_output = []
    for fd, tmp in zip((1, 2), captured):
        tmp.seek(0)
        import_output.append(tmp.read())
        tmp.close()
        os.dup2(saved[fd - 1], fd)
        os.close(saved[fd - 1])
        os.write(fd, import_output[-1])

    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *a: None)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(sock_path + ".tmp")
    listener.listen(64)
    os.rename(sock_path + ".tmp", sock_path)  # the address appears once it accepts
    server_fds = [wake_r, wake_w]
    conns: dict[int, tuple[socket.socket, int]] = {}  # connection fd -> (connection, job pid)
    jobs: dict[int, list] = {}  # job pid -> [connection (None once the shim went away), shim leads a session]
    # what the imports set in os.environ (torch's inductor: TORCHINDUCTOR_CACHE_DIR), which a
    # fresh interpreter started like the server would set too
    set_by_imports = {k: os.environ.get(k) for k in set(os.environ) | set(given_env)
                      if os.environ.get(k) != given_env.get(k)}
    base_env = (given_env, set_by_imports)
    base_path = _site_path(sys.path[1:], given_env.get("PYTHONPATH", ""), os.getcwd())
    stdin_open = True
    while stdin_open or jobs:
        watched = [wake_r, *([0, listener] if stdin_open else []), *(c for c, _ in conns.values())]
        ready = select.select(watched, [], [], 1.0)[0]
        if wake_r in ready:
            os.read(wake_r, 4096)
        if 0 in ready and not os.read(0, 4096):
            stdin_open = False
            listener.close()
            for pid in jobs:
                _killpg(pid, signal.SIGKILL)
        if listener in ready and stdin_open:
            conn, _ = listener.accept()
            started = _start(conn, base_env, base_path, import_output, server_fds,
                             [listener, *(c for c, _ in conns.values())])
            if started is not None:
                pid, session = started
                conns[conn.fileno()] = (conn, pid)
                jobs[pid] = [conn, session]
        for conn, pid in list(conns.values()):
            if conn in ready and not conn.recv(1):  # the shim died (SIGKILL): so does its job
                _killpg(pid, signal.SIGKILL)
                del conns[conn.fileno()]
                conn.close()
                jobs[pid][0] = None
        while jobs:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            conn, session = jobs.pop(pid, (None, False))
            code = os.waitstatus_to_exitcode(status)
            _say(f"exited {pid} {code}")
            if session:  # what is left of its group: what the shim's caller would kill with the shim's
                _killpg(pid, signal.SIGKILL)
            if conn is not None:
                del conns[conn.fileno()]
                try:
                    conn.sendall(f"exited {code}\n".encode())
                except OSError:
                    pass
                conn.close()


def _say(line: str) -> None:
    os.write(1, f"[fork_python] {line}\n".encode())


def _site_path(path: list[str], pythonpath: str, cwd: str) -> list[str]:
    """``path`` (a ``sys.path`` without its first entry) less its ``PYTHONPATH`` entries."""
    own = set(_pythonpath_entries(pythonpath, cwd))
    return [p for p in path if p not in own]


def _pythonpath_entries(pythonpath: str, cwd: str) -> list[str]:
    """``PYTHONPATH``'s entries as the interpreter puts them on ``sys.path`` (absolute)."""
    if not pythonpath:
        return []
    return [os.path.normpath(os.path.join(cwd, p)) for p in pythonpath.split(os.pathsep)]


def _start(conn: socket.socket, base_env: tuple[dict, dict], base_path: list[str], import_output: list[bytes],
           server_fds: list[int], server_sockets: list[socket.socket]):
    """Reads a shim's request and forks its job; returns the job's pid and whether the shim
    leads its own session (None: refused)."""
    conn.settimeout(30)
    _, fds, _, _ = socket.recv_fds(conn, 1, 3)
    if len(fds) != 3:
        raise RuntimeError(f"a shim sent {len(fds)} descriptors, not its stdin, stdout and stderr")
    data = b""
    while not data.endswith(b"\n"):
        chunk = conn.recv(1 << 20)
        if not chunk:
            break
        data += chunk
    conn.settimeout(None)
    job = json.loads(data)
    given, set_by_imports = base_env
    differs = sorted(k for k in set(job["env"]) | set(given)
                     if k.startswith(STARTUP_ENV_PREFIXES) and k not in _APPLIED
                     and job["env"].get(k) != given.get(k)
                     # the value the server's imports set: its caller imported them too (pytest's
                     # torch sets TORCHINDUCTOR_CACHE_DIR after a package-scoped server started)
                     and not (k in set_by_imports and job["env"].get(k) == set_by_imports[k]))
    if differs:
        _say(f"refused {job['module']}: its environment differs in {differs}")
        for fd in fds:
            os.close(fd)
        conn.sendall(b"refused\n")
        conn.close()
        return None
    for key, value in set_by_imports.items():  # as the job's own imports would have set them
        if job["env"].get(key) == given.get(key):
            job["env"].pop(key, None)
            if value is not None:
                job["env"][key] = value
    pid = os.fork()
    if pid == 0:
        for sock in (*server_sockets, conn):  # detached: their objects must not close a reused fd later
            os.close(sock.detach())
        _become(job, fds, base_path, import_output, server_fds)
    for fd in fds:
        os.close(fd)
    _say(f"started {pid} {job['module']}")
    conn.sendall(f"started {pid}\n".encode())
    return pid, bool(job["session"])


def _become(job: dict, fds: list[int], base_path: list[str], import_output: list[bytes],
            close: list[int]) -> None:
    """In the forked child: become the job (see the module docstring); never returns."""
    import importlib
    import importlib.util
    import io
    import runpy

    signal.set_wakeup_fd(-1)
    for fd in close:
        os.close(fd)
    for sig in (*FORWARDED, signal.SIGCHLD):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    os.setsid()
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(job["cwd"])
    os.environ.clear()
    os.environ.update(job["env"])
    cwd = os.getcwd()
    seen, path = set(), []
    for p in [*_pythonpath_entries(job["env"].get("PYTHONPATH", ""), cwd), *base_path]:
        if p not in seen:
            seen.add(p)
            path.append(p)
    sys.path[:] = [cwd, *path]
    importlib.invalidate_caches()
    unbuffered = bool(job["env"].get("PYTHONUNBUFFERED"))
    old = sys.stdout, sys.stderr
    sys.stdin = sys.__stdin__ = io.TextIOWrapper(io.BufferedReader(io.FileIO(0, "r", closefd=False)),
                                                 encoding=sys.stdin.encoding, errors=sys.stdin.errors)
    sys.stdout = sys.__stdout__ = _writer(1, old[0], unbuffered, line=os.isatty(1))
    sys.stderr = sys.__stderr__ = _writer(2, old[1], unbuffered, line=True)
    for fd, text in zip((1, 2), import_output):
        os.write(fd, text)
    sys.argv = [importlib.util.find_spec(job["module"]).origin, *job["argv"]]
    runpy.run_module(job["module"], run_name="__main__", alter_sys=True)
    sys.exit(0)  # raised up through _serve: the interpreter's own exit (threads, atexit)


def _writer(fd: int, like, unbuffered: bool, line: bool):
    """A fresh ``sys.stdout``/``sys.stderr`` on ``fd``, as the interpreter makes it."""
    import io

    raw = io.FileIO(fd, "w", closefd=False)
    return io.TextIOWrapper(raw if unbuffered else io.BufferedWriter(raw), encoding=like.encoding,
                            errors=like.errors, line_buffering=line, write_through=unbuffered)


if __name__ == "__main__":
    if sys.argv[1] == "shim":
        _shim(sys.argv[2], sys.argv[3], sys.argv[4:])
    else:
        _serve(sys.argv[2], sys.argv[3:])
