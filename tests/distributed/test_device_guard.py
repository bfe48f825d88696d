"""The device guard (NEMO_RLHF_DEVICE_GUARD=1) on 2 gloo ranks, one spawn for every check.

Under the guard ``dims.device`` is an emulated accelerator: a host tensor meeting a device
tensor, or a host tensor handed to a backend without gloo, fails as it would on CUDA. The
PPO step at TP=1 (DP=2), TP=2, PP=2 and, for a MoE actor, EP=2 with evaluation and both
reference modes, the SFT and RM steps run clean; two planted mistakes (the rollout's move to the device removed, the
backend map replaced by plain NCCL) fail naming the place.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from tests.distributed.harness import run_ranks
from tests.ppo_helpers import compose_ppo, make_demo_data

pytestmark = pytest.mark.skipif(torch.cuda.is_available(),
                                reason="the guard emulates a device on CPU-only machines")

PPO = ("reward.functions=[{name: 'tests.ppo_helpers:length_reward'}]", "optim.lr=1e-3",
       "trainer.val_check_interval=1", "ppo.ppo_epochs=1")
LAYOUTS = {"tp1_dp2": (1, 1, "offload"), "tp2": (2, 1, "offload"), "pp2": (1, 2, "colocated"),
           "tp2_budget_tis": (2, 1, "offload"), "moe_ep2_budget": (1, 1, "offload")}
EXTRA = {"tp2_budget_tis": ("ppo.max_tokens_per_micro_batch=40", "ppo.rollout_is_cap=2.0",
                            "ppo.rollout_mask_threshold=5.0", "rollout.max_new_tokens=8",
                            "rollout.stop_token_ids=[3,4,5]"),
         # expert parallelism: token counts, micro-batch counts and decode stops agreed over
         # the EP group with device tensors
         "moe_ep2_budget": ("model.num_moe_experts=4", "model.moe_router_topk=2", "model.moe_ffn_hidden_size=32",
                            "parallel.expert_model_parallel_size=2", "ppo.max_tokens_per_micro_batch=40",
                            "rollout.max_new_tokens=8", "rollout.stop_token_ids=[3,4,5]")}


def _catch(fn) -> str:
    from nemo_rlhf.distributed.device_guard import DeviceMixError

    try:
        fn()
    except DeviceMixError as exc:
        return str(exc)
    return ""


def _ppo_steps(cfg, steps: int = 2) -> dict:
    from nemo_rlhf.train_ppo import build

    tr = build(cfg)
    metrics = []
    for _ in range(steps):
        metrics.append(tr.train_step())
        tr.step += 1
    return {"device": str(tr.dims.device), "metrics": metrics, "eval": tr.evaluate()}


def _ops(device) -> dict:
    """Single-op behaviour of the guard (what CUDA allows and refuses)."""
    dev = torch.ones(4, device=device)
    host = torch.ones(4)
    out = {
        "mix": _catch(lambda: dev + host),
        "scalar_ok": not _catch(lambda: dev * torch.tensor(2.0)),
        "index_ok": not _catch(lambda: dev[torch.tensor([0, 2])]),
        "moved_ok": not _catch(lambda: dev + host.to(device)),
        "device_attr": str(dev.device), "moved_attr": str(host.to(device).device),
        "host_after_cpu": _catch(lambda: dev.cpu() + dev),
        "generator": _catch(lambda: torch.rand(3, generator=torch.Generator(device=device))),
        "host_into": _catch(lambda: torch.zeros(()).add_(dev.sum())),
    }
    return out


def _worker(rank: int, tmp: str):
    os.environ["NEMO_RLHF_DEVICE_GUARD"] = "1"
    from nemo_rlhf.distributed import device_guard

    tmp = Path(tmp)
    data = make_demo_data(tmp / "data")
    out = {}
    for name, (tp, pp, ref) in LAYOUTS.items():
        cfg = compose_ppo(data, tmp / name, *PPO, f"parallel.tensor_model_parallel_size={tp}",
                          f"parallel.pipeline_model_parallel_size={pp}", f"reference.mode={ref}",
                          *EXTRA.get(name, ()))
        out[name] = _ppo_steps(cfg)
    out["guard_active"] = device_guard.is_active()
    out["ops"] = _ops(device_guard.EMULATED_DEVICE)

    # SFT and RM steps (validation included) at TP=2 and PP=2
    from nemo_rlhf.tasks.precedence import DemoTaskConfig, make_demo_dataset
    from nemo_rlhf.trainers.rm import RMTrainer
    from nemo_rlhf.trainers.sft import SFTTrainer
    from tests.distributed.test_sft_rm_parallel import _configs

    sft_data = tmp / "sft_data"
    if rank == 0:
        make_demo_dataset(sft_data, DemoTaskConfig(seed=0, n_sft=16, n_pref=16, n_ppo=8, n_eval=8,
                                                   n_val=4))
    torch.distributed.barrier()
    for kind, cls in (("sft", SFTTrainer), ("rm", RMTrainer)):
        for layout, (tp, pp) in (("tp2", (2, 1)), ("pp2", (1, 2))):
            cfg = _configs(kind, sft_data, tmp / f"{kind}_{layout}", tp, pp)
            cfg.trainer.max_steps = 1
            final = cls(cfg).fit()
            out[f"{kind}_{layout}"] = {k: v for k, v in final.items() if isinstance(v, float)}

    # planted mistake 1: the rollout's move of the prompts to the device removed
    import importlib

    gen = importlib.import_module("nemo_rlhf.rollout.generate")  # the package exports generate()

    moved = gen.to_device
    gen.to_device = lambda obj, device, non_blocking=True: obj
    try:
        cfg = compose_ppo(data, tmp / "plant_move", *PPO)
        out["plant_move"] = _catch(lambda: _ppo_steps(cfg, 1))
    finally:
        gen.to_device = moved
    # planted mistake 2: plain NCCL instead of the device -> backend map
    import nemo_rlhf.distributed.parallel as par

    resolve = par.resolve_backend
    par.resolve_backend = lambda backend, cuda: "nccl" if cuda else resolve(backend, cuda)
    try:
        cfg = compose_ppo(data, tmp / "plant_backend", *PPO,
                          "parallel.tensor_model_parallel_size=2")
        out["plant_backend"] = _catch(lambda: _ppo_steps(cfg, 1))
    finally:
        par.resolve_backend = resolve
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_ranks(_worker, world_size=2, tmp=str(tmp_path_factory.mktemp("guard")))


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_ppo_step_evaluation_and_reference_run_clean_under_the_guard(results, layout):
    for r in results:
        assert r["guard_active"]
        got = r[layout]
        assert got["device"] == "cpu:0"  # the emulated accelerator, not the host
        assert len(got["metrics"]) == 2
        assert all(torch.isfinite(torch.tensor(m["grad_norm"])) for m in got["metrics"])
        assert "eval/reward" in got["eval"]
    assert any(m["grad_norm"] > 0 for r in results for m in r[layout]["metrics"])


@pytest.mark.parametrize("step", ["sft_tp2", "sft_pp2", "rm_tp2", "rm_pp2"])
def test_sft_and_rm_steps_run_clean_under_the_guard(results, step):
    assert results[0][step]


def test_guard_refuses_what_cuda_refuses_and_allows_what_it_allows(results):
    ops = results[0]["ops"]
    assert "add" in ops["mix"] and "test_device_guard.py" in ops["mix"]
    assert ops["scalar_ok"] and ops["index_ok"] and ops["moved_ok"]
    assert ops["device_attr"] == "cpu:0" and ops["moved_attr"] == "cpu:0"
    assert ops["host_after_cpu"]  # .cpu() makes a host tensor again
    assert "generator" in ops["generator"]
    assert "host tensor" in ops["host_into"]


def test_planted_missing_move_to_device_fails_naming_the_place(results):
    for r in results:
        msg = r["plant_move"]
        assert "host tensor" in msg and "rollout/generate.py" in msg, msg


def test_planted_nccl_only_backend_fails_on_a_host_collective_naming_the_place(results):
    for r in results:
        msg = r["plant_backend"]
        assert "torch.distributed." in msg and "'nccl'" in msg and "nemo_rlhf/" in msg, msg
