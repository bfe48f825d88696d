"""Run PPO on one machine with the reward model served as its own process.

    python -m launchers.local --rm-checkpoint <ckpt> --nproc 2 -- <trainer hydra overrides>
    python -m launchers.local --no-rm --nproc 2 -- reward.functions='[{name: arithmetic_exact_match}]'
    python -m launchers.local --rm-checkpoint A --rm-ensemble-checkpoint B --rm-ensemble-checkpoint C -- ...

Steps (:func:`run_ppo_with_rm`):

1. the RM server, ``python -m nemo_rlhf.serve_rm checkpoint=<ckpt> server.port=0
   server.address_file=<exp_dir>/rm_address`` (under ``torchrun --standalone`` when
   ``--rm-nproc`` > 1), in its own process group; its output is echoed with an ``[rm]``
   prefix and kept in ``<exp_dir>/rm_server.log``;
2. wait until it wrote the address file and ``GET /health`` answers ready, within
   ``--rm-start-timeout-s`` (a server that exits first fails the launch at once, showing
   the end of its log); each ``--rm-ensemble-checkpoint`` gets a server of its own
   started alongside (``rm_address_<i>``, ``rm_server_<i>.log``, ``[rm<i>]``; i = 1, 2, ...),
   passed as ``reward.ensemble.rm_address_files`` (:mod:`nemo_rlhf.reward.ensemble`);
3. the trainer, ``python -m nemo_rlhf.train_ppo reward.rm_address_file=<file> <overrides>``
   under ``torchrun --standalone --nproc_per_node N`` (plain python when N == 1), in its
   own process group, its output streamed as is (``--trainer-log FILE``: and appended to FILE);
4. with ``rollout.mode=async``: once the trainer's controller wrote
   ``<exp_dir>/rollout_controller`` (``host:port num_workers``), the rollout workers,
   ``python -m nemo_rlhf.rollout_worker --worker-index i <the trainer's overrides>``, each
   in its own process group with its log in ``<exp_dir>/rollout_worker_<i>.log``; on a
   machine with GPUs worker ``i`` gets the GPU after the trainer's ``N`` (``CUDA_VISIBLE_DEVICES``);
5. stop the server and the workers (SIGTERM to their groups, then SIGKILL after
   ``--stop-grace-s``) when the trainer ends, when anything fails, and on Ctrl-C / SIGTERM.

Exit code: the trainer's, including ``REQUEUE_EXIT_CODE`` (42: it saved after SIGTERM or
``trainer.max_time_per_run``; a batch script requeues on it). SIGTERM to the launcher is
forwarded to the trainer, which finishes its step, saves and exits with the requeue code;
the server stays up until then. The first Ctrl-C interrupts the trainer (SIGINT to its
group, up to ``--stop-grace-s`` to exit), a second one kills it; the launcher then exits
with 130. A launch error (bad overrides, server that does not come up) exits with 1.

Simplified on purpose: one machine (``--standalone`` rendezvous, loopback address); a
launcher killed with SIGKILL cannot clean up (its children run in their own process
groups so that a terminal's Ctrl-C reaches the launcher only; a batch scheduler's cgroup
still ends them); the server is not restarted if it dies mid-run (the trainer then fails
with ``RewardServiceError`` after its retries and that exit code is returned).
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import IO, Optional, Sequence

__all__ = ["LaunchError", "LocalRunConfig", "main", "run_ppo_with_rm"]

INTERRUPTED_EXIT_CODE = 130
TERMINATED_EXIT_CODE = 143  # SIGTERM before the trainer started
ADDRESS_FILE = "rm_address"
SERVER_LOG = "rm_server.log"
ROLLOUT_ADDRESS_FILE = "rollout_controller"
"""``nemo_rlhf.rollout.transport.ADDRESS_FILE`` (not imported: it pulls in torch)."""


class LaunchError(RuntimeError):
    """The run could not be started (bad options, an RM server that did not come up)."""


@dataclass
class LocalRunConfig:
    """Options of :func:`run_ppo_with_rm` (and of ``python -m launchers.local``)."""

    rm_checkpoint: Optional[str] = None
    """RM checkpoint (a ``step_<N>`` folder or a checkpoint root) to serve; None: no RM server (reward functions only)."""
    rm_ensemble_checkpoints: list[str] = field(default_factory=list)
    """More RM checkpoints, each served by its own server (same ``rm_nproc`` and
    ``rm_overrides``) and scored beside ``rm_checkpoint`` as a conservative ensemble
    (``reward.ensemble.rm_address_files``; aggregate and coefficient: ``reward.ensemble.*``)."""
    nproc: int = 1
    """Trainer processes (``torchrun --nproc_per_node``; 1 runs plain python)."""
    rm_nproc: int = 1
    """RM server processes (set its TP/PP with rm_overrides, e.g. ``parallel.tensor_model_parallel_size=2``)."""
    rm_overrides: list[str] = field(default_factory=list)
    """Extra hydra overrides of the RM server (``conf/rm_server.yaml`` keys)."""
    exp_dir: Optional[str] = None
    """Experiment folder (the trainer's ``exp_manager.exp_dir``, passed to it); None: the one the trainer's config composes to."""
    rm_start_timeout_s: float = 600.0
    """Deadline for the RM server's address file and ready ``/health``, in seconds."""
    stop_grace_s: float = 30.0
    """Seconds a stopped process group (server; trainer on Ctrl-C) gets before SIGKILL."""
    config_name: str = "ppo"
    """The trainer's Hydra config in ``conf/`` (``ppo``: real-model defaults; the demos'
    ``ppo_tiny`` and ``ppo_smollm2``)."""
    trainer_module: str = "nemo_rlhf.train_ppo"
    """Trainer entry: a module run with ``-m``, or a path to a ``.py`` script."""
    python: str = field(default_factory=lambda: sys.executable)
    """Python interpreter of the child processes (default: ``sys.executable`` when the
    config is made)."""
    trainer_log: Optional[str] = None
    """A file the trainer's output (stdout and stderr) is also appended to, as it goes to
    the console (the demo: ``<out>/logs/ppo.log``, beside its other stages' logs); None: the
    console only."""

    def __post_init__(self) -> None:
        for key in ("nproc", "rm_nproc"):
            value = getattr(self, key)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{key}={value!r}: must be an integer >= 1")
        for key in ("rm_start_timeout_s", "stop_grace_s"):
            if getattr(self, key) <= 0:
                raise ValueError(f"{key}={getattr(self, key)}: must be > 0 seconds")
        if self.rm_checkpoint is not None and not Path(self.rm_checkpoint).is_dir():
            raise ValueError(f"rm_checkpoint={self.rm_checkpoint!r}: no such folder")
        self.rm_ensemble_checkpoints = list(self.rm_ensemble_checkpoints)
        if self.rm_ensemble_checkpoints and self.rm_checkpoint is None:
            raise ValueError("rm_ensemble_checkpoints are the ensemble's other members: "
                             "give the first one as rm_checkpoint (--rm-checkpoint)")
        for path in self.rm_ensemble_checkpoints:
            if not Path(path).is_dir():
                raise ValueError(f"rm_ensemble_checkpoints: {path!r}: no such folder")
        self.rm_overrides = list(self.rm_overrides)


def _say(message: str) -> None:
    print(f"[launcher] {message}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- processes
def _python_cmd(cfg: LocalRunConfig, entry: str, nproc: int) -> list[str]:
    """``python -m entry`` / ``python entry.py``, under torchrun when ``nproc`` > 1."""
    target = [entry] if entry.endswith(".py") else ["-m", entry]
    if nproc == 1:
        return [cfg.python, *target]
    return [cfg.python, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
            str(nproc), *target]


def _start_group(cmd: list[str], **kwargs) -> subprocess.Popen:
    """Start ``cmd`` as the leader of a new process group (killable as a whole)."""
    return subprocess.Popen(cmd, start_new_session=True, stdin=subprocess.DEVNULL, **kwargs)


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:  # the whole group is gone already
        pass


def _stop_group(proc: subprocess.Popen, sig: int, grace_s: float) -> int:
    """Send ``sig`` to the group of ``proc``, wait up to ``grace_s`` s for its leader, then
    SIGKILL whatever is left of the group (stragglers included). Returns the exit code."""
    if proc.poll() is None:
        _signal_group(proc, sig)
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            _say(f"pid {proc.pid} still running {grace_s:.0f} s after {signal.Signals(sig).name}; killing its group")
    _signal_group(proc, signal.SIGKILL)
    return proc.wait()


class _RMServer:
    """The RM server process group, its log pump and its address file."""

    def __init__(self, cfg: LocalRunConfig, exp_dir: Path, checkpoint: str, index: int = 0) -> None:
        """Starts the server of ``checkpoint``; ``index`` > 0: the ensemble's ``index``-th
        other member (its own address file, log and output prefix)."""
        self.cfg = cfg
        suffix = f"_{index}" if index else ""
        self.address_file = exp_dir / f"{ADDRESS_FILE}{suffix}"
        self.log_path = exp_dir / SERVER_LOG.replace(".log", f"{suffix}.log")
        self.prefix = f"[rm{index or ''}] "
        self.address: Optional[str] = None
        self.address_file.unlink(missing_ok=True)  # a stale address must never be used
        cmd = _python_cmd(cfg, "nemo_rlhf.serve_rm", cfg.rm_nproc) + [
            f"checkpoint={checkpoint}", "server.port=0",
            f"server.address_file={self.address_file}", *cfg.rm_overrides]
        self._log = open(self.log_path, "a", encoding="utf-8")
        self._log.write(f"# {time.strftime('%Y-%m-%d %H:%M:%S')} {' '.join(cmd)}\n")
        self._log.flush()
        _say(f"starting the RM server: {' '.join(cmd)}")
        self.proc = _start_group(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                 bufsize=1, errors="replace")
        self._pump = threading.Thread(target=self._copy_output, args=(self.proc.stdout,),
                                      name="rm-server-log", daemon=True)
        self._pump.start()

    def _copy_output(self, stream: IO[str]) -> None:
        for line in stream:
            self._log.write(line)
            self._log.flush()
            sys.stdout.write(f"{self.prefix}{line}")
            sys.stdout.flush()

    def _log_tail(self, lines: int = 30) -> str:
        self._pump.join(2.0)
        try:
            return "".join(self.log_path.read_text(encoding="utf-8", errors="replace").splitlines(True)[-lines:])
        except OSError:
            return "(no log)"

    def wait_ready(self, timeout_s: float) -> str:
        """Waits for the address file, then for a ready ``/health``; returns the address.

        Raises:
            LaunchError: the server exited, or was not ready within ``timeout_s`` seconds.
        """
        from nemo_rlhf.reward.client import RewardModelClient, RewardServiceError

        deadline = time.monotonic() + timeout_s
        while True:
            code = self.proc.poll()
            if code is not None:
                raise LaunchError(f"the RM server exited with code {code} before it was ready; "
                                  f"end of {self.log_path}:\n{self._log_tail()}")
            if self.address_file.is_file():
                text = self.address_file.read_text(encoding="utf-8").strip()
                if text.startswith("http"):
                    break
            if time.monotonic() > deadline:
                raise LaunchError(f"the RM server wrote no address to {self.address_file} within "
                                  f"{timeout_s:.0f} s (rm_start_timeout_s); see {self.log_path}")
            time.sleep(0.1)
        with RewardModelClient(text, timeout_s=5.0) as client:
            try:
                client.wait_until_healthy(deadline_s=max(deadline - time.monotonic(), 1.0))
            except RewardServiceError as exc:
                raise LaunchError(f"the RM server at {text} is not healthy: {exc}") from None
        self.address = text
        _say(f"RM server ready at {text} (pid {self.proc.pid})")
        return text

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, grace_s: float) -> None:
        """SIGTERM to the server ranks (rank 0 shuts down gracefully and releases the
        others; under torchrun the agent is left to see its workers end cleanly), then
        SIGKILL to the whole group after ``grace_s`` seconds."""
        if self.cfg.rm_nproc > 1 and self.proc.poll() is None:
            import psutil

            try:
                workers = psutil.Process(self.proc.pid).children()
            except psutil.Error:
                workers = []
            for w in workers:
                try:
                    w.send_signal(signal.SIGTERM)
                except psutil.Error:
                    pass
            try:
                self.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                pass
        code = _stop_group(self.proc, signal.SIGTERM, grace_s)
        self._pump.join(5.0)
        self._log.close()
        _say(f"RM server stopped (exit code {code})")


class _Tee:
    """The trainer's output copied, line by line, to the console and to ``path`` (appended,
    after a ``# <time> <command>`` line)."""

    def __init__(self, path: Path, cmd: list[str]) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(path, "a", encoding="utf-8")
        self._file.write(f"# {time.strftime('%Y-%m-%d %H:%M:%S')} {' '.join(cmd)}\n")
        self._file.flush()
        self._pump: Optional[threading.Thread] = None

    def start(self, stream: IO[str]) -> None:
        self._pump = threading.Thread(target=self._copy, args=(stream,), name="trainer-log", daemon=True)
        self._pump.start()

    def _copy(self, stream: IO[str]) -> None:
        for line in stream:
            self._file.write(line)
            self._file.flush()
            sys.stdout.write(line)
            sys.stdout.flush()

    def close(self) -> None:
        """After the trainer exited: the rest of its output, then the file closed."""
        if self._pump is not None:
            self._pump.join(10.0)
        self._file.close()


def _visible_gpus() -> list[str]:
    """The GPU ids this launcher may hand out: ``CUDA_VISIBLE_DEVICES``'s, else
    ``nvidia-smi -L``'s indices, else none (a CPU machine)."""
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None:
        return [g for g in env.split(",") if g.strip()]
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [str(i) for i, line in enumerate(out.splitlines()) if line.startswith("GPU ")]


class _RolloutWorkers:
    """``rollout.mode=async``: the rollout worker processes, started once the trainer's
    controller announced itself in ``<exp_dir>/rollout_controller``."""

    def __init__(self, cfg: LocalRunConfig, exp_dir: Path, overrides: list[str]) -> None:
        self.cfg, self.exp_dir, self.overrides = cfg, exp_dir, overrides
        self.address_file = exp_dir / ROLLOUT_ADDRESS_FILE
        self.address_file.unlink(missing_ok=True)  # a previous run's address must never be used
        self.procs: list[subprocess.Popen] = []
        self.logs: list[IO[str]] = []

    def poll(self) -> None:
        """Start the workers if the trainer asked for them (once).

        Raises:
            LaunchError: on a GPU machine, fewer GPUs than trainer + workers.
        """
        if self.procs or not self.address_file.is_file():
            return
        text = self.address_file.read_text(encoding="utf-8").split()
        if len(text) < 2:
            return
        n = int(text[1])
        gpus = _visible_gpus()
        if gpus and len(gpus) < self.cfg.nproc + n:
            raise LaunchError(f"rollout.num_workers={n} needs {self.cfg.nproc + n} GPUs with --nproc "
                              f"{self.cfg.nproc}; {len(gpus)} visible")
        for i in range(n):
            cmd = _python_cmd(self.cfg, "nemo_rlhf.rollout_worker", 1) + ["--worker-index", str(i)]
            if self.cfg.config_name != "ppo":
                cmd += ["--config-name", self.cfg.config_name]
            cmd += self.overrides
            env = dict(os.environ)
            if gpus:
                env["CUDA_VISIBLE_DEVICES"] = gpus[self.cfg.nproc + i]
            log = open(self.exp_dir / f"rollout_worker_{i}.log", "a", encoding="utf-8")
            log.write(f"# {time.strftime('%Y-%m-%d %H:%M:%S')} {' '.join(cmd)}\n")
            log.flush()
            _say(f"starting rollout worker {i}: {' '.join(cmd)} (log {log.name})")
            self.logs.append(log)
            self.procs.append(_start_group(cmd, stdout=log, stderr=subprocess.STDOUT, env=env))

    def stop(self, grace_s: float) -> None:
        """Workers exit when the trainer's controller stops them or disappears; the rest
        get SIGTERM, then SIGKILL after ``grace_s`` seconds."""
        deadline = time.monotonic() + min(grace_s, 10.0)
        for i, proc in enumerate(self.procs):
            try:
                proc.wait(max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                pass
            code = _stop_group(proc, signal.SIGTERM, grace_s)
            if code:
                _say(f"rollout worker {i} exited with code {code}; see {self.exp_dir / f'rollout_worker_{i}.log'}")
        for log in self.logs:
            log.close()


class _SigtermForwarder:
    """While installed (main thread only): SIGTERM before the trainer runs aborts the
    launch; afterwards it is forwarded to the trainer's group (it saves and exits)."""

    def __init__(self) -> None:
        self.trainer: Optional[subprocess.Popen] = None
        self.received = False
        self._previous = None
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, signum, frame) -> None:
        self.received = True
        if self.trainer is None:
            raise _Terminated()
        _say("SIGTERM: forwarding it to the trainer (it saves and exits with the requeue code)")
        _signal_group(self.trainer, signal.SIGTERM)

    def restore(self) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)


class _Terminated(Exception):
    """SIGTERM arrived before the trainer was started."""


# --------------------------------------------------------------------------- config
def _override_value(overrides: Sequence[str], key: str) -> Optional[str]:
    for o in overrides:
        k, sep, v = o.partition("=")
        if sep and k.lstrip("+~") == key:
            return v
    return None


def _composed_exp_dir(overrides: Sequence[str], config_name: str = "ppo") -> str:
    """``exp_manager.exp_dir`` of the trainer's composed config (``conf/<config_name>.yaml``
    + overrides); composing also rejects misspelt overrides before anything starts."""
    from hydra import compose, initialize_config_dir

    import nemo_rlhf.train_ppo  # noqa: F401 - registers the ppo_schema
    from nemo_rlhf.config import check_renamed_keys
    from nemo_rlhf.models.config import CONF_DIR

    try:
        check_renamed_keys(overrides)
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
            composed = compose(config_name=config_name, overrides=list(overrides))
    except Exception as exc:  # noqa: BLE001 - hydra's composition errors name the key
        raise LaunchError(f"trainer overrides {list(overrides)}: {exc}") from None
    return str(composed.exp_manager.exp_dir)


def _resolve_exp_dir(cfg: LocalRunConfig, overrides: list[str]) -> tuple[Path, list[str]]:
    given = _override_value(overrides, "exp_manager.exp_dir")
    if cfg.exp_dir is None:
        return Path(given if given is not None else _composed_exp_dir(overrides, cfg.config_name)), overrides
    if given is not None and Path(given) != Path(cfg.exp_dir):
        raise LaunchError(f"exp_dir={cfg.exp_dir!r} disagrees with the trainer override "
                          f"exp_manager.exp_dir={given!r}; give one of them")
    extra = [] if given is not None else [f"exp_manager.exp_dir={cfg.exp_dir}"]
    return Path(cfg.exp_dir), overrides + extra


# --------------------------------------------------------------------------- the run
def run_ppo_with_rm(trainer_overrides: Sequence[str] = (), cfg: Optional[LocalRunConfig] = None,
                    **options) -> int:
    """Run the PPO trainer, with the RM server alongside when ``rm_checkpoint`` is set.

    Args:
        trainer_overrides: hydra overrides of the trainer (``conf/ppo.yaml`` keys).
        cfg: the options; or pass them as keywords (:class:`LocalRunConfig` fields).

    Returns:
        The trainer's exit code (0, ``REQUEUE_EXIT_CODE`` = 42, 1, ...); 143 when SIGTERM
        arrived before the trainer started.

    Raises:
        LaunchError: bad overrides / options, or an RM server that did not come up (the
            server is stopped first).
        KeyboardInterrupt: after Ctrl-C, once both process groups are gone.
    """
    if cfg is None:
        cfg = LocalRunConfig(**options)
    elif options:
        raise TypeError("run_ppo_with_rm: pass either cfg or keyword options, not both")
    overrides = list(trainer_overrides)
    for key in ("reward.rm_address_file", "reward.rm_url", "reward.ensemble.rm_address_files"):
        if cfg.rm_checkpoint and _override_value(overrides, key) is not None:
            raise LaunchError(f"{key} would bypass the RM server the launcher starts for rm_checkpoint "
                              f"(it passes reward.rm_address_file itself); drop the override")
    exp_dir, overrides = _resolve_exp_dir(cfg, overrides)
    exp_dir.mkdir(parents=True, exist_ok=True)
    servers: list[_RMServer] = []
    trainer: Optional[subprocess.Popen] = None
    tee: Optional[_Tee] = None
    workers = _RolloutWorkers(cfg, exp_dir, overrides)
    sigterm = _SigtermForwarder()
    try:
        if cfg.rm_checkpoint is not None:
            for i, ckpt in enumerate([cfg.rm_checkpoint, *cfg.rm_ensemble_checkpoints]):
                servers.append(_RMServer(cfg, exp_dir, ckpt, i))
            for server in servers:  # started together, waited on in turn
                server.wait_ready(cfg.rm_start_timeout_s)
            overrides = [f"reward.rm_address_file={servers[0].address_file}", *overrides]
            if len(servers) > 1:
                files = ",".join(str(s.address_file) for s in servers[1:])
                overrides = [f"reward.ensemble.rm_address_files=[{files}]", *overrides]
        cmd = _python_cmd(cfg, cfg.trainer_module, cfg.nproc)
        if cfg.config_name != "ppo":
            cmd += ["--config-name", cfg.config_name]
        cmd += overrides
        _say(f"starting the trainer: {' '.join(cmd)}")
        if cfg.trainer_log:
            tee = _Tee(Path(cfg.trainer_log), cmd)
            trainer = _start_group(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                   bufsize=1, errors="replace",
                                   env={**os.environ, "PYTHONUNBUFFERED": "1"})  # lines as they come
            tee.start(trainer.stdout)
        else:
            trainer = _start_group(cmd)
        sigterm.trainer = trainer
        code = _wait_trainer(trainer, servers, workers)
        _report_exit(code)
        return code
    except _Terminated:
        _say("SIGTERM before the trainer started; stopping")
        return TERMINATED_EXIT_CODE
    except KeyboardInterrupt:
        if trainer is not None and trainer.poll() is None:
            _say(f"interrupted: SIGINT to the trainer; {cfg.stop_grace_s:.0f} s to exit (Ctrl-C again kills it)")
            try:
                _stop_group(trainer, signal.SIGINT, cfg.stop_grace_s)
            except KeyboardInterrupt:
                _signal_group(trainer, signal.SIGKILL)
                trainer.wait()
        raise
    finally:
        sigterm.restore()
        if trainer is not None and trainer.poll() is None:
            _stop_group(trainer, signal.SIGTERM, cfg.stop_grace_s)
        elif trainer is not None:
            _signal_group(trainer, signal.SIGKILL)  # stragglers of an exited group
        if tee is not None:
            tee.close()
        workers.stop(cfg.stop_grace_s)
        for server in servers:
            server.stop(cfg.stop_grace_s)


def _wait_trainer(trainer: subprocess.Popen, servers: list[_RMServer], workers: _RolloutWorkers) -> int:
    warned: set[int] = set()
    while True:
        try:
            return trainer.wait(0.5)
        except subprocess.TimeoutExpired:
            pass
        workers.poll()
        for i, server in enumerate(servers):
            if i not in warned and not server.alive():
                _say(f"the RM server exited (code {server.proc.returncode}) while the trainer runs; "
                     f"see {server.log_path}")
                warned.add(i)


def _report_exit(code: int) -> None:
    if code == 0:
        _say("trainer finished")
        return
    # imported only here: the trainer module pulls in torch and megatron (seconds of start-up
    # the launcher does not need before the trainer and the RM server run)
    from nemo_rlhf.train_ppo import REQUEUE_EXIT_CODE

    if code == REQUEUE_EXIT_CODE:
        _say(f"trainer saved and asked to be requeued (exit code {code})")
    else:
        _say(f"trainer failed (exit code {code})")


# --------------------------------------------------------------------------- CLI
def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m launchers.local",
        description="PPO with the reward model served as its own process; trainer overrides follow '--'.",
        argument_default=argparse.SUPPRESS)
    defaults = {f.name: f.default for f in fields(LocalRunConfig)}
    rm = p.add_mutually_exclusive_group(required=True)
    rm.add_argument("--rm-checkpoint", dest="rm_checkpoint", help="RM checkpoint to serve")
    rm.add_argument("--no-rm", dest="no_rm", action="store_true", help="no RM server (reward functions only)")
    for name, kind in (("nproc", int), ("rm_nproc", int), ("rm_start_timeout_s", float),
                       ("stop_grace_s", float), ("exp_dir", str), ("config_name", str),
                       ("trainer_module", str), ("trainer_log", str)):
        p.add_argument(f"--{name.replace('_', '-')}", dest=name, type=kind,
                       help=f"default {defaults[name]}")
    p.add_argument("--rm-ensemble-checkpoint", dest="rm_ensemble_checkpoints", action="append",
                   metavar="CKPT", help="another RM of a conservative ensemble, served beside "
                   "--rm-checkpoint's (repeatable; reward.ensemble.* sets the rule)")
    p.add_argument("--rm-arg", dest="rm_overrides", action="append", metavar="KEY=VALUE",
                   help="RM server hydra override (repeatable), e.g. parallel.tensor_model_parallel_size=2")
    p.add_argument("overrides", nargs="*", help="trainer hydra overrides (after '--')")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    """CLI entry; returns the exit code (see the module docstring)."""
    args = vars(_parser().parse_args(argv))
    overrides = args.pop("overrides", [])
    args.pop("no_rm", None)
    try:
        return run_ppo_with_rm(overrides, LocalRunConfig(**args))
    except (LaunchError, ValueError) as exc:
        _say(f"error: {exc}")
        return 1
    except KeyboardInterrupt:
        return INTERRUPTED_EXIT_CODE


if __name__ == "__main__":
    sys.exit(main())
