"""launchers.stages.run_stage passes a SIGTERM sent to the demo on to the running stage
and exits 143 once the stage has stopped its own way; before, the default action killed
the demo alone and the stage ran on (seen with the SmolLM2 calculator runs, #51)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]

STAGE = """
import os, signal, sys, time
def stop(*a):
    print("stage got SIGTERM", flush=True)
    sys.exit(7)
signal.signal(signal.SIGTERM, stop)
print("stage ready", os.getpid(), flush=True)
time.sleep(60)
print("stage ran to its end", flush=True)
"""

DEMO = """
import sys
from pathlib import Path
from launchers.stages import run_stage
run_stage([sys.executable, "-c", sys.argv[1]], Path(sys.argv[2]))
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_sigterm_to_the_demo_reaches_the_stage_and_the_demo_exits_143(tmp_path):
    log = tmp_path / "logs" / "stage.log"
    demo = subprocess.Popen([sys.executable, "-c", DEMO, STAGE, str(log)], cwd=REPO,
                            env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        lines = []
        for line in demo.stdout:  # the command line, then the stage's own output
            lines.append(line)
            if line.startswith("stage ready"):
                break
        assert lines[-1].startswith("stage ready"), lines
        stage = int(lines[-1].split()[-1])
        demo.send_signal(signal.SIGTERM)  # to the demo alone, as `kill PID` does
        assert demo.wait(30) == 143
        rest = demo.stdout.read()
        assert "stage got SIGTERM" in rest and "ran to its end" not in rest
        assert "SIGTERM: passed to the stage, which exited 7" in demo.stderr.read()
        assert "stage got SIGTERM" in log.read_text()
        deadline = time.monotonic() + 10
        while _alive(stage):
            assert time.monotonic() < deadline, "the stage still runs after the demo exited"
            time.sleep(0.05)
    finally:
        if demo.poll() is None:
            demo.kill()
        if "stage" in locals() and _alive(stage):
            os.kill(stage, signal.SIGKILL)
