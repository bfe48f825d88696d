"""``make gpu-check``: the prepared check of the project on a CUDA GPU machine, one command.

    python benchmarks/gpu_check.py [--wheels DIR] [--out PATH] [--peak-tflops X]   (a GPU)
    python benchmarks/gpu_check.py --cpu                         (dry run on the host, ~1 min)

Without CUDA (and without ``--cpu``) it prints that it needs a GPU and exits with 2.
Otherwise it runs, each step a subprocess with a timeout and its output in
``<work>/logs/<step>.log``:

1. **setup**: the machine's own CUDA torch is used (never replaced); the packages of
   ``benchmarks/gpu_check_requirements.txt`` and ``pyproject.toml``'s dependencies that are
   absent or too old are installed with pip (``--wheels DIR``: offline, ``--no-index
   --find-links DIR --no-deps``; DIR made by ``benchmarks/gpu_check_wheels.sh`` on a machine
   with network), then ``pip install --no-deps --no-build-isolation -e .``; the imports
   the runs need are checked. Skipped with ``--cpu`` or ``--no-install``.
2. **device tests**: the suite's ``@pytest.mark.device`` tests (the files that have them)
   with ``NEMO_RLHF_TEST_DEVICE=cuda`` (``cpu`` and ``-x`` with ``--cpu``).
3. **PPO runs**, each ``python -m launchers.local`` with the RM served as its own process
   (an RM checkpoint made first by ``nemo_rlhf.train_rm``, one step, on the tiny demo's
   preference pairs) and ``benchmarks/gpu_check_trainer.py`` as the trainer (the PPO main
   job with per-phase timers), ``trainer.precision=bf16-mixed``, ``reference.mode=offload``:

   * ``tiny``: ``conf/ppo_tiny.yaml``'s tiny model on the synthetic arithmetic prompts;
   * ``tiny_distopt`` (GPU only): the tiny run with ``optim.use_distributed_optimizer=true``
     (megatron's ZeRO-1 optimizer), ``steps - 1`` steps, then resumed from its checkpoint
     to ``steps``;
   * ``smollm2``: SmolLM2-135M-Instruct when ``models/smollm2`` exists (``python -m
     nemo_rlhf.tools.real_model --out models/smollm2``: real weights and tokenizer, the RM
     then uses that tokenizer); otherwise the SmolLM2 *shape* (``model=smollm2_135m``, random
     initialisation, vocabulary 49152) on the tiny demo's prompts and tokenizer, whose
     responses decode to the few ids the tokenizer knows (the compute is the model's). Not
     run with ``--cpu``.

   A run passes when it exits with 0 and every step's core metrics in ``metrics.jsonl``
   are finite.
4. **rollout benchmark**: ``benchmarks/bench_rollout.py`` (KV-cache decoding vs
   transformers' ``generate`` with the same weights on the same device; bf16 on a GPU);
   then, GPU only and where this python has vLLM and ``models/smollm2`` exists,
   ``benchmarks/bench_rollout_engines.py`` (``rollout.engine=vllm`` vs megatron vs
   transformers, refit seconds, PPO step seconds per engine); skipped saying why otherwise.
4b. **context parallelism and routing replay** (``benchmarks/gpu_check_cp.py``): one PPO
   step at CP=2 vs CP=1 (needs 2 GPUs, skipped saying so on one; the step metrics equal,
   peak memory per rank and its ratio reported), and a tiny MoE's train-rollout mismatch
   with ``moe.routing_replay`` off and on.
5. **report**: ``--out`` (JSON) and a printed table: per PPO run the train-phase MFU
   (model FLOPs of the update, :mod:`nemo_rlhf.metrics.flops`, per second of the train
   phase, over the device's dense bf16 peak: :data:`PEAK_BF16_TFLOPS` by device name, or
   ``--peak-tflops``; with ``--cpu`` a measured host GEMM rate), rollout tokens/s, reference
   swap-in/out seconds, and peak allocated/reserved memory per phase, from the trainer's
   ``memory/<phase>_peak_{allocated,reserved}_gib`` metrics when it logs them, else "n/a",
   next to the per-phase peaks the probe trainer measured.

Exit code: 0 every step passed (a skipped one included), 1 a step failed (the report names
it and holds the end of its log), 2 no GPU. With ``--cpu`` everything runs at tiny size on
the host, GPUs hidden (``CUDA_VISIBLE_DEVICES=""``), the device tests and the benchmark
alongside the RM and PPO chain, so that the script is exercised where no GPU is (CI).

Simplified: one node; the PPO runs use one GPU (one trainer rank, the RM server on the
same GPU); the MFU of a 3-step run with a 135M model is a smoke figure, not a tuned one.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_check_cp  # noqa: E402  (benchmarks/gpu_check_cp.py: the CP and routing-replay steps)

REPO = Path(__file__).resolve().parents[1]
REQUIREMENTS = Path(__file__).with_name("gpu_check_requirements.txt")
TRAINER = Path(__file__).with_name("gpu_check_trainer.py")
PROBE_FILE = "gpu_check_probe.jsonl"  # benchmarks/gpu_check_trainer.py writes it

EXIT_OK, EXIT_FAILED, EXIT_NO_GPU = 0, 1, 2

PEAK_BF16_TFLOPS = (
    ("H100 PCIe", 756.0),
    ("H100", 989.0),  # SXM (HBM3); the PCIe card is matched first
    ("H200", 989.0),
    ("A100", 312.0),
    ("L40S", 362.0),
)
"""Dense (no sparsity) bf16 tensor-core peaks, TFLOP/s, by a substring of the CUDA device
name (first match wins): the vendors' data sheets."""

CORE_METRICS = ("reward_mean", "kl_mean", "policy_loss", "value_loss", "entropy", "grad_norm",
                "approx_kl", "response_length", "timing/train_s", "timing/step_s")
"""Metrics that must be finite at every step of a PPO run (others that are not, e.g. an
explained variance of returns without variance, are listed as warnings)."""

MIB = 2 ** 20


@dataclass
class Step:
    """One step of the check and its outcome."""

    name: str
    status: str = "pending"
    """``ok``, ``failed`` or ``skipped``."""
    seconds: float = 0.0
    detail: str = ""
    """One line: what passed, what failed, or why it was skipped."""
    log: Optional[str] = None
    log_tail: Optional[str] = None
    """End of the log of a failed step."""


@dataclass
class Proc:
    """A running subprocess (its own process group) with its log and deadline."""

    step: Step
    popen: subprocess.Popen
    deadline: float
    started: float
    logfile: object = field(repr=False)


def _tail(path: Path, lines: int = 40) -> str:
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError:
        return "(no log)"
    return "\n".join(text[-lines:])


class GPUCheck:
    """The steps of the check (module docstring), their outcomes and the report."""

    def __init__(self, args, torch):
        self.args, self.torch = args, torch
        self.cpu = args.cpu
        self.out = Path(args.out).resolve()
        self.work = Path(args.work_dir or self.out.parent / "gpu_check_work").resolve()
        self.logs = self.work / "logs"
        self.steps: list[Step] = []
        self.report: dict = {"mode": "cpu" if self.cpu else "cuda", "ppo": {}}
        self.python = sys.executable
        self.env = dict(os.environ, PYTHONUNBUFFERED="1",
                        PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
        if self.cpu:
            self.env["CUDA_VISIBLE_DEVICES"] = ""  # a dry run is a host run, GPUs or not
        self.smollm2_dir = Path(args.smollm2_dir).resolve()

    # --- subprocesses --------------------------------------------------------------------
    def start(self, name: str, cmd: list[str], timeout_s: float, env: Optional[dict] = None) -> Proc:
        step = Step(name, log=str(self.logs / f"{name}.log"))
        self.steps.append(step)
        self.logs.mkdir(parents=True, exist_ok=True)
        logfile = open(step.log, "w")
        logfile.write(f"$ {' '.join(cmd)}\n")
        logfile.flush()
        self._say(f"{name}: {' '.join(Path(c).name if c == self.python else c for c in cmd)[:300]}")
        popen = subprocess.Popen(cmd, cwd=REPO, env=env or self.env, stdout=logfile,
                                 stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                 start_new_session=True)
        return Proc(step, popen, time.monotonic() + timeout_s, time.monotonic(), logfile)

    def finish(self, proc: Proc) -> int:
        """Wait for ``proc`` until its deadline (then stop its whole process group);
        returns its exit code (124 after a timeout) and fills in its step's time."""
        try:
            code = proc.popen.wait(max(proc.deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            self._kill(proc.popen)
            code = 124
            proc.step.detail = (f"timed out after {proc.deadline - proc.started:.0f} s "
                                f"(its process group was stopped)")
        proc.logfile.close()
        proc.step.seconds = time.monotonic() - proc.started
        return code

    @staticmethod
    def _kill(popen: subprocess.Popen) -> None:
        for sig, grace in ((signal.SIGTERM, 15.0), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(popen.pid, sig)
            except ProcessLookupError:
                return
            try:
                popen.wait(grace)
                if sig == signal.SIGKILL:
                    return
            except subprocess.TimeoutExpired:
                continue
        # the leader is gone; make sure no straggler of its group survives
        try:
            os.killpg(popen.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def run(self, name: str, cmd: list[str], timeout_s: float, **kw) -> tuple[Step, int]:
        proc = self.start(name, cmd, timeout_s, **kw)
        return proc.step, self.finish(proc)

    def settle(self, step: Step, ok: bool, detail: str) -> bool:
        step.status = "ok" if ok else "failed"
        if detail:
            step.detail = f"{step.detail}; {detail}" if step.detail else detail
        if not ok and step.log:
            step.log_tail = _tail(Path(step.log))
        self._say(f"{step.name}: {step.status} ({step.seconds:.1f} s) {step.detail}")
        if not ok and step.log_tail:
            print("    | " + step.log_tail.replace("\n", "\n    | "), flush=True)
        return ok

    def skip(self, name: str, why: str) -> None:
        self.steps.append(Step(name, status="skipped", detail=why))
        self._say(f"{name}: skipped ({why})")

    @staticmethod
    def _say(message: str) -> None:
        print(f"[gpu-check] {message}", flush=True)

    # --- the steps -------------------------------------------------------------------------
    def setup(self) -> bool:
        """Install what is missing (never torch), then check the imports the runs need."""
        if self.cpu or self.args.no_install:
            self.skip("setup", "--cpu: the current environment is used" if self.cpu
                      else "--no-install")
            return True
        t0 = time.monotonic()
        step = Step("setup", log=str(self.logs / "setup.log"))
        self.steps.append(step)
        self.logs.mkdir(parents=True, exist_ok=True)
        with open(step.log, "w") as log:
            ok, detail = _install(self.python, self.args.wheels, log, self.env)
        step.seconds = time.monotonic() - t0
        if not ok:
            return self.settle(step, False, detail)
        code = subprocess.run(
            [self.python, "-c", "import megatron.core, hydra, omegaconf, fastapi, uvicorn, "
             "pydantic, httpx, tensorboard, safetensors, tokenizers, transformers, pytest; "
             "import nemo_rlhf.train_ppo, nemo_rlhf.serve_rm, launchers.local"],
            cwd=REPO, env=self.env, capture_output=True, text=True, timeout=300)
        with open(step.log, "a") as log:
            log.write(code.stdout + code.stderr)
        step.seconds = time.monotonic() - t0
        return self.settle(step, code.returncode == 0,
                           detail if code.returncode == 0 else
                           f"{detail}; the package does not import: "
                           f"{(code.stderr.strip().splitlines() or ['?'])[-1]}")

    def start_device_tests(self) -> Proc:
        files = sorted({str(p.relative_to(REPO)) for p in (REPO / "tests").rglob("test_*.py")
                        if "pytest.mark.device" in p.read_text(errors="replace")})
        junit = self.work / "device_tests.xml"
        device = "cpu" if self.cpu else "cuda"
        cmd = [self.python, "-m", "pytest", "-m", "device", "-q", "-p", "no:cacheprovider",
               f"--junitxml={junit}", *(["-x"] if self.cpu else []), *files]
        env = dict(self.env, NEMO_RLHF_TEST_DEVICE=device)
        return self.start(f"device_tests_{device}", cmd, self.args.timeout_tests, env=env)

    def finish_device_tests(self, proc: Proc) -> bool:
        code = self.finish(proc)
        result = _junit_summary(self.work / "device_tests.xml")
        self.report["device_tests"] = result
        counts = ", ".join(f"{result[k]} {k}" for k in ("passed", "failed", "errors", "skipped")
                           if result.get(k))
        ok = code == 0 and result.get("passed", 0) > 0
        if code not in (0, 124) and not result.get("failures"):
            counts += f" (pytest exited with {code})"
        failing = "; ".join(f"{f['test']}: {f['message']}" for f in result.get("failures", [])[:5])
        return self.settle(proc.step, ok, counts + (f"; failing: {failing}" if failing else ""))

    def make_data(self) -> Optional[Path]:
        data = self.work / "data"
        code = ("import sys; from nemo_rlhf.tasks.precedence import DemoTaskConfig, "
                "make_demo_dataset; make_demo_dataset(sys.argv[1], DemoTaskConfig(n_sft=64, "
                "n_pref=64, n_ppo=512, n_eval=16, n_val=16), force=True)")
        step, rc = self.run("data", [self.python, "-c", code, str(data)], 120)
        return data if self.settle(step, rc == 0, "tiny demo prompts, preference pairs, "
                                   "character tokenizer" if rc == 0 else f"exit {rc}") else None

    def make_rm(self, name: str, data: Path, tokenizer: Path) -> Optional[Path]:
        """A one-step RM checkpoint (tiny model) on the demo pairs, for ``tokenizer``."""
        exp = self.work / name
        shutil.rmtree(exp, ignore_errors=True)
        cmd = [self.python, "-m", "nemo_rlhf.train_rm", "--config-name", "rm_tiny", f"exp_manager.exp_dir={exp}",
               f"data.train_file={data / 'preference.jsonl'}",
               f"data.val_file={data / 'preference_val.jsonl'}", f"data.tokenizer_dir={tokenizer}",
               "trainer.max_steps=1", "trainer.val_check_interval=0",
               "trainer.global_batch_size=8", "trainer.micro_batch_size=8"]
        step, rc = self.run(name, cmd, self.args.timeout_rm)
        ckpt = exp / "checkpoints"
        ok = rc == 0 and ckpt.is_dir()
        return ckpt if self.settle(step, ok, "" if ok else f"exit {rc}") else None

    def ppo(self, name: str, rm: Path, overrides: list[str], steps: int, about: str) -> bool:
        exp = self.work / f"ppo_{name}"
        shutil.rmtree(exp, ignore_errors=True)
        cmd = [self.python, "-m", "launchers.local", "--rm-checkpoint", str(rm), "--config-name", "ppo_tiny",
               "--exp-dir", str(exp), "--trainer-module", str(TRAINER),
               "--rm-start-timeout-s", str(self.args.timeout_rm), "--stop-grace-s", "15", "--",
               "exp_manager.resume=none", f"trainer.max_steps={steps}",
               "trainer.val_check_interval=0", "trainer.sample_table_every=0",
               "trainer.precision=bf16-mixed", "reference.mode=offload", *overrides]
        step, rc = self.run(f"ppo_{name}", cmd, self.args.timeout_ppo)
        result = {"about": about, "exit_code": rc, "exp_dir": str(exp), "steps_expected": steps,
                  **_read_run(exp)}
        result["summary"] = summarise_run(result, self.report["peak"]["tflops"])
        self.report["ppo"][name] = result
        problems = []
        if rc != 0:
            problems.append(f"exit {rc}")
        if result["steps"] != steps:
            problems.append(f"{result['steps']} of {steps} steps in metrics.jsonl")
        if result["nonfinite_core"]:
            problems.append(f"non-finite metrics: {result['nonfinite_core'][:6]}")
        summary = f"{result['steps']} steps, core metrics finite" if not problems else "; ".join(problems)
        return self.settle(step, not problems, f"{about}: {summary}")

    def ppo_distopt(self, rm: Path, overrides: list[str], steps: int) -> bool:
        """The tiny PPO run with megatron's DistributedOptimizer: ``steps - 1`` steps (a
        checkpoint at the end), then the same command resumed to ``steps``; passes when both
        exit 0, the resumed run starts where the first stopped, its metrics are finite and
        the checkpoint holds the ``megatron_distributed`` optimizer format."""
        exp = self.work / "ppo_tiny_distopt"
        shutil.rmtree(exp, ignore_errors=True)
        base = [self.python, "-m", "launchers.local", "--rm-checkpoint", str(rm), "--config-name", "ppo_tiny",
                "--exp-dir", str(exp), "--trainer-module", str(TRAINER),
                "--rm-start-timeout-s", str(self.args.timeout_rm), "--stop-grace-s", "15", "--",
                "trainer.val_check_interval=0", "trainer.sample_table_every=0",
                "trainer.precision=bf16-mixed", "reference.mode=offload",
                "optim.use_distributed_optimizer=true", *overrides]
        first, rc1 = self.run("ppo_tiny_distopt_first", [*base, "exp_manager.resume=none",
                                                          f"trainer.max_steps={steps - 1}"],
                              self.args.timeout_ppo)
        self.settle(first, rc1 == 0, f"{steps - 1} steps" if rc1 == 0 else f"exit {rc1}")
        step, rc = self.run("ppo_tiny_distopt", [*base, "exp_manager.resume=auto",
                                                  f"trainer.max_steps={steps}"],
                            self.args.timeout_ppo)
        result = {"about": "tiny model, optim.use_distributed_optimizer=true, resumed",
                  "exit_code": rc, "exp_dir": str(exp), "steps_expected": steps, **_read_run(exp)}
        result["summary"] = summarise_run(result, self.report["peak"]["tflops"])
        self.report["ppo"]["tiny_distopt"] = result
        problems = [] if rc1 == 0 else [f"first run exit {rc1}"]
        if rc != 0:
            problems.append(f"resumed run exit {rc}")
        done = sorted({r["step"] for r in result["per_step"]})
        if done != list(range(1, steps + 1)):
            problems.append(f"steps in metrics.jsonl {done}, expected 1..{steps}")
        if result["nonfinite_core"]:
            problems.append(f"non-finite metrics: {result['nonfinite_core'][:6]}")
        meta = exp / "checkpoints" / f"step_{steps}" / "metadata.json"
        fmt = json.loads(meta.read_text()).get("optimizer_format") if meta.is_file() else None
        if fmt != "megatron_distributed":
            problems.append(f"checkpoint optimizer_format {fmt!r}, expected 'megatron_distributed'")
        return self.settle(step, not problems,
                           "; ".join(problems) or f"{steps - 1} steps, saved, resumed to {steps}: "
                           f"finite, megatron_distributed checkpoint")

    def start_bench(self) -> Proc:
        out = self.work / "bench_rollout.json"
        if self.cpu:
            opts = ["--model", "tiny", "--batch", "4", "--prompt", "16", "--new", "8",
                    "--repeats", "1"]
        else:
            opts = ["--model", "smollm2", "--dtype", "bf16", "--batch", "8", "64",
                    "--prompt", "64", "--new", "64", "--repeats", "3"]
            hf_dir = self.smollm2_dir / "hf"
            if (hf_dir / "config.json").is_file():
                opts += ["--hf-dir", str(hf_dir)]
        cmd = [self.python, str(REPO / "benchmarks" / "bench_rollout.py"), *opts,
               "--no-recompute", "--json", str(out)]
        return self.start("rollout_benchmark", cmd, self.args.timeout_bench)

    def finish_bench(self, proc: Proc) -> bool:
        rc = self.finish(proc)
        path = self.work / "bench_rollout.json"
        bench = json.loads(path.read_text()) if rc == 0 and path.is_file() else None
        self.report["rollout_benchmark"] = bench
        if bench is None:
            return self.settle(proc.step, False, f"exit {rc}")
        rows = ", ".join(f"batch {r['batch']}: {r['kv_tokens_per_s']:.0f} vs "
                         f"{r['hf_tokens_per_s']:.0f} tok/s ({r['kv_over_hf']:.2f}x)"
                         for r in bench["rows"])
        return self.settle(proc.step, True, f"{bench['model']} {bench['dtype']}: {rows}")

    def vllm_bench(self) -> bool:
        """``benchmarks/bench_rollout_engines.py`` (vLLM vs megatron vs transformers, refit
        seconds, PPO step seconds per engine) on SmolLM2 in bf16, where this python has vLLM."""
        if self.cpu:
            self.skip("vllm_benchmark", "GPU only; on a CPU it runs in .venv-vllm "
                      "(benchmarks/bench_rollout_engines.py)")
            return True
        probe = subprocess.run([self.python, "-c", "import vllm"], capture_output=True, text=True)
        if probe.returncode:
            self.skip("vllm_benchmark", "vllm is not installed for this python: pip install vllm "
                      "(its CUDA build pins its own torch; a separate venv keeps this one intact)")
            return True
        ckpt = self.smollm2_dir / "megatron_tp1_pp1"
        if not (ckpt / "step_0").is_dir():
            self.skip("vllm_benchmark", f"{ckpt} is missing (python -m nemo_rlhf.tools.real_model)")
            return True
        out = self.work / "bench_rollout_engines.json"
        cmd = [self.python, str(REPO / "benchmarks" / "bench_rollout_engines.py"), "--ckpt",
               str(ckpt), "--dtype", "bf16", "--batch", "32", "128", "--prompt", "64", "--new",
               "64", "--repeats", "3", "--ppo-steps", "3", "--json", str(out)]
        step, rc = self.run("vllm_benchmark", cmd, self.args.timeout_bench)
        bench = json.loads(out.read_text()) if rc == 0 and out.is_file() else None
        self.report["vllm_benchmark"] = bench
        if bench is None:
            return self.settle(step, False, f"exit {rc}")
        rows = ", ".join(f"batch {r['batch']}: vllm {r['vllm_tokens_per_s']:.0f}, megatron "
                         f"{r['megatron_tokens_per_s']:.0f}, hf {r['hf_tokens_per_s']:.0f} tok/s"
                         for r in bench["rows"])
        return self.settle(step, True, rows)

    # --- the whole check -------------------------------------------------------------------
    def execute(self) -> int:
        t0 = time.monotonic()
        self.report["environment"] = _environment(self.torch, self.cpu)
        self.report["peak"] = _peak(self.args, self.torch, self.cpu, self.report["environment"])
        env = self.report["environment"]
        self._say(f"{'CPU dry run' if self.cpu else env['device']} x{env['gpus'] or 1}; torch "
                  f"{env['torch']} (CUDA {env['cuda']}); work folder {self.work}")
        self.work.mkdir(parents=True, exist_ok=True)
        if self.setup():
            background = []
            if self.cpu:  # the dry run: tests and benchmark beside the RM + PPO chain
                background = [("tests", self.start_device_tests()), ("bench", self.start_bench())]
            else:
                self.finish_device_tests(self.start_device_tests())
            self._ppo_runs()
            for kind, proc in background:
                (self.finish_device_tests if kind == "tests" else self.finish_bench)(proc)
            if not self.cpu:
                self.finish_bench(self.start_bench())
            self.vllm_bench()
            gpu_check_cp.run_steps(self)  # context parallelism, MoE routing replay (issue #52)
        self.report["steps"] = [asdict(s) for s in self.steps]
        self.report["ok"] = all(s.status != "failed" for s in self.steps)
        self.report["wall_s"] = time.monotonic() - t0
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self.out.write_text(json.dumps(self.report, indent=1))
        print_report(self.report, self.out)
        return EXIT_OK if self.report["ok"] else EXIT_FAILED

    def _ppo_runs(self) -> None:
        data = self.make_data()
        if data is None:
            for name in ("rm_tiny", "ppo_tiny", "ppo_tiny_distopt", "ppo_smollm2"):
                self.skip(name, "no data (the data step failed)")
            return
        files = [f"data.train_file={data / 'ppo_prompts.jsonl'}",
                 f"data.val_file={data / 'eval.jsonl'}"]
        tiny_tok = data / "tokenizer"
        rm = self.make_rm("rm_tiny", data, tiny_tok)
        steps = self.args.ppo_steps or (2 if self.cpu else 3)
        if rm is None:
            self.skip("ppo_tiny", "no RM checkpoint (rm_tiny failed)")
        else:
            small = (["ppo.num_rollout_samples=16", "ppo.global_batch_size=8",
                      "ppo.micro_batch_size=8", "ppo.forward_micro_batch_size=16"]
                     if self.cpu else [])
            self.ppo("tiny", rm, [*files, f"data.tokenizer_dir={tiny_tok}", *small], steps,
                     "tiny demo model (conf/ppo_tiny.yaml)")
        if self.cpu:
            self.skip("ppo_tiny_distopt", "--cpu: megatron's DistributedOptimizer needs CUDA")
            self.skip("ppo_smollm2", "--cpu: the 135M model is for the GPU run")
            return
        if rm is None:
            self.skip("ppo_tiny_distopt", "no RM checkpoint (rm_tiny failed)")
        else:
            self.ppo_distopt(rm, [*files, f"data.tokenizer_dir={tiny_tok}"], steps)
        ckpt = self.smollm2_dir / "megatron_tp1_pp1"
        real = (ckpt / "step_0").is_dir() and (ckpt / "tokenizer" / "tokenizer.json").is_file()
        model = ["model=smollm2_135m", "ppo.num_rollout_samples=128", "ppo.global_batch_size=64",
                 "ppo.micro_batch_size=32", "ppo.forward_micro_batch_size=64",
                 "rollout.max_new_tokens=64"]
        if real:
            tok = ckpt / "tokenizer"
            rm_smol = self.make_rm("rm_smollm2_tokenizer", data, tok)
            model += [f"exp_manager.init_from={ckpt / 'step_0'}", f"data.tokenizer_dir={tok}"]
            about = f"SmolLM2-135M-Instruct, real weights ({ckpt})"
        else:
            rm_smol = rm
            model += [f"data.tokenizer_dir={tiny_tok}"]
            about = (f"SmolLM2-135M shape, random init, vocab 49152, tiny tokenizer "
                     f"({self.smollm2_dir} absent)")
        if rm_smol is None:
            self.skip("ppo_smollm2", "no RM checkpoint")
        else:
            self.ppo("smollm2", rm_smol, [*files, *model], steps, about)


# --------------------------------------------------------------------------- set-up
def _requirements() -> list[str]:
    """The lines of gpu_check_requirements.txt and pyproject.toml's dependencies (no torch)."""
    import tomllib

    lines = [ln.split("#")[0].strip() for ln in REQUIREMENTS.read_text().splitlines()]
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    return [r for r in lines + deps if r and not re.match(r"torch\b", r)]


def missing_requirements(reqs: list[str]) -> list[str]:
    """The requirements whose package is absent or whose installed version does not
    satisfy them (first occurrence of a name wins)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        from packaging.requirements import Requirement
        from packaging.utils import canonicalize_name
    except ImportError:  # pip's own copy, where packaging is not installed
        from pip._vendor.packaging.requirements import Requirement
        from pip._vendor.packaging.utils import canonicalize_name

    seen, missing = set(), []
    for text in reqs:
        req = Requirement(text)
        name = canonicalize_name(req.name)
        if name in seen:
            continue
        seen.add(name)
        try:
            installed = version(req.name)
        except PackageNotFoundError:
            missing.append(text)
            continue
        if req.specifier and not req.specifier.contains(installed, prereleases=True):
            missing.append(text)
    return missing


def _install(python: str, wheels: Optional[str], log, env: dict) -> tuple[bool, str]:
    """pip-install the missing requirements and the package itself (editable, no deps)."""
    import torch

    if torch.version.cuda is None:
        return False, (f"torch {torch.__version__} is a CPU build: install the machine's CUDA "
                       f"build of torch first (this check never installs torch)")
    missing = missing_requirements(_requirements())
    log.write(f"missing or too old: {missing}\n")
    log.flush()
    pip = [python, "-m", "pip", "install", "--no-input", "--disable-pip-version-check"]
    if missing:
        if wheels:
            src = ["--no-index", "--find-links", str(Path(wheels).resolve()), "--no-deps"]
        else:
            src = ["--no-deps"]  # the list names every dependency; torch is never touched
        rc = subprocess.run(pip + src + missing, stdout=log, stderr=subprocess.STDOUT,
                            cwd=REPO, env=env, timeout=600).returncode
        if rc != 0:
            where = (f"the wheels folder {wheels} (make it with `bash benchmarks/"
                     f"gpu_check_wheels.sh {wheels}` on a machine with network)" if wheels
                     else "the package index (offline? pass --wheels DIR)")
            return False, f"pip could not install {missing} from {where}"
    done = (f"installed {len(missing)} package(s): {', '.join(missing)}" if missing
            else "nothing missing")
    # the package itself; the check's subprocesses also get the clone on PYTHONPATH, so a
    # failure here (e.g. a setuptools older than pyproject's >=64) is reported, not fatal
    rc = subprocess.run(pip + ["--no-deps", "--no-build-isolation", "-e", str(REPO)],
                        stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env=env,
                        timeout=300).returncode
    if rc != 0:
        return True, f"{done}; `pip install --no-deps -e .` FAILED (see the log), runs use PYTHONPATH"
    return True, f"{done}; nemo_rlhf installed editable"


# --------------------------------------------------------------------------- results
def _junit_summary(path: Path) -> dict:
    """passed / failed / errors / skipped counts and the failing tests of a JUnit XML."""
    if not path.is_file():
        return {"passed": 0, "failures": [], "note": f"no {path.name} (pytest did not finish)"}
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root)
    counts = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    failures = []
    for suite in suites:
        for key in counts:
            counts[key] += int(suite.get(key, 0))
        for case in suite.iter("testcase"):
            for child in case:
                if child.tag in ("failure", "error"):
                    failures.append({"test": f"{case.get('classname')}::{case.get('name')}",
                                     "message": (child.get("message") or "").splitlines()[0][:200]
                                     if child.get("message") else child.tag})
    passed = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    return {"passed": passed, "failed": counts["failures"], "errors": counts["errors"],
            "skipped": counts["skipped"], "failures": failures}


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def _read_run(exp: Path) -> dict:
    """metrics.jsonl and the probe's records of a PPO run, summarised per step."""
    metrics = []
    if (exp / "metrics.jsonl").is_file():
        metrics = [json.loads(ln) for ln in (exp / "metrics.jsonl").read_text().splitlines()
                   if ln.strip()]
    metrics = [m for m in metrics if "step" in m and "timing/train_s" in m]
    probe = []
    if (exp / PROBE_FILE).is_file():
        probe = [json.loads(ln) for ln in (exp / PROBE_FILE).read_text().splitlines() if ln.strip()]
    header = next((p for p in probe if "environment" in p), {})
    records = {p["step"]: p for p in probe if "step" in p}
    nonfinite_core, nonfinite_other, per_step = [], [], []
    for m in metrics:
        for k, v in m.items():
            if isinstance(v, float) and not math.isfinite(v):
                (nonfinite_core if k in CORE_METRICS else nonfinite_other).append(f"{k}@{m['step']}")
        for k in CORE_METRICS:
            if k in m and not _finite(m[k]):
                if f"{k}@{m['step']}" not in nonfinite_core:
                    nonfinite_core.append(f"{k}@{m['step']}")
        rec = records.get(m["step"], {})
        phases = rec.get("phases", {})
        row = {"step": m["step"], "shapes": rec.get("shapes"), "flops": rec.get("flops"),
               "phases": phases, "reference_host_bytes": rec.get("reference_host_bytes"),
               "timing": {k: v for k, v in m.items() if k.startswith("timing/")},
               "generated_tokens_per_s": m.get("generated_tokens_per_s"),
               "memory_metrics": {k: v for k, v in m.items() if k.startswith("memory/")},
               "metrics": {k: m.get(k) for k in CORE_METRICS}}
        per_step.append(row)
    return {"steps": len(metrics), "nonfinite_core": nonfinite_core,
            "nonfinite_other": nonfinite_other, "environment": header.get("environment"),
            "model": header.get("model"), "per_step": per_step}


def summarise_run(run: dict, peak_tflops: Optional[float]) -> dict:
    """Train-phase MFU and the other figures of a PPO run: medians over the steps after
    the first (the first holds one-time costs), or the first when there is one step."""
    rows = [r for r in run.get("per_step", []) if r.get("flops") and r["phases"].get("train")]
    use = rows[1:] or rows
    out: dict = {"steps_used": [r["step"] for r in use]}
    if not use:
        return out

    def med(values):
        values = [v for v in values if v is not None]
        return statistics.median(values) if values else None

    train_tflops = med([r["flops"]["train"] / r["phases"]["train"]["s"] / 1e12 for r in use])
    out["train_flops_per_step"] = med([r["flops"]["train"] for r in use])
    out["train_s"] = med([r["phases"]["train"]["s"] for r in use])
    out["train_tflops_per_s"] = train_tflops
    out["train_mfu"] = train_tflops / peak_tflops if peak_tflops else None
    out["rollout_tokens_per_s"] = med([r["shapes"]["generated_tokens"] / r["phases"]["rollout"]["s"]
                                       for r in use if r["phases"].get("rollout")])
    for phase in ("reference_swap_in", "reference_swap_out", "reference_forward"):
        out[f"{phase}_s"] = med([r["phases"].get(phase, {}).get("s") for r in use])
    host = use[-1].get("reference_host_bytes")
    if host and out.get("reference_swap_in_s"):
        # swap-in moves the actor out and the reference in (host_bytes); swap-out half of it
        out["reference_swap_in_gb_per_s"] = host / out["reference_swap_in_s"] / 1e9
        out["reference_swap_out_gb_per_s"] = host / 2 / out["reference_swap_out_s"] / 1e9
    out["trainer_reference_logprobs_s"] = med([r["timing"].get("timing/reference_logprobs_s")
                                               for r in use])
    memory = {}
    for phase in ("rollout", "old_logprobs_values", "reference_swap_in", "reference_forward",
                  "reference_swap_out", "train"):
        probe = [r["phases"].get(phase, {}) for r in rows]
        memory[phase] = {
            "probe_peak_allocated_gib": max((p.get("peak_allocated_gib") or 0 for p in probe), default=0) or None,
            "probe_peak_reserved_gib": max((p.get("peak_reserved_gib") or 0 for p in probe), default=0) or None}
    for r in rows:  # the trainer's own memory/<phase>_peak_{allocated,reserved}_gib metrics
        for key, value in r["memory_metrics"].items():
            m = re.fullmatch(r"memory/(.+)_peak_(allocated|reserved)_gib", key)
            if m and _finite(value):
                slot = memory.setdefault(m.group(1), {})
                name = f"metrics_peak_{m.group(2)}_gib"
                slot[name] = max(slot.get(name) or 0.0, value)
    out["memory_gib"] = memory
    return out


def _environment(torch, cpu: bool) -> dict:
    import platform

    info = {"python": platform.python_version(), "torch": torch.__version__,
            "cuda": torch.version.cuda, "gpus": 0 if cpu else torch.cuda.device_count(),
            "device": "cpu" if cpu else torch.cuda.get_device_name(0)}
    for dist in ("megatron-core", "transformers", "transformer-engine"):
        try:
            from importlib.metadata import version

            info[dist] = version(dist)
        except Exception:  # noqa: BLE001 - absent
            info[dist] = None
    return info


def measure_host_gemm_tflops(torch, dtype, n: int = 1024, reps: int = 5) -> float:
    """Best of ``reps`` ``n x n x n`` matrix products on the host, TFLOP/s (2 n^3 each)."""
    a = torch.randn(n, n, dtype=dtype)
    b = torch.randn(n, n, dtype=dtype)
    a @ b  # warm-up
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t0)
    return 2 * n ** 3 / best / 1e12


def _peak(args, torch, cpu: bool, env: dict) -> dict:
    """The dense bf16 peak the MFU divides by, and where it comes from."""
    if args.peak_tflops:
        return {"tflops": args.peak_tflops, "source": "--peak-tflops"}
    if cpu:
        rate = measure_host_gemm_tflops(torch, torch.bfloat16)
        return {"tflops": rate, "source": "measured host bf16 GEMM (1024^3, best of 5)"}
    for key, tflops in PEAK_BF16_TFLOPS:
        if key.lower() in env["device"].lower():
            return {"tflops": tflops, "source": f"table: {key} dense bf16"}
    return {"tflops": None, "source": f"unknown device {env['device']!r}: pass --peak-tflops"}


# --------------------------------------------------------------------------- printing
def _fmt(x, spec: str = ".2f", unit: str = "") -> str:
    return "n/a" if x is None else f"{x:{spec}}{unit}"


def print_report(report: dict, path: Path) -> None:
    env, peak = report["environment"], report["peak"]
    gpus = "" if report["mode"] == "cpu" else f" x{env['gpus']}"
    print(f"\n=== GPU check ({report['mode']}) on {env['device']}{gpus}"
          f": torch {env['torch']}, CUDA {env['cuda']}, megatron-core {env['megatron-core']}, "
          f"transformers {env['transformers']}, layer spec local"
          f"{' (transformer-engine ' + env['transformer-engine'] + ' installed, not used)' if env.get('transformer-engine') else ''} ===")
    print(f"peak used for MFU: {_fmt(peak['tflops'], '.4g', ' TFLOP/s')} ({peak['source']})")
    print(f"{'step':<26} {'status':<8} {'s':>7}  detail")
    for s in report["steps"]:
        print(f"{s['name']:<26} {s['status']:<8} {s['seconds']:>7.1f}  {s['detail'][:150]}")
    runs = report.get("ppo", {})
    if runs:
        print(f"\n{'PPO run':<13} {'train TFLOP/s':>13} {'MFU':>7} {'rollout tok/s':>13} "
              f"{'ref swap in/out s':>18} {'ref fwd s':>9} {'train peak alloc/resv GiB':>26}  steps")
        for name, run in runs.items():
            s = run.get("summary", {})
            mem = s.get("memory_gib", {}).get("train", {})
            alloc = mem.get("metrics_peak_allocated_gib", mem.get("probe_peak_allocated_gib"))
            resv = mem.get("metrics_peak_reserved_gib", mem.get("probe_peak_reserved_gib"))
            mfu = s.get("train_mfu")
            print(f"{name:<13} {_fmt(s.get('train_tflops_per_s'), '.4g'):>13} "
                  f"{_fmt(None if mfu is None else 100 * mfu, '.3g', '%'):>7} "
                  f"{_fmt(s.get('rollout_tokens_per_s'), '.0f'):>13} "
                  f"{_fmt(s.get('reference_swap_in_s'), '.4f') + '/' + _fmt(s.get('reference_swap_out_s'), '.4f'):>18} "
                  f"{_fmt(s.get('reference_forward_s'), '.3f'):>9} "
                  f"{_fmt(alloc, '.2f') + '/' + _fmt(resv, '.2f'):>26}  {s.get('steps_used')}")
        print("\npeak memory per phase, GiB allocated/reserved: trainer metrics "
              "(memory/<phase>_peak_*_gib) | probe")
        for name, run in runs.items():
            for phase, m in run.get("summary", {}).get("memory_gib", {}).items():
                print(f"  {name:<13} {phase:<22} "
                      f"{_fmt(m.get('metrics_peak_allocated_gib'))}/{_fmt(m.get('metrics_peak_reserved_gib'))}"
                      f" | {_fmt(m.get('probe_peak_allocated_gib'))}/{_fmt(m.get('probe_peak_reserved_gib'))}")
    bench = report.get("rollout_benchmark")
    if bench:
        print(f"\nrollout decode, {bench['model']} {bench['dtype']} on {bench['device']}, "
              f"prompt {bench['prompt_tokens']} + {bench['new_tokens']} tokens, greedy: ours (KV "
              f"cache) vs transformers {bench['transformers']} generate, tokens/s")
        for r in bench["rows"]:
            print(f"  batch {r['batch']:>3}: {r['kv_tokens_per_s']:>9.0f} vs "
                  f"{r['hf_tokens_per_s']:>9.0f}  ({r['kv_over_hf']:.2f}x, rows identical "
                  f"{r['rows_identical_to_hf']}/{r['batch']})")
    failed = [s["name"] for s in report["steps"] if s["status"] == "failed"]
    print(f"\n{'FAILED: ' + ', '.join(failed) if failed else 'all steps passed'}; "
          f"wall {report['wall_s']:.0f} s; report {path}")


# --------------------------------------------------------------------------- entry
def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python benchmarks/gpu_check.py",
                                description=__doc__.split("\n")[0])
    p.add_argument("--cpu", action="store_true",
                   help="dry run at tiny size on the host (no GPU needed; about a minute)")
    p.add_argument("--out", default=str(REPO / "experiments" / "gpu_check" / "gpu_check.json"),
                   help="the JSON report (default experiments/gpu_check/gpu_check.json)")
    p.add_argument("--work-dir", default=None,
                   help="data, checkpoints, logs (default: gpu_check_work beside --out)")
    p.add_argument("--wheels", default=None, metavar="DIR",
                   help="install missing packages offline from DIR (benchmarks/gpu_check_wheels.sh)")
    p.add_argument("--no-install", action="store_true", help="skip the set-up step")
    p.add_argument("--peak-tflops", type=float, default=None,
                   help="dense bf16 peak of the GPU, TFLOP/s (default: by device name)")
    p.add_argument("--ppo-steps", type=int, default=None, help="PPO steps per run (3; --cpu: 2)")
    p.add_argument("--smollm2-dir", default=str(REPO / "models" / "smollm2"),
                   help="python -m nemo_rlhf.tools.real_model's --out (real weights if present)")
    p.add_argument("--timeout-tests", type=float, default=300.0, help="seconds (device tests)")
    p.add_argument("--timeout-rm", type=float, default=240.0,
                   help="seconds (an RM checkpoint; the RM server's start)")
    p.add_argument("--timeout-ppo", type=float, default=420.0, help="seconds (one PPO run)")
    p.add_argument("--timeout-bench", type=float, default=300.0, help="seconds (rollout benchmark)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        import torch
    except ImportError as exc:
        print(f"gpu_check: torch does not import ({exc}); it needs the machine's own torch",
              file=sys.stderr)
        return EXIT_FAILED
    if not args.cpu and not torch.cuda.is_available():
        print(f"gpu_check: needs a CUDA GPU, and torch {torch.__version__} (CUDA build: "
              f"{torch.version.cuda}) sees none (CUDA_VISIBLE_DEVICES="
              f"{os.environ.get('CUDA_VISIBLE_DEVICES')!r}). Run it on a GPU machine, or "
              f"`python benchmarks/gpu_check.py --cpu` for the dry run on the host.",
              file=sys.stderr)
        return EXIT_NO_GPU
    return GPUCheck(args, torch).execute()


if __name__ == "__main__":
    sys.exit(main())
