"""SFT and RM with LoRA (the same ``model.lora`` keys as PPO), one spawn: from a base
checkpoint only the adapters and the head train, the checkpoints hold those and name the
base (path, content hash, and the hash in the resume fingerprint), a resume restores the
adapters bit for bit, and a LoRA run from an adapters-only checkpoint is refused."""

from __future__ import annotations

import pytest

from tests.distributed.harness import run_ranks


def _worker(rank: int, data: str, exp: str):
    import torch
    from megatron.core import dist_checkpointing

    from nemo_rlhf.checkpoint import CheckpointError, read_metadata
    from nemo_rlhf.data.datasets import DataConfig
    from nemo_rlhf.models.config import load_model_preset
    from nemo_rlhf.trainers.mixed_precision import OptimizerConfig
    from nemo_rlhf.trainers.rm import RMConfig, RMRunConfig, RMTrainer
    from nemo_rlhf.trainers.sft import SFTConfig, SFTRunConfig, SFTTrainer
    from nemo_rlhf.trainers.supervised import SupervisedExpManagerConfig, SupervisedTrainerConfig

    lora = {"enabled": True, "rank": 2, "alpha": 4.0}

    def common(run: str, max_steps: int, lora_on: bool, train: str, **exp_manager):
        return dict(
            model=load_model_preset("tiny", **({"lora": lora} if lora_on else {})),
            optim=OptimizerConfig(lr=1e-2),
            data=DataConfig(train_file=f"{data}/{train}", tokenizer_dir=f"{data}/tokenizer",
                            max_seq_length=16),
            trainer=SupervisedTrainerConfig(max_steps=max_steps, global_batch_size=4, micro_batch_size=4),
            exp_manager=SupervisedExpManagerConfig(exp_dir=f"{exp}/{run}", tensorboard=False, **exp_manager))

    def sft(run, max_steps, lora_on, init_from=None, **em):
        return SFTRunConfig(**common(run, max_steps, lora_on, "sft.jsonl", **em),
                            sft=SFTConfig(num_sample_prompts=0, init_from=init_from))

    def keys(path):
        return sorted(k for k in dist_checkpointing.load_tensors_metadata(f"{path}/dist") if k.startswith("model."))

    out = {}
    SFTTrainer(sft("base", 1, False)).fit()
    base = f"{exp}/base/checkpoints/step_1"
    plain = SFTTrainer(sft("probe", 1, False, init_from=base))  # the base's weights, loaded
    base_params = {n: p.detach().clone() for n, p in plain.model.named_parameters()}
    t = SFTTrainer(sft("lora", 2, True, init_from=base, save_interval=1))
    t.fit()
    params = dict(t.model.named_parameters())
    out["sft_base_changed"] = [n for n, p in base_params.items() if n in params
                               and not torch.equal(params[n], p)]
    out["sft_trainable"] = sorted(n.removeprefix("module.") for n, p in params.items() if p.requires_grad)
    last = f"{exp}/lora/checkpoints/step_2"
    meta = read_metadata(last)
    out["sft_meta"] = (meta["lora_base"], meta["fingerprint"].get("lora_base"))
    out["sft_keys"] = keys(last)
    adapters = {n: p.detach().clone() for n, p in params.items() if p.requires_grad}
    resumed = SFTTrainer(sft("lora", 3, True, init_from=base))
    resumed.resume()
    out["sft_resumed"] = (resumed.step, [n for n, p in resumed.model.named_parameters()
                                         if p.requires_grad and not torch.equal(p, adapters[n])])
    try:
        SFTTrainer(sft("from_lora", 1, True, init_from=last))
        out["from_adapters"] = "accepted"
    except CheckpointError as exc:
        out["from_adapters"] = str(exc)
    rm = RMTrainer(RMRunConfig(**common("rm", 1, True, "preference.jsonl"), rm=RMConfig(init_from=base)))
    rm.fit()
    out["rm_trainable"] = sorted(n.removeprefix("module.") for n, p in rm.model.named_parameters()
                                 if p.requires_grad)
    out["rm_keys"] = keys(f"{exp}/rm/checkpoints/step_1")
    return out


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    from nemo_rlhf.tasks.precedence import DemoTaskConfig, make_demo_dataset

    tmp = tmp_path_factory.mktemp("supervised_lora")
    make_demo_dataset(tmp / "data", DemoTaskConfig(n_sft=16, n_pref=16, n_ppo=4, n_eval=4, n_val=4))
    return run_ranks(_worker, world_size=1, data=str(tmp / "data"), exp=str(tmp / "exp"))[0]


def test_sft_with_lora_trains_only_adapters_and_checkpoints_them_on_a_named_base(result):
    # (the SFT model's value head stays trainable as with LoRA off: the SFT loss never reaches it)
    trainable = result["sft_trainable"]
    assert any("_lora." in n for n in trainable)
    assert all("_lora." in n or n.startswith("value_head.") for n in trainable), trainable
    assert result["sft_base_changed"] == []
    base, fingerprint_hash = result["sft_meta"]
    assert base["path"].endswith("base/checkpoints/step_1") and base["hash"] == fingerprint_hash
    saved = result["sft_keys"]
    assert saved and all("_lora." in k or ".value_head." in k for k in saved), saved
    assert result["sft_resumed"] == (2, [])


def test_a_lora_run_from_an_adapters_only_checkpoint_is_refused(result):
    assert "sft.init_from=" in result["from_adapters"] and "holds LoRA adapters" in result["from_adapters"]


def test_rm_with_lora_trains_adapters_and_the_reward_head(result):
    assert any(n.startswith("reward_head") for n in result["rm_trainable"])
    assert all("_lora." in n or n.startswith("reward_head") for n in result["rm_trainable"])
    assert all("_lora." in k or "reward_head" in k for k in result["rm_keys"]) and result["rm_keys"]
