"""SFT/RM speak PPO's ``exp_manager`` vocabulary: ``save_interval``, ``keep_last`` (0, the
default: every checkpoint kept) and ``resume`` = ``auto`` | ``none`` | a checkpoint path;
and run PPO's loop: a signal ends the run after the step with a checkpoint and code 42."""

from __future__ import annotations

from tests.distributed.harness import run_ranks


def _worker(rank: int, data: str, exp: str):
    from nemo_rlhf.checkpoint import list_checkpoints
    from nemo_rlhf.data.datasets import DataConfig
    from nemo_rlhf.models.config import load_model_preset
    from nemo_rlhf.trainers.supervised import SupervisedExpManagerConfig, SupervisedTrainerConfig
    from nemo_rlhf.trainers.mixed_precision import OptimizerConfig
    from nemo_rlhf.trainers.rm import RMRunConfig, RMTrainer

    def cfg(run: str, max_steps: int, **exp_manager):
        return RMRunConfig(
            model=load_model_preset("tiny"), optim=OptimizerConfig(lr=1e-3),
            data=DataConfig(train_file=f"{data}/preference.jsonl", tokenizer_dir=f"{data}/tokenizer",
                            max_seq_length=16),
            trainer=SupervisedTrainerConfig(max_steps=max_steps, global_batch_size=4, micro_batch_size=4),
            exp_manager=SupervisedExpManagerConfig(exp_dir=f"{exp}/{run}", tensorboard=False, **exp_manager))

    def steps(run: str) -> list[int]:
        return [s for s, _, ok in list_checkpoints(f"{exp}/{run}/checkpoints") if ok]

    out = {}
    RMTrainer(cfg("all", 3, save_interval=1)).fit()
    out["all"] = steps("all")
    RMTrainer(cfg("pruned", 3, save_interval=1, keep_last=2)).fit()
    out["pruned"] = steps("pruned")
    out["auto"] = RMTrainer(cfg("all", 4)).step
    out["none"] = RMTrainer(cfg("all", 4, resume="none")).step
    out["path"] = RMTrainer(cfg("other", 4, resume=f"{exp}/all/checkpoints/step_1")).step
    # SIGUSR1 (Slurm's pre-timeout signal) as the PPO job takes it: finish the step, save, 42
    signalled = RMTrainer(cfg("signal", 5))
    signalled.signals.received = "SIGUSR1"
    signalled.fit()
    out["signal"] = (signalled.exit_code, signalled.step, steps("signal"))
    resumed = RMTrainer(cfg("signal", 5))
    out["signal_resumed"] = (resumed.step, resumed.sampler.consumed_samples)
    return out


def test_save_interval_keep_last_and_the_three_resume_modes(tmp_path):
    from nemo_rlhf.tasks.precedence import DemoTaskConfig, make_demo_dataset

    data = tmp_path / "data"
    make_demo_dataset(data, DemoTaskConfig(n_sft=8, n_pref=16, n_ppo=4, n_eval=4, n_val=8))
    out = run_ranks(_worker, world_size=1, data=str(data), exp=str(tmp_path / "exp"))[0]
    assert out["all"] == [1, 2, 3]  # every save_interval step and the end, none deleted
    assert out["pruned"] == [2, 3]
    assert (out["auto"], out["none"], out["path"]) == (3, 0, 1)
    assert out["signal"] == (42, 1, [1])  # one step, saved, the requeue code
    assert out["signal_resumed"] == (1, 4)  # continues after the 4 examples of step 1
