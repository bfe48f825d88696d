"""``parallel.context_parallel_size`` composes from the command line into every job's
schema, and the jobs it is not wired into refuse it before any process group exists."""

from __future__ import annotations

import pytest

from tests.conf_helpers import typed_job


def test_ppo_trainer_refuses_cp_naming_the_key():
    from nemo_rlhf.train_ppo import build

    cfg = typed_job("ppo_tiny", ["parallel.context_parallel_size=2"])
    assert cfg.parallel.context_parallel_size == 2
    with pytest.raises(ValueError, match=r"parallel\.context_parallel_size=2 in the PPO trainer: context "
                                         r"parallelism is not wired into the PPO trainer yet"):
        build(cfg)


@pytest.mark.parametrize("job", ["sft_tiny", "rm_tiny"])
def test_supervised_setup_refuses_cp_naming_the_key(job):
    from nemo_rlhf.trainers.common import setup_run

    cfg = typed_job(job, ["parallel.context_parallel_size=2"])
    with pytest.raises(ValueError, match=r"parallel\.context_parallel_size=2 in the SFT / RM trainer or "
                                         r"evaluate job: context parallelism is not wired"):
        setup_run(cfg.parallel, cfg.model, None, 0)
