"""Model FLOPs (nemo_rlhf.metrics.flops) against hand-computed values and published forms."""

from __future__ import annotations

import pytest

from nemo_rlhf.metrics.flops import (
    decode_flops,
    forward_flops,
    layer_matmul_flops_per_token,
    ppo_step_flops,
)
from nemo_rlhf.models.config import ModelConfig, load_model_preset


def _tiny():
    # conf/model/tiny.yaml: 2 layers, hidden 64, 4 heads of 16, 2 KV groups, SwiGLU ffn 128;
    # vocab 17 padded to 128
    return load_model_preset("tiny", vocab_size=17)


def test_tiny_layer_forward_and_ppo_step_by_hand():
    cfg = _tiny()
    assert cfg.padded_vocab_size == 128
    # per token and layer: QKV 64*(64 + 2*2*16) = 8192, out 64*64 = 4096,
    # SwiGLU gate + up + down 3*64*128 = 24576; x2 FLOPs per multiply-add
    assert layer_matmul_flops_per_token(cfg) == 2 * (8192 + 4096 + 24576) == 73_728
    # B=2, S=10: matmuls 20 tokens * 2 layers * 73728 = 2,949,120
    #            attention 2 seqs * 2 layers * 4 * 64 * 10^2 = 102,400
    #            output layer 20 * 2 * 64 * 128 = 327,680; value head 20 * 2 * 64 = 2,560
    assert forward_flops(cfg, 2, 10) == 2_949_120 + 102_400 + 327_680 == 3_379_200
    assert forward_flops(cfg, 2, 10, value_head=True) == 3_381_760
    assert forward_flops(cfg, 2, 10, logits=False) == 2_949_120 + 102_400
    # rollout B=2, P=4, R=3: prefill 8 tokens without logits (1,179,648 + 2*2*4*64*16 =
    # 16,384) + last-position logits 2 * 2*64*128 = 32,768 -> 1,228,800; then 2 decode
    # steps per row of 2*73728 + 2*64*128 = 163,840 each, attending to 5 and 6 keys:
    # 2 layers * 4 * 64 * (5 + 6) = 5,632 per row -> 2 * (2*163,840 + 5,632) = 666,624
    assert decode_flops(cfg, 2, 4, 3) == 1_228_800 + 666_624 == 1_895_424
    step = ppo_step_flops(cfg, batch=2, prompt_len=4, response_len=6, ppo_epochs=2)
    assert step.old_logprobs_values == 3_381_760
    assert step.reference_logprobs == 3_379_200
    assert step.train == 3 * 2 * 3_381_760 == 20_290_560  # forward + backward = 3 forwards
    assert step.rollout == decode_flops(cfg, 2, 4, 6)
    assert step.to_dict()["total"] == step.rollout + 3_381_760 + 3_379_200 + 20_290_560


def test_decode_equals_a_token_by_token_sum():
    cfg = _tiny()
    L, h, V, q = cfg.num_layers, cfg.hidden_size, cfg.padded_vocab_size, 64
    B, P, R = 3, 5, 4
    total = B * P * L * layer_matmul_flops_per_token(cfg) + B * L * 4 * q * P * P  # prefill
    total += B * 2 * h * V  # logits of the prefill's last position: response token 1
    for t in range(1, R):  # response tokens 2..R: one fed token, cache of P + t keys
        total += B * (L * layer_matmul_flops_per_token(cfg) + L * 4 * q * (P + t) + 2 * h * V)
    assert decode_flops(cfg, B, P, R) == total
    assert decode_flops(cfg, B, P, 0) == 0
    assert decode_flops(cfg, B, P, 1) == forward_flops(cfg, B, P, logits=False) + B * 2 * h * V


def test_training_flops_match_narayanan_et_al_closed_form():
    """Standard attention, GELU MLP of 4h: 3 forwards = 72 B S L h^2 (1 + S/(6h) + V/(12 L h))."""
    cfg = ModelConfig(name="mha", num_layers=4, hidden_size=128, num_attention_heads=8,
                      ffn_hidden_size=512, vocab_size=1000, activation="gelu")
    B, S, L, h, V = 3, 32, 4, 128, cfg.padded_vocab_size
    closed = 72 * B * S * L * h * h + 12 * B * L * h * S * S + 6 * B * S * h * V
    assert 3 * forward_flops(cfg, B, S) == closed


def test_smollm2_is_about_six_n_per_training_token():
    cfg = load_model_preset("smollm2_135m")
    n_matmul = cfg.num_layers * layer_matmul_flops_per_token(cfg) // 2 + cfg.hidden_size * cfg.padded_vocab_size
    assert 130e6 < n_matmul < 140e6  # SmolLM2-135M: 134.5M parameters incl. the tied embedding
    # PaLM: 6N + 12 L (a d) T per training token; T = 1 here
    q = cfg.num_attention_heads * (cfg.hidden_size // cfg.num_attention_heads)
    assert 3 * forward_flops(cfg, 1, 1) == 6 * n_matmul + 12 * cfg.num_layers * q


def test_vocabulary_must_be_known():
    with pytest.raises(ValueError, match="model.vocab_size is not set"):
        forward_flops(load_model_preset("tiny"), 1, 4)


def test_a_moe_layer_counts_the_experts_a_token_runs_and_its_router():
    cfg = load_model_preset("tiny", vocab_size=17, num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32)
    # attention as the dense tiny's, 2 * (8192 + 4096) = 24,576; MLP: 2 of the 4 SwiGLU
    # experts, 2 * 3*64*32 = 12,288, and the router 64*4 = 256; x2 -> 25,088
    assert layer_matmul_flops_per_token(cfg) == 24_576 + 2 * (12_288 + 256) == 49_664
    dense = _tiny()
    # the expert count changes the router's share only
    wider = load_model_preset("tiny", vocab_size=17, num_moe_experts=8, moe_router_topk=2, moe_ffn_hidden_size=32)
    assert layer_matmul_flops_per_token(wider) - layer_matmul_flops_per_token(cfg) == 2 * 64 * 4
    assert forward_flops(cfg, 2, 10) - forward_flops(dense, 2, 10) == 20 * 2 * (49_664 - 73_728)


def test_qwen3_30b_a3b_counts_its_activated_parameters():
    """Per token, 2 FLOPs per activated weight of the matrix products: the model card's
    3.3B activated parameters less the input embedding (a lookup, no FLOPs)."""
    cfg = load_model_preset("qwen3_30b_a3b")
    per_token = cfg.num_layers * layer_matmul_flops_per_token(cfg) + 2 * cfg.hidden_size * cfg.padded_vocab_size
    activated = per_token / 2 + cfg.vocab_size * cfg.hidden_size  # + the input embedding
    assert 3.3e9 <= activated < 3.4e9
    assert per_token / 2 == pytest.approx(3.04e9, rel=0.005)
