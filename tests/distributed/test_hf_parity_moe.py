"""Mixture-of-experts Hugging Face interop (transformers in-process, 2 gloo ranks): tiny
random Qwen3-MoE (``norm_topk_prob`` true and false, untied and tied) and Mixtral models
built by transformers' own classes and saved; ``import-hf`` of each; ONE 2-rank spawn that
runs every megatron-side forward (TP=1, TP=2 and expert-parallel EP=2, where each rank holds
two of the four experts) and saves each model at EP=2; ``export-hf`` of the imported and of
the EP=2 checkpoints and transformers' ``from_pretrained``. The tests assert on what the module fixture collected (the layout of
``tests/distributed/test_hf_parity.py``, whose helpers it uses)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.distributed.harness import run_ranks
from tests.distributed.test_hf_parity import IDS, _cli, _close, _forward_logits, _model_cfg, _tokenizer

pytest.importorskip("transformers")

ARCHS = ("qwen3_moe", "qwen3_moe_unnormalised", "mixtral")
TOL = 1e-4  # IDS: test_hf_parity's [2, 40] (its _forward_logits reads them)


def _hf_models():
    from transformers import MixtralConfig, MixtralForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    common = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=64)
    qwen = dict(common, vocab_size=170, intermediate_size=96, moe_intermediate_size=48, num_experts=4,
                num_experts_per_tok=2, head_dim=24, decoder_sparse_step=1, mlp_only_layers=[])
    return {
        "qwen3_moe": Qwen3MoeForCausalLM(Qwen3MoeConfig(norm_topk_prob=True, tie_word_embeddings=False, **qwen)),
        "qwen3_moe_unnormalised": Qwen3MoeForCausalLM(Qwen3MoeConfig(norm_topk_prob=False,
                                                                    tie_word_embeddings=True, **qwen)),
        "mixtral": MixtralForCausalLM(MixtralConfig(vocab_size=180, intermediate_size=40, num_local_experts=4,
                                                    num_experts_per_tok=2, sliding_window=None,
                                                    tie_word_embeddings=False, **common)),
    }


def _worker(rank: int, root: str):
    from nemo_rlhf.distributed import ParallelConfig, initialize_distributed

    root = Path(root)
    out = {}
    for tp in (1, 2):
        dims = initialize_distributed(ParallelConfig(tensor_model_parallel_size=tp), seed=0)
        for arch in ARCHS:
            out[f"{arch}_tp{tp}"] = _forward_logits(root / "imported" / arch / "step_0", dims)
    dims = initialize_distributed(ParallelConfig(expert_model_parallel_size=2), seed=0, num_moe_experts=4)
    for arch in ARCHS:
        out.update(_at_ep2(root, arch, dims))
    return out


def _at_ep2(root: Path, arch: str, dims) -> dict:
    """At EP=2: the imported model's logits, its weights gathered over the expert-parallel
    group (:func:`~nemo_rlhf.models.hf_mapping.gather_full_tensors`, rank 0's only) and a
    checkpoint saved from it (each rank writing its two experts)."""
    from omegaconf import OmegaConf

    from nemo_rlhf.checkpoint import load_model_weights, save_checkpoint
    from nemo_rlhf.models.actor_critic import build_model
    from nemo_rlhf.models.full_tensors import gather_full_tensors

    src = root / "imported" / arch / "step_0"
    out = {f"{arch}_ep2": _forward_logits(src, dims)}
    model = build_model(_model_cfg(src), dims).eval()
    load_model_weights(src, model, init_heads=True)
    out[f"{arch}_ep2_local_experts"] = len(model.decoder.layers[0].mlp.experts.local_experts)
    gathered = gather_full_tensors(model, None, ep_group=dims.ep_group)
    out[f"{arch}_ep2_gathered"] = gathered if dims.rank == 0 else None
    config = OmegaConf.to_container(OmegaConf.load(src / "config.yaml"))
    config["parallel"]["expert_model_parallel_size"] = 2
    save_checkpoint(root / "saved_ep2" / arch, 0, model, None, {"step": 0}, config, dims)
    return out


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("hf_moe")
    torch.manual_seed(0)
    ref, flipped = {}, {}
    for arch, model in _hf_models().items():
        with torch.no_grad():  # norms away from 1; routers sharper than their init
            for name, p in model.named_parameters():
                p.add_((0.5 if name.endswith(".gate.weight") else 0.02) * torch.randn_like(p))
        model.eval().save_pretrained(root / "hf" / arch)
        _tokenizer(root / "hf" / arch, model.config.vocab_size)
        with torch.no_grad():
            ref[arch] = model(IDS).logits
            if arch.startswith("qwen3_moe"):  # the same weights under the other routing rule
                blocks = [m for m in model.modules() if hasattr(m, "norm_topk_prob")]
                for m in blocks:
                    m.norm_topk_prob = not m.norm_topk_prob
                flipped[arch] = model(IDS).logits
                for m in blocks:
                    m.norm_topk_prob = not m.norm_topk_prob
        _cli("import-hf", root / "hf" / arch, "--out", root / "imported" / arch)
    ranks = run_ranks(_worker, 2, root=str(root))
    exported = {}
    for arch in ARCHS:
        for src, dst in (("imported", "exported"), ("saved_ep2", "exported_from_ep2")):
            _cli("export-hf", root / src / arch, "--out", root / dst / arch)
            hf = AutoModelForCausalLM.from_pretrained(root / dst / arch).eval()
            with torch.no_grad():
                exported[arch if src == "imported" else f"{arch}_from_ep2"] = hf(IDS).logits
    return {"root": root, "ref": ref, "ranks": ranks, "exported": exported, "flipped": flipped}


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("tp", [1, 2])
def test_imported_moe_model_gives_transformers_logits(env, arch, tp):
    for rank in env["ranks"]:
        _close(rank[f"{arch}_tp{tp}"], env["ref"][arch], TOL)


@pytest.mark.parametrize("arch", ARCHS)
def test_at_ep2_each_rank_holds_half_the_experts_and_gives_transformers_logits(env, arch):
    for rank in env["ranks"]:
        assert rank[f"{arch}_ep2_local_experts"] == 2
        _close(rank[f"{arch}_ep2"], env["ref"][arch], TOL)


@pytest.mark.parametrize("arch", ARCHS)
def test_weights_gathered_over_the_expert_parallel_group_are_the_imported_ones(env, arch):
    from nemo_rlhf.checkpoint.io import load_full_tensors

    imported = {k[len("model."):]: v for k, v in
                load_full_tensors(env["root"] / "imported" / arch / "step_0").items() if k.startswith("model.")}
    gathered = env["ranks"][0][f"{arch}_ep2_gathered"]
    experts = [k for k in imported if ".experts." in k]
    assert experts and imported[experts[0]].shape[1] == 4  # [layers, experts, ...]
    assert sorted(k for k in gathered if not k.startswith("value_head.")) == sorted(imported)
    for k, v in imported.items():
        assert torch.equal(gathered[k], v), k


@pytest.mark.parametrize("arch", ARCHS)
def test_a_checkpoint_saved_at_ep2_holds_every_expert_and_exports_to_transformers_logits(env, arch):
    from safetensors.torch import load_file

    from nemo_rlhf.checkpoint import read_metadata
    from nemo_rlhf.checkpoint.io import load_full_tensors

    saved = env["root"] / "saved_ep2" / arch / "step_0"
    assert read_metadata(saved)["parallel"]["ep"] == 2
    _cli("validate", "--deep", saved)  # checksums, and every shard's digest against the full tensors
    full = load_full_tensors(saved)
    imported = load_full_tensors(env["root"] / "imported" / arch / "step_0")
    for k, v in imported.items():
        if torch.is_tensor(v) and k.startswith("model.") and ".experts." in k:
            assert torch.equal(full[k], v), k
    _close(env["exported"][f"{arch}_from_ep2"], env["ref"][arch], TOL)
    original = load_file(env["root"] / "hf" / arch / "model.safetensors")
    exported = load_file(env["root"] / "exported_from_ep2" / arch / "model.safetensors")
    assert sorted(exported) == sorted(original)
    assert all(torch.equal(exported[k], v) for k, v in original.items())


def test_norm_topk_prob_is_imported_as_the_routing_rule_and_the_rule_matters(env):
    """``norm_topk_prob`` true -> ``moe_router_pre_softmax`` false and vice versa; and the
    transformers logits under the other rule differ by far more than the tolerance, so the
    logits tests above tell the two rules apart."""
    for arch in ("qwen3_moe", "qwen3_moe_unnormalised"):
        assert float((env["flipped"][arch] - env["ref"][arch]).abs().max()) > 10 * TOL
    from omegaconf import OmegaConf

    from nemo_rlhf.models.config import ModelConfig

    for arch, pre_softmax in (("qwen3_moe", False), ("qwen3_moe_unnormalised", True)):
        cfg = OmegaConf.to_object(OmegaConf.merge(
            OmegaConf.structured(ModelConfig),
            OmegaConf.load(env["root"] / "imported" / arch / "step_0" / "config.yaml").model))
        assert cfg.moe_router_pre_softmax is pre_softmax
        assert (cfg.num_moe_experts, cfg.moe_router_topk, cfg.moe_ffn_hidden_size) == (4, 2, 48)


@pytest.mark.parametrize("arch", ARCHS)
def test_exported_moe_model_loads_in_transformers_with_same_logits(env, arch):
    _close(env["exported"][arch], env["ref"][arch], TOL)
    exported = json.loads((env["root"] / "exported" / arch / "config.json").read_text())
    source = json.loads((env["root"] / "hf" / arch / "config.json").read_text())
    keys = ("model_type", "num_experts", "num_local_experts", "num_experts_per_tok", "moe_intermediate_size",
            "norm_topk_prob", "intermediate_size", "tie_word_embeddings")
    assert {k: exported.get(k) for k in keys} == {k: source.get(k) for k in keys}
    assert exported["head_dim"] == (source.get("head_dim") or 64 // 4)  # Mixtral's config: null


@pytest.mark.parametrize("arch", ARCHS)
def test_moe_import_then_export_is_bit_identical(env, arch):
    from safetensors.torch import load_file

    original = load_file(env["root"] / "hf" / arch / "model.safetensors")
    exported = load_file(env["root"] / "exported" / arch / "model.safetensors")
    assert sorted(exported) == sorted(original)
    for k, v in original.items():
        assert exported[k].dtype == v.dtype and torch.equal(exported[k], v), k


def test_export_of_a_moe_checkpoint_as_a_dense_arch_is_refused(env, capsys):
    from nemo_rlhf.tools.ckpt.cli import main

    out = env["root"] / "exported_dense"
    assert main(["export-hf", str(env["root"] / "imported" / "qwen3_moe"), "--arch", "qwen3",
                 "--out", str(out)]) != 0
    assert "model.num_moe_experts=4 (qwen3 is dense)" in capsys.readouterr().err
    assert not out.exists()
