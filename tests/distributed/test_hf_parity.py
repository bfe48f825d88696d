"""Hugging Face interop and resharding, end to end (transformers in-process, 2 gloo ranks).

One module fixture does all the work once: tiny random Llama (GQA, untied), Llama 3.1 (its
RoPE scaling), Mistral, Qwen3 (q / k norms, its own head size), Qwen2 (QKV
biases, tied) and GPT-2 (tied, learned positions) built with transformers and saved with
tokenizer files; ``import-hf`` of each (TP=1; GPT-2 also with ``--pp 2``); ``reshard`` of
the Llama import to TP=2; ONE 2-rank spawn for every megatron-side forward (TP=1, TP=2,
PP=2, the resharded checkpoint) that also saves a reward model at TP=2; then ``export-hf``
and transformers' ``from_pretrained``. The tests assert on what the fixture collected.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.distributed.harness import run_ranks

pytest.importorskip("transformers")

ARCHS = ("llama", "llama31", "mistral", "qwen2", "qwen3", "gpt2")
# 40 positions: past llama31's original_max_position_embeddings (32)
IDS = torch.randint(3, 150, (2, 40), generator=torch.Generator().manual_seed(0))
EXPORT_AS = {"mistral": ["--arch", "mistral"]}  # (the others: what export-hf infers)
TOL = 1e-4


# --------------------------------------------------------------------------- HF side
def _tokenizer(directory: Path, vocab_size: int) -> None:
    """A WordLevel tokenizer with exactly ``vocab_size`` ids and HF special-token files."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{f"t{i}": i for i in range(3, vocab_size)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(["<pad>", "<s>", "</s>"])
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "</s>", "pad_token": "<pad>",
        "bos_token": {"content": "<s>", "__type": "AddedToken"}}))


def _hf_models():
    from transformers import (GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, MistralConfig,
                              MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM)

    common = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64)
    return {
        "llama": LlamaForCausalLM(LlamaConfig(vocab_size=200, tie_word_embeddings=False,
                                              rope_theta=500000.0, **common)),
        # Llama 3.1's RoPE scaling, its context shrunk to 32 tokens so that the three bands
        # (kept, interpolated, divided by the factor) all occur at this head size
        "llama31": LlamaForCausalLM(LlamaConfig(
            vocab_size=200, tie_word_embeddings=False, rope_theta=500000.0, rope_scaling={
                "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32}, **common)),
        "mistral": MistralForCausalLM(MistralConfig(vocab_size=180, tie_word_embeddings=False,
                                                    sliding_window=None, rope_theta=1000000.0, **common)),
        "qwen2": Qwen2ForCausalLM(Qwen2Config(vocab_size=150, tie_word_embeddings=True, **common)),
        # per-head q / k norms, a head size of its own (24, not 64 / 4), tied embeddings
        "qwen3": Qwen3ForCausalLM(Qwen3Config(vocab_size=170, tie_word_embeddings=True, head_dim=24,
                                              attention_bias=False, **common)),
        "gpt2": GPT2LMHeadModel(GPT2Config(vocab_size=260, n_embd=64, n_layer=2, n_head=4,
                                           n_positions=64)),
    }


def _cli(*argv) -> None:
    from nemo_rlhf.tools.ckpt.cli import main

    assert main([str(a) for a in argv]) == 0, argv


def _model_cfg(ckpt: Path):
    from omegaconf import OmegaConf

    from nemo_rlhf.models.config import ModelConfig

    cfg = OmegaConf.load(Path(ckpt) / "config.yaml")
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ModelConfig), cfg.model))


# --------------------------------------------------------------------------- megatron side
def _forward_logits(ckpt: Path, dims, kind: str = "actor_critic"):
    """Full-vocabulary logits ``[batch, seq, vocab_size]`` of a checkpoint at ``dims``
    (None on a stage without the output)."""
    from nemo_rlhf.checkpoint import load_model_weights
    from nemo_rlhf.models.actor_critic import build_model
    from nemo_rlhf.models.vocab_parallel import gather_vocab_parallel
    from nemo_rlhf.models.engine import forward_backward

    cfg = _model_cfg(ckpt)
    model = build_model(cfg, dims, kind=kind).eval()
    load_model_weights(ckpt, model, init_heads=True)
    with torch.no_grad():
        res = forward_backward(model, [{"input_ids": IDS, "attention_mask": torch.ones_like(IDS)}],
                               None, forward_only=True, with_values=False)
    if not res:
        return None
    return gather_vocab_parallel(res[0]["output"], dims.tp_group)[..., :cfg.vocab_size]


def _worker(rank: int, root: str):
    from omegaconf import OmegaConf

    from nemo_rlhf.checkpoint import load_model_weights, save_checkpoint
    from nemo_rlhf.distributed import ParallelConfig, initialize_distributed
    from nemo_rlhf.models.actor_critic import build_model
    from nemo_rlhf.models.engine import model_forward

    root = Path(root)
    out = {}
    for tp in (1, 2):
        dims = initialize_distributed(ParallelConfig(tensor_model_parallel_size=tp), seed=0)
        for arch in ARCHS:
            out[f"{arch}_tp{tp}"] = _forward_logits(root / "imported" / arch / "step_0", dims)
    out["llama_resharded_tp2"] = _forward_logits(root / "resharded" / "step_0", dims)
    # a reward model on the Llama backbone, saved at TP=2 (export-hf reads it unsharded)
    src = root / "imported" / "llama" / "step_0"
    rm = build_model(_model_cfg(src), dims, kind="reward").eval()
    load_model_weights(src, rm, init_heads=True)
    config = OmegaConf.to_container(OmegaConf.load(src / "config.yaml"))
    with torch.no_grad():
        rm.reward_head.weight.copy_(torch.randn(1, 64, generator=torch.Generator().manual_seed(5)))
        out["rm_rewards"] = model_forward(rm, IDS, torch.ones_like(IDS))[:, -1].clone()
        save_checkpoint(root / "rm", 1, rm, None, {"step": 1}, config, dims)
        rm.reward_head.bias.fill_(0.25)
        save_checkpoint(root / "rm_bias", 1, rm, None, {"step": 1}, config, dims)
    dims = initialize_distributed(ParallelConfig(pipeline_model_parallel_size=2), seed=0, num_layers=2)
    out["gpt2_pp2"] = _forward_logits(root / "imported_pp2" / "gpt2" / "step_0", dims)
    out["gpt2_pp2_rank"] = dims.pp_rank
    return out


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    root = tmp_path_factory.mktemp("hf")
    torch.manual_seed(0)
    ref = {}
    for arch, model in _hf_models().items():
        with torch.no_grad():  # perturb norms/biases away from their 1/0 init
            for p in model.parameters():
                p.add_(0.02 * torch.randn_like(p))
        model.eval().save_pretrained(root / "hf" / arch)
        _tokenizer(root / "hf" / arch, model.config.vocab_size)
        with torch.no_grad():
            ref[arch] = model(IDS).logits
        _cli("import-hf", root / "hf" / arch, "--out", root / "imported" / arch)
    _cli("import-hf", root / "hf" / "gpt2", "--out", root / "imported_pp2" / "gpt2", "--pp", 2)
    _cli("reshard", root / "imported" / "llama", "--tp", 2, "--out", root / "resharded")
    ranks = run_ranks(_worker, 2, root=str(root))
    exported = {}
    for arch in ARCHS:
        _cli("export-hf", root / "imported" / arch, "--out", root / "exported" / arch, *EXPORT_AS.get(arch, []))
        hf = AutoModelForCausalLM.from_pretrained(root / "exported" / arch).eval()
        with torch.no_grad():
            exported[arch] = hf(IDS).logits
    _cli("export-hf", root / "rm", "--rm", "--out", root / "exported_rm")
    hf_rm = AutoModelForSequenceClassification.from_pretrained(root / "exported_rm").eval()
    with torch.no_grad():
        rm_scores = hf_rm(IDS).logits
    return {"root": root, "ref": ref, "ranks": ranks, "exported": exported, "rm_scores": rm_scores}


def _close(a, b, tol):
    assert a.shape == b.shape, (a.shape, b.shape)
    diff = float((a - b).abs().max())
    assert diff <= tol, f"max |diff| = {diff:.3g} > {tol}"


# --------------------------------------------------------------------------- tests
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("tp", [1, 2])
def test_imported_model_gives_transformers_logits(env, arch, tp):
    for rank in env["ranks"]:
        _close(rank[f"{arch}_tp{tp}"], env["ref"][arch], TOL)


def test_import_at_pipeline_layout_gives_transformers_logits(env):
    last = [r for r in env["ranks"] if r["gpt2_pp2_rank"] == 1][0]
    _close(last["gpt2_pp2"], env["ref"]["gpt2"], TOL)
    meta = json.loads((env["root"] / "imported_pp2" / "gpt2" / "step_0" / "metadata.json").read_text())
    assert meta["parallel"]["pp"] == 2


def test_resharded_checkpoint_gives_the_source_logits(env):
    r = env["ranks"][0]
    _close(r["llama_resharded_tp2"], r["llama_tp2"], 1e-6)
    _close(r["llama_resharded_tp2"], r["llama_tp1"], 1e-6)
    meta = json.loads((env["root"] / "resharded" / "step_0" / "metadata.json").read_text())
    assert (meta["parallel"]["tp"], meta["parallel"]["pp"]) == (2, 1)


@pytest.mark.parametrize("arch", ARCHS)
def test_exported_model_loads_in_transformers_with_same_logits(env, arch):
    _close(env["exported"][arch], env["ref"][arch], TOL)
    exported = json.loads((env["root"] / "exported" / arch / "config.json").read_text())
    source = json.loads((env["root"] / "hf" / arch / "config.json").read_text())
    assert exported["model_type"] == source["model_type"]
    assert exported.get("rope_scaling") == source.get("rope_scaling")


@pytest.mark.parametrize("arch", ARCHS)
def test_import_then_export_is_bit_identical(env, arch):
    from safetensors.torch import load_file

    original = load_file(env["root"] / "hf" / arch / "model.safetensors")
    exported = load_file(env["root"] / "exported" / arch / "model.safetensors")
    assert sorted(exported) == sorted(original)
    for k, v in original.items():
        assert exported[k].dtype == v.dtype and torch.equal(exported[k], v), k


def test_import_writes_tokenizer_config_and_no_value_head(env):
    from megatron.core import dist_checkpointing

    from nemo_rlhf.data.tokenizer import Tokenizer

    out = env["root"] / "imported" / "llama"
    specials = json.loads((out / "tokenizer" / "special_tokens.json").read_text())
    assert specials == {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>"}
    tok = Tokenizer(_yaml(out / "step_0")["data"]["tokenizer_dir"])
    assert (tok.bos_id, tok.eos_id, tok.pad_id, tok.vocab_size) == (1, 2, 0, 200)
    keys = dist_checkpointing.load_tensors_metadata(str(out / "step_0" / "dist"))
    assert not [k for k in keys if "head" in k]
    assert (out / "conf" / "model" / "hf_llama.yaml").is_file()
    cfg = _model_cfg(out / "step_0")
    assert (cfg.num_query_groups, cfg.rotary_base) == (2, 500000)
    assert not cfg.share_embeddings_and_output_weights


def _yaml(ckpt: Path) -> dict:
    from omegaconf import OmegaConf

    return OmegaConf.to_container(OmegaConf.load(ckpt / "config.yaml"))


def test_rm_export_is_a_sequence_classifier_with_the_same_scores(env):
    cfg = json.loads((env["root"] / "exported_rm" / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForSequenceClassification"] and cfg["num_labels"] == 1
    assert cfg["pad_token_id"] == 0
    _close(env["rm_scores"][:, 0], env["ranks"][0]["rm_rewards"], TOL)


def test_rm_export_refuses_a_nonzero_bias_unless_dropped(env, capsys):
    from nemo_rlhf.tools.ckpt.cli import main

    out = env["root"] / "exported_rm_bias"
    assert main(["export-hf", str(env["root"] / "rm_bias"), "--rm", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "reward_head.bias=0.25" in err[0] and "--drop-rm-bias" in err[0]
    assert not out.exists()
    argv = ["export-hf", str(env["root"] / "rm_bias"), "--rm", "--drop-rm-bias", "--out", str(out)]
    assert main(argv) == 0
    from safetensors.torch import load_file

    assert torch.equal(load_file(out / "model.safetensors")["score.weight"],
                       load_file(env["root"] / "exported_rm" / "model.safetensors")["score.weight"])
