"""``trainer.deterministic=true`` (#52): a short PPO run (1 rank, 2 steps, sampled rollouts)
repeated with the same seed in the same process gives bit-identical metrics and weights,
with torch's deterministic algorithms, megatron's ``deterministic_mode`` and the cuBLAS /
NCCL / Transformer Engine variables on."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from tests.distributed.harness import run_ranks
from tests.ppo_helpers import compose_ppo, make_demo_data

COMMON = ("reward.functions=[{name: 'tests.ppo_helpers:length_reward'}]", "optim.lr=1e-3",
          "rollout.temperature=0.7", "trainer.deterministic=true")
VOLATILE = ("timing/", "_per_s")  # wall-clock timers: not part of the run's numbers


def _twice(rank: int, tmp: str) -> dict:
    from nemo_rlhf.models.engine import unwrap
    from nemo_rlhf.train_ppo import build

    tmp = Path(tmp)
    data = make_demo_data(tmp / "data")
    runs = []
    for name in ("first", "again"):
        trainer = build(compose_ppo(data, tmp / name, *COMMON))
        metrics = [{k: v for k, v in trainer.train_step().items() if not any(p in k for p in VOLATILE)}
                   for _ in range(2)]
        core = unwrap(trainer.model)
        runs.append({"metrics": metrics,
                     "params": {n: p.detach().clone() for n, p in core.named_parameters()},
                     "megatron_deterministic": core.config.deterministic_mode})
    flags = {"torch": torch.are_deterministic_algorithms_enabled(),
             "torch_warn_only": torch.is_deterministic_algorithms_warn_only_enabled(),
             "env": {k: os.environ.get(k) for k in ("CUBLAS_WORKSPACE_CONFIG", "NCCL_ALGO",
                                                    "NVTE_ALLOW_NONDETERMINISTIC_ALGO")}}
    return {"runs": runs, "flags": flags}


def test_a_ppo_run_repeated_in_deterministic_mode_is_bit_identical(tmp_path):
    res = run_ranks(_twice, world_size=1, tmp=str(tmp_path))[0]
    assert res["flags"] == {"torch": True, "torch_warn_only": False,
                            "env": {"CUBLAS_WORKSPACE_CONFIG": ":4096:8", "NCCL_ALGO": "Ring",
                                    "NVTE_ALLOW_NONDETERMINISTIC_ALGO": "0"}}
    first, again = res["runs"]
    assert first["megatron_deterministic"] and again["megatron_deterministic"]
    assert len(first["metrics"]) == 2 and first["metrics"][0]["grad_norm"] > 0  # it trained
    for step, (a, b) in enumerate(zip(first["metrics"], again["metrics"])):
        assert a.keys() == b.keys()
        differ = {k: (a[k], b[k]) for k in a if a[k] != b[k]}
        assert not differ, f"step {step + 1}: {differ}"  # exact equality, not a tolerance
    assert first["params"].keys() == again["params"].keys()
    changed = [n for n, p in first["params"].items() if not torch.equal(p, again["params"][n])]
    assert not changed, changed
