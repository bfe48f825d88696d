"""``rollout.engine=vllm`` under ``parallel.context_parallel_size=2`` (2 gloo ranks, one DP
replica) equals CP=1 with the vLLM engine (one rank) on two PPO steps within 1e-5, and the
refit sends the weights once per replica: CP rank 0 gathers and loads them (one all-gather
call and one ``reload_weights`` a weights version), CP rank 1 neither, and both CP ranks
end with CP rank 0's rollout (its broadcast).

One spawn per layout: CP=1 builds the model, saves it as the common start and runs its
two steps; CP=2 starts from that checkpoint. Sampled rollouts (T=1): vLLM's per-row seeds
come from the DP rank, which the CP ranks share, so CP=2 draws CP=1's tokens. The second
step's rollout is generated after an optimizer step, from the refit updated weights (the
refit counts and ``loaded_version`` check that it happened on CP rank 0 only).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.distributed.harness import run_ranks
from tests.ppo_helpers import compose_ppo, make_demo_data

TOL = 1e-5
# vLLM's CPU attention has no kernel for head dim 16 (the tiny preset's 64 / 4 heads)
TINY = ("model.num_attention_heads=2", "model.num_query_groups=2")
COMMON = (*TINY, "rollout.engine=vllm", "ppo.num_rollout_samples=8", "ppo.global_batch_size=8",
          "ppo.micro_batch_size=2", "ppo.forward_micro_batch_size=4", "ppo.ppo_epochs=1", "ppo.shuffle=false",
          "ppo.logprob_chunk_size=0", "ppo.entropy_coef=0.01", "kl.loss_coef=0.1", "rollout.temperature=1.0",
          "rollout.max_new_tokens=6", "reward.functions=[{name: 'tests.ppo_helpers:length_reward'}]",
          "optim.lr=1e-2", "model.value_head_init_std=0.05", "trainer.precision=32")
METRICS = ("policy_loss", "value_loss", "entropy", "kl_mean", "kl_loss", "approx_kl", "clip_fraction",
           "grad_norm", "returns_mean", "advantages_mean", "reward_mean", "response_length",
           "rollout_train_logprob_diff_max", "rollout_train_k3_kl")


def _run(rank: int, tmp: str, cp: int) -> dict:
    import nemo_rlhf.rollout.vllm_engine as ve
    from nemo_rlhf.checkpoint import save_checkpoint
    from nemo_rlhf.train_ppo import build

    tmp = Path(tmp)
    data = make_demo_data(tmp / "data")
    start = [] if cp == 1 else [f"exp_manager.init_from={tmp}/init/step_0"]
    trainer = build(compose_ppo(data, tmp / f"cp{cp}", *COMMON, *start,
                                f"parallel.context_parallel_size={cp}"))
    if cp == 1:
        save_checkpoint(tmp / "init", 0, trainer.model, dims=trainer.dims)
    engine = trainer.rollout_source.engine
    calls = {"gather": 0, "reload_weights": 0}
    gather, rpc = ve.gather_full_tensors, engine.llm.collective_rpc

    def counted_gather(*args, **kwargs):
        calls["gather"] += 1
        return gather(*args, **kwargs)

    def counted_rpc(method, *args, **kwargs):
        calls[method] = calls.get(method, 0) + 1
        return rpc(method, *args, **kwargs)

    ve.gather_full_tensors, engine.llm.collective_rpc = counted_gather, counted_rpc
    batches, forward = [], trainer.compute_old_and_reference

    def recorded(batch):  # the step's rollout, as the trainer's forward passes get it
        batches.append({"input_ids": batch.input_ids.cpu(), "logprobs": batch.logprobs.cpu(),
                        "response_mask": batch.response_mask.cpu()})
        return forward(batch)

    trainer.compute_old_and_reference = recorded
    out = {"metrics": [], "layout": (trainer.dims.cp, trainer.dims.cp_rank, trainer.dims.dp)}
    for _ in range(2):
        out["metrics"].append({k: float(v) for k, v in trainer.train_step().items()
                               if isinstance(v, (int, float))})
        trainer.step += 1
    out.update(batches=batches, calls=calls, refits=engine.refits, skipped=engine.skipped_refits,
               loaded_version=engine.loaded_version)
    trainer.close()
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("vllm_cp"))
    ref = run_ranks(_run, world_size=1, tmp=tmp, cp=1)[0]
    cp = run_ranks(_run, world_size=2, tmp=tmp, cp=2)
    return ref, cp


def test_every_cp_rank_gets_cp1s_rollout(results):
    ref, cp = results
    assert ref["layout"] == (1, 0, 1) and [r["layout"] for r in cp] == [(2, 0, 1), (2, 1, 1)]
    assert len(ref["batches"]) == 2 and all(len(r["batches"]) == 2 for r in cp)
    for step, want in enumerate(ref["batches"]):
        for r in cp:
            got = r["batches"][step]
            assert torch.equal(got["input_ids"], want["input_ids"]), step
            assert torch.equal(got["response_mask"], want["response_mask"]), step
            assert torch.equal(got["logprobs"], cp[0]["batches"][step]["logprobs"])  # CP rank 0's, broadcast
            torch.testing.assert_close(got["logprobs"], want["logprobs"], atol=TOL, rtol=0)
        assert want["response_mask"].sum() > 8  # sampled responses, not all one token


@pytest.mark.parametrize("step", [0, 1])
@pytest.mark.parametrize("key", METRICS)
def test_step_metrics_equal_cp1(results, key, step):
    ref, cp = results
    want, got = ref["metrics"][step][key], cp[0]["metrics"][step][key]  # rank 0 reports
    assert abs(got - want) <= TOL * max(1.0, abs(want)), f"step {step + 1} {key}: CP=2 {got} vs CP=1 {want}"


def test_the_compared_metrics_are_not_vacuous(results):
    first, second = results[0]["metrics"]
    assert first["value_loss"] > 0 and first["entropy"] > 0 and first["grad_norm"] > 0
    assert second["kl_loss"] > 0  # the first step's actor is the reference
    # both steps' rollouts come from the actor's current weights (the second's refit after
    # the update, lr 1e-2): vLLM's log-probs are the training forward's (the vLLM suite's 1e-4)
    for ref_or_cp in (results[0], results[1][0]):
        assert all(m["rollout_train_logprob_diff_max"] < 1e-4 for m in ref_or_cp["metrics"])


def test_the_refit_sends_the_weights_once_per_replica(results):
    """Two steps, two weights versions: CP=1's rank and CP=2's CP rank 0 gather and load
    each once; CP rank 1 gathers and loads nothing (its engine is never used)."""
    ref, cp = results
    assert ref["refits"] == 2 and ref["calls"]["gather"] == 2 and ref["calls"]["reload_weights"] == 2
    rank0, rank1 = cp
    assert rank0["refits"] == 2 and rank0["calls"]["gather"] == 2 and rank0["calls"]["reload_weights"] == 2
    assert rank0["loaded_version"] == ref["loaded_version"] is not None
    assert rank1["refits"] == 0 and rank1["calls"]["gather"] == 0 and rank1["calls"].get("reload_weights", 0) == 0
    assert rank1["loaded_version"] is None
    assert cp[0]["metrics"][1]["rollout/refits"] == 2.0  # the reported count is CP rank 0's
