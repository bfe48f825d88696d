"""The PPO trainer at ``parallel.context_parallel_size=2`` composed with DP=2, with TP=2
and with PP=2, and packed (``ppo.sequence_packing``) with TP=2 and with PP=2 (4 gloo ranks,
one spawn for the five layouts) equals one padded rank at CP=1 on
its first step within 1e-5: the losses, KL, entropy and grad norm, every parameter's
gradient (TP shards compared with the matching slice of the whole one, a pipeline stage's
layers with the whole model's of the same number) and the updated weights. Greedy
rollouts: DP ranks draw the same tokens as one rank (the sampling seed is per DP rank).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.distributed.harness import run_ranks
from tests.ppo_helpers import compose_ppo, make_demo_data

TOL = 1e-5
COMMON = ("rollout.greedy=true", "ppo.num_rollout_samples=8", "ppo.global_batch_size=8",
          "ppo.micro_batch_size=2", "ppo.forward_micro_batch_size=2", "ppo.ppo_epochs=1",
          "ppo.shuffle=false", "ppo.logprob_chunk_size=0", "ppo.entropy_coef=0.01", "kl.loss_coef=0.1",
          "rollout.max_new_tokens=6", "reward.functions=[{name: 'tests.ppo_helpers:length_reward'}]",
          "optim.lr=1e-3", "model.value_head_init_std=0.05")
METRICS = ("policy_loss", "value_loss", "entropy", "kl_mean", "approx_kl", "clip_fraction", "grad_norm",
           "returns_mean", "reward_mean", "response_length")
LAYOUTS = {"cp2_dp2": (2, 1, 1), "cp2_tp2": (2, 2, 1), "cp2_pp2": (2, 1, 2),  # name -> (CP, TP, PP)
           "cp2_tp2_packed": (2, 2, 1), "cp2_pp2_packed": (2, 1, 2)}
PACKED = ("ppo.max_tokens_per_micro_batch=64", "ppo.sequence_packing=true", "ppo.packed_row_length=32")
"""The ``*_packed`` layouts: packed micro-batches (megatron's THD layout under CP) against
the padded one-rank run (packed == padded)."""


def _step(trainer) -> dict:
    from nemo_rlhf.models.engine import unwrap

    rec, step = {}, trainer.optimizer.step

    def opt_step(*args, **kwargs):
        rec.setdefault("grads", {n: p.main_grad.detach().float().cpu().clone()
                                 for n, p in unwrap(trainer.model).named_parameters()})
        return step(*args, **kwargs)

    trainer.optimizer.step = opt_step
    import nemo_rlhf.trainers.ppo.micro_batches as mbs

    take, rec["packed"] = mbs.take, 0

    def counting_take(*args, **kwargs):  # the training micro-batches that ran packed
        mb = take(*args, **kwargs)
        rec["packed"] += "packed" in mb
        return mb

    mbs.take = counting_take
    try:
        rec["metrics"] = trainer.train_step()
    finally:
        mbs.take = take
    rec["weights"] = {n: p.detach().float().cpu().clone() for n, p in unwrap(trainer.model).named_parameters()}
    rec["tp"] = {n: (getattr(p, "partition_dim", -1) if getattr(p, "tensor_model_parallel", False) else -1)
                 for n, p in unwrap(trainer.model).named_parameters()}
    rec["glu"] = bool(unwrap(trainer.model).config.gated_linear_unit)
    d = trainer.dims
    rec["layout"] = {"cp": d.cp, "tp": d.tp, "pp": d.pp, "dp": d.dp, "tp_rank": d.tp_rank}
    if d.pp > 1:  # a stage's layers are numbered from 0: the whole model's names
        offset = d.pp_rank * unwrap(trainer.model).config.num_layers // d.pp
        for key in ("grads", "weights", "tp"):
            rec[key] = {_global_name(n, offset): v for n, v in rec[key].items()}
    return rec


def _global_name(name: str, offset: int) -> str:
    """``decoder.layers.<i>.…`` of a pipeline stage as the whole model's ``<i + offset>``."""
    parts = name.split(".")
    if parts[:2] == ["decoder", "layers"]:
        parts[2] = str(int(parts[2]) + offset)
    return ".".join(parts)


def _reference(rank: int, tmp: str):
    from nemo_rlhf.checkpoint import save_checkpoint
    from nemo_rlhf.train_ppo import build

    tmp = Path(tmp)
    data = make_demo_data(tmp / "data")
    trainer = build(compose_ppo(data, tmp / "ref", *COMMON))
    save_checkpoint(tmp / "init", 0, trainer.model, dims=trainer.dims)
    return _step(trainer)


def _layouts(rank: int, tmp: str):
    from nemo_rlhf.train_ppo import build

    tmp = Path(tmp)
    data = make_demo_data(tmp / "data")
    out = {}
    for name, (cp, tp, pp) in LAYOUTS.items():
        trainer = build(compose_ppo(data, tmp / name, *COMMON, f"exp_manager.init_from={tmp}/init/step_0",
                                    f"parallel.context_parallel_size={cp}",
                                    f"parallel.tensor_model_parallel_size={tp}",
                                    f"parallel.pipeline_model_parallel_size={pp}",
                                    *(PACKED if name.endswith("_packed") else ())))
        out[name] = _step(trainer)
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("ppo_cp4"))
    ref = run_ranks(_reference, world_size=1, tmp=tmp)[0]
    return ref, run_ranks(_layouts, world_size=4, tmp=tmp)


def _whole_slice(whole: torch.Tensor, part: torch.Tensor, dim: int, tp_rank: int, glu: bool) -> torch.Tensor:
    """The slice of the whole (TP=1) tensor that TP rank ``tp_rank`` holds along ``dim``; a
    gated MLP's fused ``linear_fc1`` holds its rank's share of the gate and of the up half."""
    if dim < 0 or part.shape == whole.shape:
        return whole
    if glu:
        tp = whole.shape[dim] // part.shape[dim]
        return torch.cat([h.chunk(tp, dim)[tp_rank] for h in whole.chunk(2, dim)], dim)
    n = part.shape[dim]
    return whole.narrow(dim, tp_rank * n, n)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout(results, layout):
    _, par = results
    cp, tp, pp = LAYOUTS[layout]
    got = [r[layout]["layout"] for r in par]
    assert {(g["cp"], g["tp"], g["pp"], g["dp"]) for g in got} == {(cp, tp, pp, 4 // cp // tp // pp)}
    packed = [r[layout]["packed"] for r in par]
    assert all(packed) if layout.endswith("_packed") else not any(packed), packed


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("key", METRICS)
def test_first_step_metrics_equal_cp1(results, layout, key):
    ref, par = results
    want, got = ref["metrics"][key], par[0][layout]["metrics"][key]  # rank 0 reports
    assert abs(got - want) <= TOL * max(1.0, abs(want)), f"{layout} {key}: {got} vs CP=1 {want}"


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_gradients_and_updated_weights_equal_cp1(results, layout):
    ref, par = results
    for r in par:
        got = r[layout]
        tp_rank = got["layout"]["tp_rank"]
        if got["layout"]["pp"] == 1:
            assert set(got["grads"]) == set(ref["grads"])
        else:  # a stage's parameters (the last stage's copy of a tied embedding aside)
            assert any(".layers." in n for n in got["grads"]) and set(got["grads"]) - set(ref["grads"]) <= {
                "output_layer.weight"}
        for name, g in ref["grads"].items():
            if name not in got["grads"]:
                continue
            dim, glu = got["tp"][name], got["glu"] and "linear_fc1" in name
            torch.testing.assert_close(got["grads"][name], _whole_slice(g, got["grads"][name], dim, tp_rank, glu),
                                       atol=TOL, rtol=0, msg=f"{layout} {name}")
            w = ref["weights"][name]
            torch.testing.assert_close(got["weights"][name], _whole_slice(w, got["weights"][name], dim, tp_rank, glu),
                                       atol=TOL, rtol=0, msg=f"{layout} {name}")
    assert ref["metrics"]["grad_norm"] > 0 and ref["metrics"]["value_loss"] > 0
