"""LoRA (``model.lora``): config refusals, B=0 and disabled adapters give the base logits
exactly, A follows the run's seed, the adapter's delta is ``scale * B A x`` on every target,
gradients reach only the adapters and the value head, and the optimizer holds state for
nothing else."""

from __future__ import annotations

import pytest
import torch

from nemo_rlhf.models.config import LORA_TARGET_MODULES, LoRAConfig, ModelConfig, load_model_preset
from tests.single_rank import single_rank

VOCAB = 64


@pytest.fixture(scope="module")
def dims():
    with single_rank(seed=0) as d:
        yield d


@pytest.mark.parametrize("kwargs, message", [
    (dict(target_modules=["linear_q"]), "model.lora.target_modules='linear_q': valid choices are "
                                        "['linear_qkv', 'linear_proj', 'linear_fc1', 'linear_fc2']"),
    (dict(target_modules=[]), "model.lora.target_modules=[]"),
    (dict(rank=0), "model.lora.rank=0: must be an integer > 0"),
    (dict(rank=-2), "model.lora.rank=-2"),
    (dict(alpha=0.0), "model.lora.alpha=0.0: must be > 0"),
    (dict(dropout=1.0), "model.lora.dropout=1.0: must be in [0, 1)"),
    (dict(dropout=-0.1), "model.lora.dropout=-0.1"),
])
def test_bad_lora_values_are_refused_naming_the_key(kwargs, message):
    with pytest.raises(ValueError) as err:
        LoRAConfig(enabled=True, **kwargs)
    assert message in str(err.value)


def test_bad_lora_value_is_refused_through_the_preset_loader():
    with pytest.raises(ValueError, match=r"model\.lora\.rank=0"):
        load_model_preset("tiny", lora={"enabled": True, "rank": 0})


def test_lora_off_keeps_the_fingerprint_and_on_changes_it():
    plain = ModelConfig(vocab_size=10)
    assert "lora" not in plain.fingerprint()
    on = ModelConfig(vocab_size=10, lora=LoRAConfig(enabled=True, rank=4))
    assert on.fingerprint()["lora"] == {"rank": 4, "alpha": 16.0, "target_modules": list(LORA_TARGET_MODULES)}
    assert ModelConfig(vocab_size=10, lora={"enabled": True}).lora.enabled  # from a dict (job files)


def _ids():
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(1, VOCAB, (2, 9), generator=g)
    return ids, torch.ones_like(ids)


def _build(dims, lora: bool, **lora_kw):
    from nemo_rlhf.models.actor_critic import build_model

    cfg = load_model_preset("tiny", vocab_size=VOCAB, value_head_init_std=0.02,
                            lora={"enabled": lora, "rank": 4, **lora_kw})
    return build_model(cfg, dims, "32", seed=3)


def _logits(model):
    from nemo_rlhf.models.engine import model_forward

    ids, mask = _ids()
    with torch.no_grad():
        logits, values = model_forward(model.eval(), ids, mask)
    return logits, values


def _randomise(model, seed=11):
    from nemo_rlhf.models.lora import adapters

    g = torch.Generator().manual_seed(seed)
    for a in adapters(model):
        a.load_full(torch.randn(a.lora_a.shape[0], a.in_full, generator=g) * 0.2,
                    torch.randn(a.out_full, a.lora_b.shape[1], generator=g) * 0.2)


def test_zero_b_gives_exactly_the_base_logits_and_adapters_sit_on_every_target(dims):
    from nemo_rlhf.models.lora import adapters

    base, adapted = _build(dims, False), _build(dims, True)
    names = [n for n, m in adapted.named_modules() if type(m).__name__ == "LoRAAdapter"]
    assert len(names) == 2 * 4  # tiny: 2 layers x 4 targets
    assert all((a.lora_b == 0).all() and a.lora_a.abs().sum() > 0 for a in adapters(adapted))
    lb, vb = _logits(base)
    la, va = _logits(adapted)
    assert torch.equal(lb, la) and torch.equal(vb, va)


def test_the_a_matrices_follow_the_runs_seed(dims):
    """``A`` is drawn from ``trainer.seed`` (``build_model``'s ``seed``) and the adapter's
    global name: two seeds give different A's on every adapter, the same seed the same, and
    the adapters of one model differ from each other."""
    from nemo_rlhf.models.actor_critic import build_model

    cfg = load_model_preset("tiny", vocab_size=VOCAB, lora={"enabled": True, "rank": 4})

    def a_of(seed):
        model = build_model(cfg, dims, "32", seed=seed)
        return {n: m.lora_a.detach().clone() for n, m in model.named_modules()
                if type(m).__name__ == "LoRAAdapter"}

    a3, a4, again = a_of(3), a_of(4), a_of(3)
    assert a3.keys() == a4.keys() and len(a3) == 8
    differ = [n for n in a3 if not torch.equal(a3[n], a4[n])]
    assert differ == list(a3), f"the same A under trainer.seed 3 and 4: {sorted(set(a3) - set(differ))}"
    assert all(torch.equal(a3[n], again[n]) for n in a3)
    first = next(iter(a3.values()))
    assert sum(torch.equal(first, a) for a in a3.values() if a.shape == first.shape) == 1


def test_adapters_change_the_logits_and_disabled_adapters_give_the_base_exactly(dims):
    from nemo_rlhf.models.lora import adapters_disabled

    base, adapted = _build(dims, False), _build(dims, True)
    _randomise(adapted)
    lb, _ = _logits(base)
    la, _ = _logits(adapted)
    assert (la - lb).abs().max() > 1e-3
    with adapters_disabled(adapted):
        ld, _ = _logits(adapted)
    assert torch.equal(ld, lb)
    assert torch.equal(_logits(adapted)[0], la)  # re-enabled on exit


def test_the_adapter_adds_scale_times_b_a_x_to_the_base_output(dims):
    model = _build(dims, True, alpha=8.0)
    layer = model.decoder.layers[0]
    for base, adapter in ((layer.self_attention.linear_qkv, layer.self_attention.linear_qkv_lora),
                          (layer.mlp.linear_fc2, layer.mlp.linear_fc2_lora)):
        torch.nn.init.normal_(adapter.lora_b)
        x = torch.randn(3, 2, base.weight.shape[1])
        with torch.no_grad():
            out, _ = base(x)
            adapter.enabled = False
            plain, _ = base(x)
            adapter.enabled = True
        want = plain + (8.0 / 4) * x @ adapter.lora_a.T @ adapter.lora_b.T
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)


def test_gradients_reach_only_adapters_and_value_head_and_the_optimizer_holds_nothing_else(dims):
    from nemo_rlhf.models.engine import model_forward, unwrap, wrap_ddp
    from nemo_rlhf.models.lora import is_adapter_param
    from nemo_rlhf.trainers.mixed_precision import MixedPrecisionOptimizer, OptimizerConfig

    model = _build(dims, True)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(is_adapter_param(n) or n.startswith("value_head.") for n in trainable)
    assert any(n.startswith("value_head.") for n in trainable)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    ddp = wrap_ddp(model)
    for n, p in unwrap(ddp).named_parameters():  # DDP: grad buffers for trainable params only
        assert (getattr(p, "main_grad", None) is not None) == (n in trainable), n
    opt = MixedPrecisionOptimizer(ddp, OptimizerConfig(lr=1e-2, warmup_steps=0))
    assert {n.removeprefix("module.") for n in opt.names} == trainable
    for _ in range(2):
        opt.zero_grad()
        ids, mask = _ids()
        logits, values = model_forward(ddp, ids, mask)
        (logits.float().log_softmax(-1)[..., 3].sum() + values.sum()).backward()
        for n, p in unwrap(ddp).named_parameters():
            assert p.grad is None or n in trainable, n
        opt.step()
    state_params = {id(p) for group in opt.optimizer.param_groups for p in group["params"]
                    if opt.optimizer.state.get(p)}
    assert len(state_params) == len(trainable)
    after = dict(unwrap(ddp).named_parameters())
    for n, p in after.items():
        if n in trainable:  # (A's first gradient is 0 through B=0; the second step moves it)
            assert not torch.equal(p, before[n]), n
        else:
            assert torch.equal(p, before[n]), n  # the frozen base, bit for bit


def test_merged_weight_is_w_plus_scale_b_a_and_the_base_weight_when_disabled(dims):
    from nemo_rlhf.models.lora import adapters_disabled, merged_weight

    model = _build(dims, True, alpha=8.0)
    _randomise(model)
    qkv = model.decoder.layers[0].self_attention.linear_qkv
    a = model.decoder.layers[0].self_attention.linear_qkv_lora
    want = qkv.weight + 2.0 * a.lora_b @ a.lora_a  # alpha 8 / rank 4
    torch.testing.assert_close(merged_weight(qkv), want, atol=1e-6, rtol=0)
    with adapters_disabled(model):
        assert torch.equal(merged_weight(qkv), qkv.weight)


def test_a_mixture_of_experts_model_with_lora_is_refused(dims):
    from nemo_rlhf.models.actor_critic import build_model

    cfg = load_model_preset("tiny", vocab_size=VOCAB, num_moe_experts=2, moe_router_topk=2,
                            moe_ffn_hidden_size=32, lora={"enabled": True, "rank": 2})
    with pytest.raises(ValueError, match=r"model\.lora\.enabled=true on a mixture-of-experts model"):
        build_model(cfg, dims, "32", seed=3)


def test_merge_adapters_and_the_peft_split_are_exact_on_full_tensors():
    """Full (layer-stacked) tensors: the merge adds scale * B A to each adapted weight, and the
    PEFT split gives q/k/v (gate/up) adapters whose B_x A are exactly those rows of B A."""
    from nemo_rlhf.models.hf_mapping import split_qkv
    from nemo_rlhf.models.lora_hf import adapter_keys, merge_adapters, peft_adapter, split_adapters

    cfg = load_model_preset("tiny", vocab_size=VOCAB)
    heads, groups, h, f = cfg.num_attention_heads, cfg.num_query_groups, cfg.hidden_size, cfg.ffn_hidden_size
    d = cfg.kv_channels or h // heads
    g = torch.Generator().manual_seed(0)
    L, r = cfg.num_layers, 3
    shapes = {"linear_qkv": ((heads + 2 * groups) * d, h), "linear_proj": (h, h),
              "linear_fc1": (2 * f, h), "linear_fc2": (h, f)}
    full = {}
    for target, (out, inp) in shapes.items():
        a_key, b_key, w_key = adapter_keys(target)
        full[w_key] = torch.randn(L, out, inp, generator=g)
        full[a_key] = torch.randn(L, r, inp, generator=g)
        full[b_key] = torch.randn(L, out, r, generator=g)
    base, adapters = split_adapters(full)
    assert set(adapters) == set(shapes) and not any("_lora" in k for k in base)
    merged = merge_adapters(base, adapters, 0.5)
    for target in shapes:
        a_key, b_key, w_key = adapter_keys(target)
        torch.testing.assert_close(merged[w_key], full[w_key] + 0.5 * full[b_key] @ full[a_key])
    tensors, config = peft_adapter(adapters, cfg, "llama", {"rank": r, "alpha": 6.0})
    assert config["r"] == r and config["lora_alpha"] == 6.0 and config["peft_type"] == "LORA"
    a_key, b_key, _ = adapter_keys("linear_qkv")
    delta = full[b_key][1] @ full[a_key][1]
    for name, rows in zip(("q_proj", "k_proj", "v_proj"), split_qkv(delta, heads, groups, d)):
        p = f"base_model.model.model.layers.1.self_attn.{name}"
        torch.testing.assert_close(tensors[p + ".lora_B.weight"] @ tensors[p + ".lora_A.weight"], rows)
    a_key, b_key, _ = adapter_keys("linear_fc1")
    gate, up = (full[b_key][0] @ full[a_key][0]).chunk(2)
    p = "base_model.model.model.layers.0.mlp."
    torch.testing.assert_close(tensors[p + "gate_proj.lora_B.weight"] @ tensors[p + "gate_proj.lora_A.weight"], gate)
    torch.testing.assert_close(tensors[p + "up_proj.lora_B.weight"] @ tensors[p + "up_proj.lora_A.weight"], up)
    with pytest.raises(ValueError, match="PEFT adapter export of 'gpt2'"):
        peft_adapter(adapters, cfg, "gpt2", {"rank": r, "alpha": 6.0})
