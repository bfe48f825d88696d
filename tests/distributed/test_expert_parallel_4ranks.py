"""Expert parallelism composed with TP and with PP, on 4 gloo ranks (one spawn): two PPO
steps of a tiny MoE model at TP=2 x EP=2 (DP=2) and at PP=2 x EP=2 (DP=2) against DP=4 at
EP=1, all from one initial checkpoint, greedy rollouts (the same samples in every layout).

At TP=2 x EP=2 the allgather dispatcher gathers over the TP x EP group (each token of a
DP replica arrives twice, the experts TP-sharded and EP-split:
nemo_rlhf.models.decode_layers.TensorParallelMoELayer); at PP=2 x EP=2 each stage's expert exchange
joins the two DP replicas' ranks of that stage.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.distributed.harness import run_ranks
from tests.distributed.test_expert_parallel import COMMON, COMPARED, initial_checkpoint, numbers
from tests.ppo_helpers import compose_ppo, make_demo_data

LAYOUTS = {"tp2_ep2": ("parallel.tensor_model_parallel_size=2", "parallel.expert_model_parallel_size=2"),
           "pp2_ep2": ("parallel.pipeline_model_parallel_size=2", "parallel.expert_model_parallel_size=2")}


def _worker(rank: int, tmp: str) -> dict:
    from nemo_rlhf.train_ppo import build

    tmp = Path(tmp)
    data = make_demo_data(tmp / "data")
    init = initial_checkpoint(data, tmp)
    out = {}
    for name, layout in {"dp4": (), **LAYOUTS}.items():
        t = build(compose_ppo(data, tmp / name, *COMMON, init, *layout))
        out[name] = [numbers(t.train_step()), numbers(t.train_step())]
        out[f"{name}_describe"] = t.dims.describe()
        t.close()
    return out


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return run_ranks(_worker, world_size=4, tmp=str(tmp_path_factory.mktemp("ep_4ranks")))


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_two_ppo_steps_equal_dp4_at_ep1(ranks, name):
    describe = ranks[0][f"{name}_describe"]
    assert describe["ep"] == 2 and describe["dp"] == 2
    assert describe["tp" if name.startswith("tp") else "pp"] == 2
    ref0 = ranks[0]["dp4"][0]
    assert ref0["grad_norm"] > 0 and ref0["reward_mean"] > 0  # the comparison is not vacuous
    for step, tol in ((0, 1e-5), (1, 1e-4)):
        ref = ranks[0]["dp4"][step]
        for rank, r in enumerate(ranks):
            got = r[name][step]
            for key in COMPARED:
                if key in got:  # a PP stage without the metric's source (the loss on the last)
                    assert abs(got[key] - ref[key]) <= tol * max(1.0, abs(ref[key])), \
                        f"{name} rank {rank} step {step + 1} {key}: {got[key]} vs DP=4 {ref[key]}"
    assert all(key in ranks[-1][name][0] for key in COMPARED)  # the last stage reports them all
