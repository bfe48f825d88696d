"""A tiny RM job's config for the tests that run RMTrainer in-process."""

from __future__ import annotations


def tiny_rm_config(data: str, exp: str, val_check_interval: int, checkpoints: bool, **rm):
    """``RMRunConfig`` of 3 steps of 4 pairs on the demo task's files under ``data``
    (``make_demo_dataset``), logging to ``exp``; ``rm`` are :class:`RMConfig` fields.
    ``checkpoints``: save at the end (step 3), else no checkpoint."""
    from nemo_rlhf.data.datasets import DataConfig
    from nemo_rlhf.distributed import ParallelConfig
    from nemo_rlhf.models.config import load_model_preset
    from nemo_rlhf.trainers.mixed_precision import OptimizerConfig
    from nemo_rlhf.trainers.rm import RMConfig, RMRunConfig
    from nemo_rlhf.trainers.supervised import SupervisedExpManagerConfig, SupervisedTrainerConfig

    em = (SupervisedExpManagerConfig(exp_dir=exp, resume="none", save_interval=3) if checkpoints
          else SupervisedExpManagerConfig(exp_dir=exp, resume="none", checkpoints=False))
    return RMRunConfig(
        model=load_model_preset("tiny", value_head_init_std=0.05), parallel=ParallelConfig(),
        optim=OptimizerConfig(lr=1e-3),
        data=DataConfig(train_file=f"{data}/preference.jsonl", val_file=f"{data}/preference_val.jsonl",
                        tokenizer_dir=f"{data}/tokenizer", max_seq_length=16),
        trainer=SupervisedTrainerConfig(max_steps=3, global_batch_size=4, micro_batch_size=4,
                                        val_check_interval=val_check_interval,
                                        log_every_n_steps=1 if checkpoints else 5),
        rm=RMConfig(**rm), exp_manager=em)
