"""tests/fork_server.py: a forked job behaves as a fresh ``python -m MODULE`` process would
(exit codes, environment, argv, working directory, output, its own session)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import pytest

from tests.fork_server import ForkServer

JOB = '''
import json, os, sys, threading, time, atexit
mode = sys.argv[1]
atexit.register(lambda: print("atexit ran", flush=True))
print(json.dumps({"argv": sys.argv[1:], "argv0": sys.argv[0], "cwd": os.getcwd(), "env": os.environ.get("JOB_ONLY"),
                  "server_only": os.environ.get("SERVER_ONLY"), "sid": os.getsid(0), "pid": os.getpid(),
                  "preloaded": "fork_job_preload" in sys.modules, "stdin": sys.stdin.read()}), flush=True)
if mode == "exit3":
    sys.exit(3)
if mode == "raise":
    raise ValueError("boom")
if mode == "thread":  # a non-daemon thread is joined before the exit, as by the interpreter
    threading.Thread(target=lambda: (time.sleep(0.3), print("thread done", flush=True))).start()
if mode == "sleep":
    time.sleep(60)
'''


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fork_server")
    (tmp / "fork_job.py").write_text(JOB)
    (tmp / "fork_job_preload.py").write_text("print('preloaded import output')\n")
    env = {**os.environ, "PYTHONPATH": f"{tmp}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", "SERVER_ONLY": "1"}
    with ForkServer(env, tmp, preload=("fork_job_preload",)) as s:
        yield s, tmp


def _run(server, mode: str, **kw):
    s, tmp = server
    log = tmp / f"{mode}.log"
    code = s.run("fork_job", [mode, "x y"], {"JOB_ONLY": mode}, log, timeout=kw.get("timeout", 60), cwd=tmp)
    return code, log.read_text()


def test_a_job_gets_its_argv_environment_cwd_and_own_session(server):
    code, out = _run(server, "ok")
    assert code == 0
    lines = out.splitlines()
    assert lines[0] == "preloaded import output"  # the server's import output first
    got = json.loads(lines[1])
    assert got["argv"] == ["ok", "x y"] and got["argv0"].endswith("fork_job.py")
    assert got["cwd"] == str(server[1]) and got["env"] == "ok" and got["server_only"] is None
    assert got["sid"] == got["pid"] and got["preloaded"] and got["stdin"] == ""
    assert lines[2] == "atexit ran"


@pytest.mark.parametrize("mode, code, text", [("exit3", 3, "atexit ran"), ("raise", 1, "ValueError: boom"),
                                               ("thread", 0, "thread done")])
def test_a_job_exits_as_the_interpreter_would(server, mode, code, text):
    got, out = _run(server, mode)
    assert got == code and text in out, out


def test_a_killed_job_reports_minus_the_signal_and_a_timeout_kills_its_group(server):
    s, tmp = server
    pid = s.start("fork_job", ["sleep"], {}, tmp / "killed.log", cwd=tmp)
    time.sleep(0.5)
    os.killpg(pid, signal.SIGKILL)
    codes = {}
    for _ in range(200):
        codes.update(s.poll())
        if pid in codes:
            break
        time.sleep(0.05)
    assert codes[pid] == -signal.SIGKILL
    with pytest.raises(subprocess.TimeoutExpired):
        _run(server, "sleep", timeout=1)
