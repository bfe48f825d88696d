"""LoRA under TP=2 on 2 gloo ranks equals one rank: the A matrices drawn at build (from
the run's seed and each layer's global index) are the TP=1 ones, sliced at TP=2 and by
global layer at PP=2; with the same full (random) adapter weights the logits and values
agree within 1e-5 (fp32), every adapter's gradient is this rank's shard of the TP=1
gradient, and the frozen base has no gradient.

PPO with LoRA from a base checkpoint at DP=2, TP=2 and PP=2 against one rank (the 2-rank
checks share one spawn, the reference has its own): the first step's metrics within 1e-5, the second's within 1e-4, and the
one-rank run's step-2 checkpoint (adapters and head on the hashed base) resumed in each
layout gives the one-rank run's third step."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from tests.distributed.harness import run_ranks

VOCAB = 100


def _batch():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (3, 10), generator=g)
    mask = torch.ones_like(ids)
    mask[2, :3] = 0  # left padding
    return ids, mask


def _full_adapters(model) -> dict:
    """Random full (TP=1) ``(A, B)`` per adapter name, the same on every rank and layout."""
    from nemo_rlhf.models.lora import adapters

    g = torch.Generator().manual_seed(21)
    out = {}
    for name, a in sorted((n, m) for n, m in model.named_modules() if m in set(adapters(model))):
        out[name] = (torch.randn(a.lora_a.shape[0], a.in_full, generator=g) * 0.3,
                     torch.randn(a.out_full, a.lora_b.shape[1], generator=g) * 0.3)
    return out


def _run(model, dims, ids, mask):
    """Forward (full logits, values) and one backward of the tokens' log-probs + values; adapter grads by module name."""
    from nemo_rlhf.models.engine import model_forward
    from nemo_rlhf.models.lora import adapters
    from nemo_rlhf.models.vocab_parallel import gather_vocab_parallel, vocab_parallel_logprobs

    full = _full_adapters(model)
    mods = dict(model.named_modules())
    for name, (a, b) in full.items():
        mods[name].load_full(a, b)
    logits, values = model_forward(model, ids, mask)
    logits_full = gather_vocab_parallel(logits, dims.tp_group)
    lp, _ = vocab_parallel_logprobs(logits[:, :-1], ids[:, 1:], dims.tp_group, dims.tp_rank, 1.0, VOCAB)
    (lp.sum() + values.sum()).backward()  # (the loss through the TP-aware log-probs)
    grads = {n: (m.lora_a.grad.clone(), m.lora_b.grad.clone()) for n, m in mods.items()
             if m in set(adapters(model))}
    base_grads = [n for n, p in model.named_parameters()
                  if p.grad is not None and "_lora." not in n and not n.startswith("value_head.")]
    return {"logits": logits_full.detach(), "values": values.detach(), "grads": grads,
            "base_grads": base_grads}


def _built_a(model) -> dict:
    """Each adapter's ``A`` as drawn at build, by its global name (a PP stage's local layer
    index replaced by the layer's global one)."""
    from nemo_rlhf.models.lora import adapters, global_module_name

    return {global_module_name(model, n): m.lora_a.detach().clone() for n, m in model.named_modules()
            if m in set(adapters(model))}


def _worker(rank: int):
    from nemo_rlhf.distributed import ParallelConfig, initialize_distributed
    from nemo_rlhf.models.actor_critic import build_model
    from nemo_rlhf.models.config import load_model_preset

    cfg = load_model_preset("tiny", vocab_size=VOCAB, value_head_init_std=0.05,
                            lora={"enabled": True, "rank": 4, "alpha": 8.0})
    ids, mask = _batch()
    out = {}
    dims = initialize_distributed(ParallelConfig(), seed=3, num_layers=cfg.num_layers)
    model = build_model(cfg, dims, seed=11).eval()
    a_tp1 = _built_a(model)
    out["tp1"] = _run(model, dims, ids, mask)
    dims = initialize_distributed(ParallelConfig(tensor_model_parallel_size=2), seed=3)
    model = build_model(cfg, dims, seed=11).eval()
    mods = dict(model.named_modules())
    # the built A at TP=2 against this rank's slice of the TP=1 one (B: a placeholder)
    out["a_tp2"] = {n: (a, mods[n].shard_of(a_tp1[n], torch.zeros(mods[n].out_full, 4))[0])
                    for n, a in _built_a(model).items()}
    out["tp2"] = _run(model, dims, ids, mask)
    # this rank's shards of the TP=1 gradients
    out["tp1_grad_shards"] = {n: mods[n].shard_of(*g) for n, g in out["tp1"]["grads"].items()}
    out["sharded"] = {n: (tuple(m.lora_a.shape), tuple(m.lora_b.shape), m.column)
                      for n, m in mods.items() if n in out["tp1"]["grads"]}
    # PP=2: each stage draws its layers' A as the one-stage model did (global layer index)
    dims = initialize_distributed(ParallelConfig(pipeline_model_parallel_size=2), seed=3,
                                  num_layers=cfg.num_layers)
    out["a_pp2"] = {n: (a, a_tp1.get(n)) for n, a in _built_a(build_model(cfg, dims, seed=11)).items()}
    out["a_tp1_names"] = sorted(a_tp1)
    return out


@pytest.fixture(scope="module")
def spawned(tmp_path_factory):
    """One 1-rank spawn (the PPO reference) and one 2-rank spawn (the TP=2 parity checks,
    then the PPO layouts): ``(reference, per-rank results)``."""
    tmp = str(tmp_path_factory.mktemp("lora_ppo_par"))
    ref = run_ranks(_ppo_reference, world_size=1, tmp=tmp)[0]
    return ref, run_ranks(_both, world_size=2, tmp=tmp)


def _both(rank: int, tmp: str):
    return {"tp": _worker(rank), "ppo": _ppo_layouts(rank, tmp)}


@pytest.fixture(scope="module")
def results(spawned):
    return [r["tp"] for r in spawned[1]]


def test_the_built_a_matrices_are_the_one_rank_ones_at_tp2_and_pp2(results):
    """The same ``trainer.seed`` (``build_model``'s seed) gives the same full A at TP=1,
    TP=2 (column linears: A replicated; row linears: A sliced along the input) and PP=2
    (each stage its own layers, drawn by their global index)."""
    pp_names = set()
    for r in results:
        assert len(r["a_tp1_names"]) == 8 and r["a_tp2"].keys() == set(r["a_tp1_names"])
        for n, (got, want) in r["a_tp2"].items():
            assert torch.equal(got, want), f"TP=2 {n}"
        assert r["a_pp2"] and len(r["a_pp2"]) == 4  # tiny: 2 layers, 1 a stage, 4 targets each
        for n, (got, want) in r["a_pp2"].items():
            assert want is not None and torch.equal(got, want), f"PP=2 {n}"
        pp_names |= set(r["a_pp2"])
    assert pp_names == set(results[0]["a_tp1_names"])  # the two stages hold every layer once


def test_tp2_lora_forward_equals_tp1_with_the_same_full_adapters(results):
    for r in results:
        assert (r["tp1"]["logits"] - r["tp1"]["logits"].mean()).abs().max() > 0
        for key in ("logits", "values"):
            torch.testing.assert_close(r["tp2"][key], r["tp1"][key], atol=1e-5, rtol=0, msg=key)


def test_tp2_adapter_gradients_are_the_shards_of_the_tp1_gradients(results):
    for r in results:
        assert r["tp2"]["grads"].keys() == r["tp1_grad_shards"].keys() and r["tp2"]["grads"]
        for n, (ga, gb) in r["tp2"]["grads"].items():
            wa, wb = r["tp1_grad_shards"][n]
            assert wb.abs().sum() > 0, n
            # fp32 sums in another order: the error is relative to the tensor's scale
            # (measured <= 5e-6 of its max), not to each (possibly near-zero) element
            for key, got, want in (("lora_a", ga, wa), ("lora_b", gb, wb)):
                tol = 2e-5 * want.abs().max().item()
                torch.testing.assert_close(got, want, atol=tol, rtol=0, msg=f"{n}.{key}")


def test_tp2_shards_b_of_column_and_a_of_row_linears_and_the_base_gets_no_grad(results):
    for r in results:
        assert r["tp1"]["base_grads"] == [] and r["tp2"]["grads"] and r["tp2"]["base_grads"] == []
        for n, (a_shape, b_shape, column) in r["sharded"].items():
            a1, b1 = r["tp1"]["grads"][n]
            if column:  # A [r, in] replicated, B [out/2, r]
                assert a_shape == tuple(a1.shape) and b_shape == (b1.shape[0] // 2, b1.shape[1]), n
            else:  # A [r, in/2], B [out, r] replicated
                assert a_shape == (a1.shape[0], a1.shape[1] // 2) and b_shape == tuple(b1.shape), n


# ---- PPO with LoRA under DP=2, TP=2 and PP=2 against one rank (two more spawns) ----------

PPO_COMPARED = ("reward_mean", "response_length", "kl_mean", "policy_loss", "value_loss", "entropy",
                "approx_kl", "clip_fraction", "grad_norm", "returns_mean")
# greedy rollouts, one mini-batch per step: every layout trains on the same samples
PPO_COMMON = ("rollout.greedy=true", "ppo.num_rollout_samples=8", "ppo.global_batch_size=8",
              "ppo.micro_batch_size=2", "ppo.forward_micro_batch_size=2", "ppo.ppo_epochs=1",
              "ppo.shuffle=false", "reward.functions=[{name: 'tests.ppo_helpers:length_reward'}]",
              "optim.lr=1e-2", "trainer.precision=32", "critic.mode=shared",
              "model.lora.enabled=true", "model.lora.rank=4", "model.lora.alpha=8",
              "exp_manager.init_value_head=true", "exp_manager.save_interval=1", "exp_manager.keep_last=5")
LAYOUTS = {"dp2": (1, 1), "tp2": (2, 1), "pp2": (1, 2)}


def _ppo_reference(rank: int, tmp: str):
    """The base checkpoint (the tiny model's initial weights), then LoRA PPO on one rank:
    three steps, a checkpoint after each."""
    from nemo_rlhf.checkpoint import save_checkpoint
    from nemo_rlhf.train_ppo import build
    from tests.ppo_helpers import compose_ppo, make_demo_data

    tmp = Path(tmp)
    data = make_demo_data(tmp / "data")
    t0 = build(compose_ppo(data, tmp / "base_exp", *PPO_COMMON[:-6]))
    save_checkpoint(tmp / "base", 0, t0.model, config=t0.run_config, dims=t0.dims)
    t0.close()
    trainer = build(compose_ppo(data, tmp / "ref", *PPO_COMMON, f"exp_manager.init_from={tmp}/base/step_0",
                                "trainer.max_steps=3"))
    out = []
    for _ in range(3):
        out.append(trainer.train_step())
        trainer.step += 1  # (what the loop does)
        trainer.save()
    trainer.close()
    return out


def _ppo_layouts(rank: int, tmp: str):
    """Each layout: two steps from the base; then the reference's step-2 checkpoint (TP=1)
    resumed in that layout for its third step."""
    from nemo_rlhf.train_ppo import build
    from tests.ppo_helpers import compose_ppo, make_demo_data

    tmp = Path(tmp)
    data = make_demo_data(tmp / "data")
    out = {}
    for name, (tp, pp) in LAYOUTS.items():
        layout = (f"exp_manager.init_from={tmp}/base/step_0", f"parallel.tensor_model_parallel_size={tp}",
                  f"parallel.pipeline_model_parallel_size={pp}")
        trainer = build(compose_ppo(data, tmp / name, *PPO_COMMON, *layout))
        out[name] = []
        for _ in range(2):
            out[name].append(trainer.train_step())
            trainer.step += 1
        trainer.close()
        resumed = tmp / f"{name}_resumed"
        if rank == 0:
            shutil.copytree(tmp / "ref" / "checkpoints", resumed / "checkpoints",
                            ignore=shutil.ignore_patterns("step_3"))
            (resumed / "checkpoints" / "latest").write_text("step_2\n")
        torch.distributed.barrier()
        trainer = build(compose_ppo(data, resumed, *PPO_COMMON, *layout, "exp_manager.resume=auto",
                                    "trainer.max_steps=3"))
        trainer.resume()
        out[f"{name}_resumed_at"] = trainer.step
        out[f"{name}_step3"] = trainer.train_step()
        trainer.close()
    return out


@pytest.fixture(scope="module")
def ppo_results(spawned):
    ref, ranks = spawned
    return ref, ranks[0]["ppo"]  # rank 0 reports


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_lora_ppo_first_step_metrics_match_one_rank_within_1e5(ppo_results, layout):
    """B starts at 0, so the first step's forward is the base's in every layout; its
    grad_norm is the adapters' gradient, which needs the same A in every layout (a PP stage
    drawing A by its local layer index fails it)."""
    ref, par = ppo_results
    assert ref[0]["grad_norm"] > 0 and ref[0]["reward_mean"] > 0  # not vacuous
    for key in PPO_COMPARED:
        a, b = par[layout][0][key], ref[0][key]
        assert abs(a - b) <= 1e-5 * max(1.0, abs(b)), f"{layout} {key}: {a} vs one rank {b}"
    # the second step runs the adapted model (B != 0): the same within fp32 reduction order
    assert ref[1]["policy_loss"] != ref[0]["policy_loss"]
    for key in PPO_COMPARED:
        a, b = par[layout][1][key], ref[1][key]
        assert abs(a - b) <= 1e-4 * max(1.0, abs(b)), f"{layout} step 2 {key}: {a} vs one rank {b}"


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_lora_checkpoint_from_one_rank_resumes_resharded_with_the_same_next_step(ppo_results, layout):
    ref, par = ppo_results
    assert par[f"{layout}_resumed_at"] == 2
    for key in PPO_COMPARED:
        a, b = par[f"{layout}_step3"][key], ref[2][key]
        assert abs(a - b) <= 1e-4 * max(1.0, abs(b)), f"{layout} step 3 {key}: {a} vs one rank {b}"
