"""Train-rollout mismatch of a tiny MoE with and without routing replay (R3, issue #52).

The rollout engine stands in for an inference engine with other numerics: the megatron
KV-cache decode over a copy of the policy whose weights are rounded to bfloat16 (kept in
float32, so the code path is the same), recording each token's top-k experts
(:class:`nemo_rlhf.models.routing_replay.RoutingReplay`). The training forward is the float32
policy, once with its own routing and once replaying the rollout's routes. Printed per batch
and overall: the share of (position, layer) routes (real prompt and response positions) that differ between the two passes, mean and
max |logp_train - logp_rollout| and the mean k3 KL
(:func:`~nemo_rlhf.algorithms.ppo.rollout_correction.rollout_train_k3`) over response tokens.

    PYTHONPATH=$PWD python benchmarks/bench_routing_replay.py [--batches 3] [--rows 16]

Model: the ``tiny`` preset as a Qwen3-MoE-like MoE (4 experts, top-2, q/k norms, routers
re-drawn N(0, 1) so the top-2 differs by token, as in ``tests/unit/models/test_moe_decode.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

VOCAB = 100
MOE = dict(vocab_size=VOCAB, init_method_std=0.1, qk_layernorm=True, kv_channels=24, num_moe_experts=4,
           moe_router_topk=2, moe_ffn_hidden_size=32)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, default=3)
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=24)
    ap.add_argument("--pre-softmax", action="store_true", help="model.moe_router_pre_softmax=true")
    args = ap.parse_args()
    warnings.filterwarnings("ignore")

    from nemo_rlhf.algorithms.ppo.rollout_correction import rollout_train_k3
    from nemo_rlhf.models.actor_critic import build_model
    from nemo_rlhf.models.config import load_model_preset
    from nemo_rlhf.models.engine import model_forward
    from nemo_rlhf.models.logprobs import response_logprobs
    from nemo_rlhf.models.routing_replay import RoutingReplay, moe_routers
    from nemo_rlhf.rollout import RolloutConfig, generate
    from tests.single_rank import random_prompts, single_rank

    with single_rank(seed=0) as dims, torch.no_grad():
        cfg = load_model_preset("tiny", **MOE, moe_router_pre_softmax=args.pre_softmax)
        policy, engine = build_model(cfg, dims, seed=11), build_model(cfg, dims, seed=11)
        for layer in policy.decoder.layers:
            layer.mlp.router.weight.normal_(0.0, 1.0, generator=torch.Generator().manual_seed(3))
        policy.eval()
        engine.load_state_dict(policy.state_dict())
        for p in engine.parameters():  # the "inference engine": bf16-rounded weights
            p.copy_(p.to(torch.bfloat16).float())
        engine.eval()
        L, k = len(moe_routers(policy)), cfg.moe_router_topk
        rows = []
        for i in range(args.batches):
            rc = RolloutConfig(max_new_tokens=args.max_new_tokens, temperature=1.0, seed=i)
            g = torch.Generator().manual_seed(100 + i)
            lengths = torch.randint(3, 12, (args.rows,), generator=g).tolist()
            with RoutingReplay(engine, "record") as rr:
                b = generate(engine, dims, random_prompts(lengths, VOCAB, seed=i), rc, eos_token_id=VOCAB - 1,
                             pad_token_id=0, vocab_size=VOCAB, max_sequence_length=64, call_index=i)
            rec = rr.routes()
            B, T = b.input_ids.shape
            routes = torch.cat([rec, torch.full((B, T - rec.shape[1], L, k), -1, dtype=torch.long)], dim=1)
            own = {}
            hooks = [r.register_forward_hook(lambda m, a, o, j=j: own.__setitem__(j, o[1]))
                     for j, r in enumerate(moe_routers(policy))]
            logits, _ = model_forward(policy, b.input_ids, b.attention_mask)
            for h in hooks:
                h.remove()
            plain, _ = response_logprobs(logits, b, dims, rc.logprob_temperature)
            with RoutingReplay(policy, "replay", routes):
                logits, _ = model_forward(policy, b.input_ids, b.attention_mask)
            replayed, _ = response_logprobs(logits, b, dims, rc.logprob_temperature)
            # routes of the real positions fed to the rollout (prompt and response, 0 .. T-2)
            # that the plain training forward chooses differently
            mask, real = b.response_mask, b.attention_mask[:, :T - 1].bool()
            differ = 0
            for j in range(L):
                m = own[j].view(T, B, -1).transpose(0, 1)[:, :T - 1]
                mine = torch.zeros_like(m).scatter_(-1, rec[:, :, j, :], True)
                differ += int(((m != mine).any(-1) & real).sum())
            row = {"batch": i, "tokens": int(mask.sum()), "routes_differ_frac": differ / (L * int(real.sum()))}
            for name, lp in (("without_replay", plain), ("with_replay", replayed)):
                d = (lp - b.logprobs).abs()[mask]
                row[name] = {"mean_abs_dlogp": float(d.mean()), "max_abs_dlogp": float(d.max()),
                             "k3_mean": float(rollout_train_k3(lp, b.logprobs, mask)[mask].mean())}
            rows.append(row)
            print(json.dumps(row))
        total = sum(r["tokens"] for r in rows)
        summary = {"tokens": total, "routes_differ_frac": sum(r["routes_differ_frac"] * r["tokens"] for r in rows) / total}
        for name in ("without_replay", "with_replay"):
            summary[name] = {key: (max if key.startswith("max") else
                                   lambda xs: sum(xs) / total)([r[name][key] * (1 if key.startswith("max") else r["tokens"])
                                                                for r in rows])
                             for key in ("mean_abs_dlogp", "max_abs_dlogp", "k3_mean")}
        print(json.dumps({"summary": summary}))


if __name__ == "__main__":
    main()
