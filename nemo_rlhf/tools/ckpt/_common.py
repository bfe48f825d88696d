"""What every ``nemo-rlhf-ckpt`` command shares: exit codes and :class:`CLIError`, checks
of path arguments and output folders, reading a checkpoint's ``config.yaml``, loading its
full tensors, and printing the result (text or ``--json``).

Leaves out the commands themselves (one module each), the parser (:mod:`.cli`) and the
multi-process layout job (:mod:`.spawn`). Third-party imports that cost time (torch,
omegaconf) stay inside the functions, so ``--help`` and bad-input errors stay quick.
"""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

from nemo_rlhf.checkpoint import find_latest_checkpoint, verify_checkpoint
from nemo_rlhf.checkpoint.io import load_full_tensors
from nemo_rlhf.models.config import ModelConfig

EXIT_OK, EXIT_PROBLEMS, EXIT_BAD_INPUT = 0, 1, 2


class CLIError(Exception):
    """Bad input: reported as one line on stderr, exit code 2."""


def quiet() -> None:
    """Silence import-time chatter (TE/Apex fallbacks) so stderr carries only our lines."""
    warnings.filterwarnings("ignore", module=r"megatron(\.|$)")
    warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex).*")
    warnings.filterwarnings("ignore", category=FutureWarning)
    import logging

    logging.getLogger("megatron").setLevel(logging.ERROR)
    logging.getLogger("torch.multiprocessing.spawn").setLevel(logging.ERROR)


def first_line(exc: BaseException) -> str:
    """The informative line of an error message (the last one of an embedded traceback)."""
    text = str(exc)
    lines = [x.strip() for x in text.splitlines() if x.strip()]
    if not lines:
        return ""
    return (lines[-1] if "Traceback" in text else lines[0])[:300]


# --------------------------------------------------------------------------- paths
def existing(arg: str) -> Path:
    """``arg`` as a path that exists."""
    p = Path(arg)
    if not p.exists():
        raise CLIError(f"{p}: no such file or directory")
    return p


def ckpt_root(p: Path) -> Path:
    """``<exp_dir>/checkpoints`` when ``p`` is an experiment folder, else ``p``."""
    return p / "checkpoints" if (p / "checkpoints").is_dir() else p


def resolve_ckpt(arg: str) -> Path:
    """A complete ``step_<N>`` folder: ``arg`` itself, or the newest under it."""
    p = existing(arg)
    if (p / "COMPLETE").is_file():
        return p
    if p.is_dir() and any(ckpt_root(p).glob("step_*/COMPLETE")):  # cheap test before torch
        found = find_latest_checkpoint(ckpt_root(p))
        if found is not None:
            return found
    raise CLIError(f"{p}: not a complete checkpoint (no COMPLETE marker) and no complete "
                   "checkpoint under it")


def verified(ckpt: Path) -> Path:
    """``ckpt`` if its files match their recorded checksums (sources of reshard/export)."""
    problems = verify_checkpoint(ckpt)
    if problems:
        raise CLIError(f"{ckpt} is damaged ({'; '.join(problems[:3])}); see `validate`")
    return ckpt


def check_out(arg: str) -> Path:
    """An output folder that must be absent or empty (checked before any work)."""
    p = Path(arg)
    if p.exists() and (not p.is_dir() or any(p.iterdir())):
        raise CLIError(f"{p}: output exists and is not an empty folder (nothing is overwritten; "
                       "choose a new folder)")
    return p


def empty_out(arg: str) -> tuple[Path, bool]:
    """``(path, created)``: create the output folder (see :func:`check_out`)."""
    p = check_out(arg)
    created = not p.exists()
    p.mkdir(parents=True, exist_ok=True)
    return p, created


def discard_out(p: Path, created: bool) -> None:
    """Remove what a failed command wrote into its (previously absent or empty) output."""
    if created:
        shutil.rmtree(p, ignore_errors=True)
    elif p.is_dir():
        for child in p.iterdir():
            if child.is_dir():
                shutil.rmtree(child, ignore_errors=True)
            else:
                child.unlink()


# --------------------------------------------------------------------------- checkpoint contents
def read_yaml(ckpt: Path) -> dict:
    """``<ckpt>/config.yaml`` as a plain dict that has a ``model`` section."""
    f = ckpt / "config.yaml"
    if not f.is_file():
        raise CLIError(f"{ckpt}: no config.yaml (the model architecture is unknown)")
    from omegaconf import OmegaConf

    try:
        cfg = OmegaConf.to_container(OmegaConf.load(f), resolve=True)
    except Exception as exc:  # noqa: BLE001 - yaml / interpolation errors
        raise CLIError(f"{f}: unreadable ({first_line(exc)})") from None
    if not isinstance(cfg, dict) or not isinstance(cfg.get("model"), dict):
        raise CLIError(f"{f}: no 'model' section")
    return cfg


def model_config(cfg: dict, ckpt: Path):
    """The :class:`ModelConfig` of a ``config.yaml`` read by :func:`read_yaml`."""
    from omegaconf import OmegaConf

    try:
        return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ModelConfig), cfg["model"]))
    except Exception as exc:  # noqa: BLE001 - omegaconf raises several types
        raise CLIError(f"{ckpt}/config.yaml: invalid model section: {first_line(exc)}") from None


def full_tensors(path: Path) -> dict:
    """The checkpoint's full (unsharded) tensors by key, non-tensor entries left out."""
    import torch

    return {k: v for k, v in load_full_tensors(path).items() if torch.is_tensor(v)}


# --------------------------------------------------------------------------- output
def dir_size(p: Path) -> int:
    """Bytes of all files under ``p``."""
    return sum(f.stat().st_size for f in p.rglob("*") if f.is_file())


def human_size(n: float) -> str:
    """``n`` bytes as ``"12 B"`` / ``"3.4 MiB"``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024


def layout_text(meta: dict) -> str:
    """``"tp1 pp1 dp1"`` (``"... ep2"`` when saved under expert parallelism) from a
    checkpoint's metadata (``"-"`` when it records none)."""
    par = meta.get("parallel") or {}
    if not par:
        return "-"
    ep = f" ep{par['ep']}" if par.get("ep", 1) != 1 else ""
    return f"tp{par.get('tp', '?')} pp{par.get('pp', '?')} dp{par.get('dp', '?')}{ep}"


def emit(args, doc: dict, lines: list[str]) -> None:
    """Print ``doc`` as JSON under ``--json``, else ``lines``."""
    print(json.dumps(doc, indent=2, default=str) if args.json else "\n".join(lines))
