"""The real-model presets have the shapes of the published HF configs: each preset equals
what ``nemo-rlhf-ckpt import-hf`` derives from that model's ``config.json`` (the numbers
below are the config files' own)."""

from __future__ import annotations

from dataclasses import asdict

import pytest

from nemo_rlhf.distributed.parallel import ParallelConfig, validate_parallel_layout
from nemo_rlhf.models.config import load_model_preset
from nemo_rlhf.tools.hf_convert import model_config_from_hf

LLAMA3 = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "attention_bias": False,
          "hidden_act": "silu", "initializer_range": 0.02, "max_position_embeddings": 8192,
          "rms_norm_eps": 1e-05, "rope_scaling": None, "rope_theta": 500000.0,
          "tie_word_embeddings": False, "vocab_size": 128256, "num_key_value_heads": 8}
HF_CONFIGS = {
    "llama3_8b": {**LLAMA3, "hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32,
                  "num_hidden_layers": 32},
    "llama3_70b": {**LLAMA3, "hidden_size": 8192, "intermediate_size": 28672, "num_attention_heads": 64,
                   "num_hidden_layers": 80},
    "llama3_1_8b": {**LLAMA3, "hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32,
                    "num_hidden_layers": 32, "max_position_embeddings": 131072,
                    "rope_scaling": {"factor": 8.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                                     "original_max_position_embeddings": 8192, "rope_type": "llama3"}},
    "qwen2_5_7b": {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "hidden_act": "silu",
                   "hidden_size": 3584, "initializer_range": 0.02, "intermediate_size": 18944,
                   "max_position_embeddings": 32768, "num_attention_heads": 28, "num_hidden_layers": 28,
                   "num_key_value_heads": 4, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
                   "sliding_window": 131072, "tie_word_embeddings": False, "use_sliding_window": False,
                   "vocab_size": 152064},
}
QWEN3_0_6B = {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "attention_bias": False,
              "head_dim": 128, "hidden_act": "silu", "hidden_size": 1024, "initializer_range": 0.02,
              "intermediate_size": 3072, "max_position_embeddings": 40960, "max_window_layers": 28,
              "num_attention_heads": 16, "num_hidden_layers": 28, "num_key_value_heads": 8,
              "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000, "sliding_window": None,
              "tie_word_embeddings": True, "use_sliding_window": False, "vocab_size": 151936}
HF_CONFIGS["qwen3_0_6b"] = QWEN3_0_6B
for _preset, _h, _ffn, _layers, _heads, _tied in (("qwen3_1_7b", 2048, 6144, 28, 16, True),
                                                  ("qwen3_4b", 2560, 9728, 36, 32, True),
                                                  ("qwen3_8b", 4096, 12288, 36, 32, False),
                                                  ("qwen3_14b", 5120, 17408, 40, 40, False),
                                                  ("qwen3_32b", 5120, 25600, 64, 64, False)):
    HF_CONFIGS[_preset] = {**QWEN3_0_6B, "hidden_size": _h, "intermediate_size": _ffn, "num_hidden_layers": _layers,
                           "max_window_layers": _layers, "num_attention_heads": _heads,
                           "tie_word_embeddings": _tied}
HF_CONFIGS["qwen3_30b_a3b"] = {**QWEN3_0_6B, "model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"],
                               "hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 48,
                               "max_window_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4,
                               "tie_word_embeddings": False, "decoder_sparse_step": 1, "mlp_only_layers": [],
                               "moe_intermediate_size": 768, "norm_topk_prob": True, "num_experts": 128,
                               "num_experts_per_tok": 8, "output_router_logits": False,
                               "router_aux_loss_coef": 0.001}
LLAMA3_2 = {**LLAMA3, "max_position_embeddings": 131072, "tie_word_embeddings": True, "intermediate_size": 8192,
            "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                             "original_max_position_embeddings": 8192, "rope_type": "llama3"}}
HF_CONFIGS["llama3_2_1b"] = {**LLAMA3_2, "hidden_size": 2048, "head_dim": 64, "num_attention_heads": 32,
                             "num_hidden_layers": 16}
HF_CONFIGS["llama3_2_3b"] = {**LLAMA3_2, "hidden_size": 3072, "head_dim": 128, "num_attention_heads": 24,
                             "num_hidden_layers": 28}
PARAMS_B = {"llama3_8b": 8.03, "llama3_1_8b": 8.03, "llama3_70b": 70.55, "qwen2_5_7b": 7.62, "qwen3_0_6b": 0.60,
            "llama3_2_1b": 1.23, "llama3_2_3b": 3.21}  # the model cards' counts
QWEN3_CARDS = {"qwen3_0_6b": ("0.6", "0.44"), "qwen3_1_7b": ("1.7", "1.4"), "qwen3_4b": ("4.0", "3.6"),
               "qwen3_8b": ("8.2", "6.95"), "qwen3_14b": ("14.8", "13.2"), "qwen3_32b": ("32.8", "31.2"),
               "qwen3_30b_a3b": ("30.5", "29.9")}
"""The Qwen3 model cards' "Number of Parameters" and "Number of Parameters (Non-Embedding)",
in billions, as printed: to one decimal (6.95 to two), so a count is checked at the printed
precision (it must round to the printed figure), both of them."""


QWEN3_MOE_ACTIVATED_B = {"qwen3_30b_a3b": 3.3}
"""The Qwen3-MoE model cards' activated parameters, in billions, as printed (truncated: the
count, embeddings included, is 3.353 B for Qwen3-30B-A3B)."""


def _parameter_counts(c, activated: bool = False) -> tuple[int, int]:
    """(total, non-embedding) parameters of a decoder preset: per layer the attention
    (QKV and output projections, QKV biases, q/k norms), the SwiGLU MLP (3 matrices; a
    mixture of experts: every expert's, or with ``activated`` the ``moe_router_topk`` a
    token runs, and the router) and two norms; the final norm; the embedding, and the output
    layer unless tied (non-embedding leaves both out)."""
    d = c.kv_channels or c.hidden_size // c.num_attention_heads
    attn = c.hidden_size * d * (c.num_attention_heads + 2 * c.num_query_groups) \
        + c.num_attention_heads * d * c.hidden_size
    if c.add_qkv_bias:
        attn += d * (c.num_attention_heads + 2 * c.num_query_groups)
    if c.qk_layernorm:
        attn += 2 * d
    if c.num_moe_experts:
        experts = c.moe_router_topk if activated else c.num_moe_experts
        mlp = experts * 3 * c.hidden_size * c.moe_ffn_hidden_size + c.num_moe_experts * c.hidden_size
    else:
        mlp = 3 * c.hidden_size * c.ffn_hidden_size
    layer = attn + mlp + 2 * c.hidden_size
    embeddings = (1 if c.share_embeddings_and_output_weights else 2) * c.vocab_size * c.hidden_size
    body = c.num_layers * layer + c.hidden_size
    return body + embeddings, body


@pytest.mark.parametrize("preset", sorted(HF_CONFIGS))
def test_preset_equals_the_import_of_the_hf_config(preset):
    cfg = load_model_preset(preset)
    derived, _ = model_config_from_hf(HF_CONFIGS[preset], cfg.name)
    assert asdict(cfg) == asdict(derived)


@pytest.mark.parametrize("preset", sorted(PARAMS_B))
def test_preset_parameter_count_matches_the_model_card(preset):
    total, _ = _parameter_counts(load_model_preset(preset))
    assert total / 1e9 == pytest.approx(PARAMS_B[preset], abs=0.01)


@pytest.mark.parametrize("preset", sorted(QWEN3_CARDS))
def test_qwen3_total_and_non_embedding_counts_round_to_the_model_cards(preset):
    total, body = _parameter_counts(load_model_preset(preset))
    for count, printed in zip((total, body), QWEN3_CARDS[preset]):
        decimals = len(printed.split(".")[1])
        assert f"{count / 1e9:.{decimals}f}" == printed, (preset, count, printed)


@pytest.mark.parametrize("preset", sorted(QWEN3_MOE_ACTIVATED_B))
def test_qwen3_moe_activated_count_is_the_model_cards(preset):
    activated, _ = _parameter_counts(load_model_preset(preset), activated=True)
    printed = QWEN3_MOE_ACTIVATED_B[preset]
    assert printed <= activated / 1e9 < printed + 0.1


def test_every_hf_config_has_a_model_card_count():
    assert set(HF_CONFIGS) <= set(PARAMS_B) | set(QWEN3_CARDS)


def test_llama3_8b_on_a_node_of_8_gpus_takes_tp_8():
    cfg = load_model_preset("llama3_8b")
    layout = ParallelConfig(tensor_model_parallel_size=8)
    assert validate_parallel_layout(layout, 16, num_layers=cfg.num_layers,
                                    num_attention_heads=cfg.num_attention_heads,
                                    num_query_groups=cfg.num_query_groups) == 2


@pytest.mark.parametrize("scaling, message", [
    ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768},
     r"rope_type 'yarn' is not supported; supported: \['default', 'llama3'\]"),
    ({"type": "linear", "factor": 2.0}, r"rope_type 'linear' is not supported"),
    ({"type": "dynamic", "factor": 2.0}, r"rope_type 'dynamic' is not supported"),
    ({"rope_type": "llama3", "factor": 8.0}, r"rope_type 'llama3' needs \['low_freq_factor', "
                                             r"'high_freq_factor', 'original_max_position_embeddings'\]"),
])
def test_rope_scaling_other_than_llama3_is_refused_naming_it(scaling, message):
    with pytest.raises(ValueError, match=message):
        model_config_from_hf({**HF_CONFIGS["llama3_1_8b"], "rope_scaling": scaling}, "x")


def test_default_rope_scaling_imports_as_none_and_keeps_the_old_fingerprint():
    plain, _ = model_config_from_hf({**HF_CONFIGS["llama3_8b"], "rope_scaling": {"rope_type": "default"}}, "x")
    assert plain.rope_scaling is None and "rope_scaling" not in plain.fingerprint()
    scaled = load_model_preset("llama3_1_8b")
    assert scaled.fingerprint()["rope_scaling"] == "llama3" and scaled.fingerprint()["rope_scaling_factor"] == 8.0


def test_rope_scaling_config_is_checked():
    from nemo_rlhf.models.config import ModelConfig

    with pytest.raises(ValueError, match=r"model.rope_scaling='yarn': valid choices are \[None, 'llama3'\]"):
        ModelConfig(rope_scaling="yarn")
    with pytest.raises(ValueError, match=r"needs model.position_embedding_type=rope"):
        ModelConfig(rope_scaling="llama3", position_embedding_type="learned_absolute")
    with pytest.raises(ValueError, match=r"rope_low_freq_factor=4.0 < rope_high_freq_factor=1.0"):
        ModelConfig(rope_scaling="llama3", rope_low_freq_factor=4.0, rope_high_freq_factor=1.0)


def test_mistral_imports_as_llama_shapes_and_a_binding_sliding_window_is_refused():
    mistral = {**HF_CONFIGS["llama3_8b"], "model_type": "mistral", "max_position_embeddings": 32768,
               "rope_theta": 1000000.0, "vocab_size": 32768, "sliding_window": None}
    cfg, arch = model_config_from_hf(mistral, "mistral-7b-v0.3")
    assert arch == "mistral" and not cfg.add_bias_linear and not cfg.add_qkv_bias and cfg.rotary_base == 1000000
    with pytest.raises(ValueError, match=r"sliding_window=4096 \(< max_position_embeddings=32768\): "
                                         r"sliding-window attention is not supported"):
        model_config_from_hf({**mistral, "sliding_window": 4096}, "mistral-7b-v0.1")
    cfg, _ = model_config_from_hf({**mistral, "sliding_window": 32768}, "x")  # never binds
    assert cfg.max_position_embeddings == 32768


@pytest.mark.parametrize("preset", ["llama3_8b", "llama3_1_8b", "qwen2_5_7b"])
def test_transformers_5_rope_parameters_import_like_rope_theta_and_rope_scaling(preset):
    """transformers >= 5 saves ``rope_parameters`` (theta inside) and no ``rope_theta`` /
    ``rope_scaling``: the same model (a default theta would be silently wrong)."""
    old = HF_CONFIGS[preset]
    new = {k: v for k, v in old.items() if k not in ("rope_theta", "rope_scaling")}
    new["rope_parameters"] = {"rope_theta": old["rope_theta"], "rope_type": "default", **(old.get("rope_scaling") or {})}
    assert asdict(model_config_from_hf(new, "x")[0]) == asdict(model_config_from_hf(old, "x")[0])
    assert model_config_from_hf(new, "x")[0].rotary_base == int(old["rope_theta"])


def test_qwen3_imports_with_query_key_norms_and_its_own_head_size():
    qwen3 = QWEN3_0_6B
    cfg, arch = model_config_from_hf(qwen3, "qwen3-0.6b")
    assert arch == "qwen3" and cfg.qk_layernorm and cfg.kv_channels == 128 and not cfg.add_qkv_bias
    assert cfg.share_embeddings_and_output_weights and cfg.fingerprint()["qk_layernorm"] is True
    with pytest.raises(ValueError, match="attention_bias=true"):
        model_config_from_hf({**qwen3, "attention_bias": True}, "x")
    with pytest.raises(ValueError, match="use_sliding_window=true"):
        model_config_from_hf({**qwen3, "use_sliding_window": True}, "x")
    assert "qk_layernorm" not in load_model_preset("llama3_8b").fingerprint()
