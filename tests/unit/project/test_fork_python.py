"""tests/fork_python.py: the shim started in place of ``python -m MODULE`` behaves as that
interpreter would for its caller (argv, cwd, environment, ``sys.path``, pipes, exit code,
death by a signal, signals sent to it or to its group, SIGKILL), while the job is a fork of
the preloaded server; command lines it cannot fork run in the real interpreter."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.fork_python import PythonForkServer

JOB = '''
import json, os, signal, sys, time
preloaded = "fork_py_preload" in sys.modules
import fork_py_preload  # what the server imported: it prints, and sets an environment variable
mode = sys.argv[1]
if mode == "term":  # a job that saves on SIGTERM and exits with its own code (the trainer's requeue)
    signal.signal(signal.SIGTERM, lambda *a: (print("got SIGTERM", flush=True), sys.exit(42)))
print(json.dumps({"argv": sys.argv, "cwd": os.getcwd(), "env": os.environ.get("JOB_ONLY"), "path": sys.path,
                  "pid": os.getpid(), "sid": os.getsid(0), "preloaded": preloaded, "set": os.environ.get("TORCH_FORKPY_SET")}),
      flush=mode != "unbuffered")
if mode == "exit3":
    print("to stderr", file=sys.stderr)
    sys.exit(3)
if mode == "raise":
    raise ValueError("boom")
if mode == "killed":
    os.kill(os.getpid(), signal.SIGKILL)
if mode == "straggler":  # leaves a child in its group (a checkpoint writer of a killed trainer)
    if os.fork() == 0:
        time.sleep(60)
        os._exit(0)
if mode in ("term", "sleep", "unbuffered"):
    time.sleep(60)
'''


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fork_python")
    (tmp / "fork_py_job.py").write_text(JOB)
    (tmp / "fork_py_preload.py").write_text(  # as torch's inductor sets TORCHINDUCTOR_CACHE_DIR
        "import os\nprint('preloaded import output')\nos.environ['TORCH_FORKPY_SET'] = 'at import'\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(tmp), os.environ.get("PYTHONPATH")) if p)}
    with PythonForkServer(env, tmp, preload=("fork_py_preload",)) as s:
        yield s, tmp, env


def _start(server, python, mode, extra_env=None, **kw):
    _, tmp, env = server
    return subprocess.Popen([python, "-m", "fork_py_job", mode, "x y"], cwd=tmp / "..",
                            env={**env, "JOB_ONLY": mode, **(extra_env or {})}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, **kw)


def _first(proc) -> dict:
    """The job's first line (after the preloaded import's output, which a fork replays)."""
    assert proc.stdout.readline() == "preloaded import output\n"
    return json.loads(proc.stdout.readline())


def test_a_job_sees_what_a_fresh_interpreter_would(server):
    s, tmp, _ = server
    fresh, forked = (_start(server, python, "ok") for python in (sys.executable, s.shim))
    got = {}
    for name, proc in (("fresh", fresh), ("forked", forked)):
        got[name] = _first(proc)
        assert proc.wait(30) == 0
    assert got["forked"]["preloaded"] and not got["fresh"]["preloaded"]  # the fork did not import it again
    assert got["forked"]["pid"] == got["forked"]["sid"] != forked.pid  # its own session, not the shim's pid
    for key in ("argv", "cwd", "env", "path", "set"):  # set: what the import put in os.environ
        assert got["forked"][key] == got["fresh"][key], key


@pytest.mark.parametrize("mode, code, stderr", [("exit3", 3, "to stderr"), ("raise", 1, "ValueError: boom"),
                                                 ("killed", -signal.SIGKILL, "")])
def test_the_shim_exits_as_the_job_did(server, mode, code, stderr):
    proc = _start(server, server[0].shim, mode)
    assert _first(proc)["env"] == mode
    assert proc.wait(30) == code
    assert stderr in proc.stderr.read()


def test_sigterm_to_the_shims_group_reaches_the_job_which_exits_its_own_way(server):
    proc = _start(server, server[0].shim, "term", start_new_session=True)
    _first(proc)
    os.killpg(proc.pid, signal.SIGTERM)  # what launchers.local does to a stage
    assert proc.wait(30) == 42
    assert proc.stdout.read() == "got SIGTERM\n"


def test_a_signal_without_a_handler_kills_job_and_shim_alike(server):
    proc = _start(server, server[0].shim, "sleep")
    _first(proc)
    proc.send_signal(signal.SIGUSR1)
    assert proc.wait(30) == -signal.SIGUSR1


def test_sigkill_to_the_shim_kills_the_job(server):
    proc = _start(server, server[0].shim, "sleep", start_new_session=True)
    job = _first(proc)["pid"]
    os.killpg(proc.pid, signal.SIGKILL)
    assert proc.wait(30) == -signal.SIGKILL
    deadline = time.monotonic() + 10
    while _alive(job):
        assert time.monotonic() < deadline, f"job {job} still runs after its shim was killed"
        time.sleep(0.05)


def test_a_session_shims_job_leaves_no_straggler_in_its_group(server):
    proc = _start(server, server[0].shim, "straggler", start_new_session=True)
    job = _first(proc)["pid"]
    assert proc.wait(30) == 0
    deadline = time.monotonic() + 10
    while _group_alive(job):
        assert time.monotonic() < deadline, f"job {job}'s group still has a process after the job ended"
        time.sleep(0.05)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def _alive(pid: int) -> bool:
    try:  # the server reaps its children: a zombie does not linger
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_pythonunbuffered_output_arrives_before_the_job_ends(server):
    proc = _start(server, server[0].shim, "unbuffered", {"PYTHONUNBUFFERED": "1"})
    try:
        assert _first(proc)["preloaded"]  # it sleeps 60 s after printing
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.parametrize("how", ["startup environment", "not -m"])
def test_what_it_cannot_fork_runs_in_the_real_interpreter(server, how):
    s, tmp, env = server
    if how == "not -m":
        proc = subprocess.Popen([s.shim, str(tmp / "fork_py_job.py"), "ok"], env=env, stdout=subprocess.PIPE,
                                text=True)
        got = _first(proc)
    else:  # OMP_NUM_THREADS is read when torch is imported: the server's would be wrong
        proc = _start(server, s.shim, "ok", {"OMP_NUM_THREADS": "7"})
        got = _first(proc)
        assert "refused fork_py_job: its environment differs in ['OMP_NUM_THREADS']" in open(s.log).read()
    assert proc.wait(30) == 0
    assert not got["preloaded"] and got["pid"] == proc.pid  # the shim's own process, exec'd


def test_a_job_with_what_the_servers_imports_set_is_forked(server):
    """A caller that has since imported what the server did (pytest's torch sets
    TORCHINDUCTOR_CACHE_DIR) is forked; another value is refused."""
    s, _, _ = server
    same = _start(server, s.shim, "ok", {"TORCH_FORKPY_SET": "at import"})
    got = _first(same)
    assert same.wait(30) == 0
    assert got["preloaded"] and got["set"] == "at import"
    other = _start(server, s.shim, "ok", {"TORCH_FORKPY_SET": "elsewhere"})
    got = _first(other)
    assert other.wait(30) == 0
    assert not got["preloaded"] and got["set"] == "at import"  # the fresh interpreter's import set it
    assert "refused fork_py_job: its environment differs in ['TORCH_FORKPY_SET']" in open(s.log).read()
