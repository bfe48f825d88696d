"""SFT and RM trainers: 2 steps at DP=2 (TP=1), TP=2 and PP=2 give the same losses; RM
init from an SFT checkpoint loads the backbone (resharded to PP=2) and not the head.
One spawn of 2 gloo ranks for every check."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from tests.distributed.harness import run_ranks

LAYOUTS = {"dp2": (1, 1), "tp2": (2, 1), "pp2": (1, 2)}
STEPS = 2


def _global_name(name: str, pp_rank: int, per_stage: int) -> str:
    name = name.replace("module.", "")
    m = re.match(r"decoder\.layers\.(\d+)\.(.*)", name)
    if m:
        return f"decoder.layers.{int(m.group(1)) + pp_rank * per_stage}.{m.group(2)}"
    return name


def _configs(kind: str, data: Path, exp: Path, tp: int, pp: int, **extra):
    from nemo_rlhf.data.datasets import DataConfig
    from nemo_rlhf.distributed import ParallelConfig
    from nemo_rlhf.models.config import load_model_preset
    from nemo_rlhf.trainers.supervised import SupervisedExpManagerConfig, SupervisedTrainerConfig
    from nemo_rlhf.trainers.mixed_precision import OptimizerConfig

    files = {"sft": ("sft.jsonl", "sft_val.jsonl"), "rm": ("preference.jsonl", "preference_val.jsonl")}
    common = dict(
        # a random (not zero) reward head, so the first RM step is not trivially log(2)
        model=load_model_preset("tiny", value_head_init_std=0.05 if kind == "rm" else 0.0),
        parallel=ParallelConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp),
        # adam_eps=1: the first AdamW step is ~lr*grad, not lr*sign(grad) (which flips on
        # rounding noise), so the second step's loss is comparable across layouts.
        optim=OptimizerConfig(lr=0.1, adam_eps=1.0, clip_grad=0.0),
        data=DataConfig(train_file=str(data / files[kind][0]), val_file=str(data / files[kind][1]),
                        tokenizer_dir=str(data / "tokenizer"), max_seq_length=16),
        trainer=SupervisedTrainerConfig(max_steps=STEPS, global_batch_size=8, micro_batch_size=2,
                                        log_every_n_steps=1, seed=7),
        exp_manager=SupervisedExpManagerConfig(exp_dir=str(exp), resume="none", tensorboard=False,
                                               checkpoints=extra.pop("checkpoints", False)),
    )
    if kind == "sft":
        from nemo_rlhf.trainers.sft import SFTConfig, SFTRunConfig

        return SFTRunConfig(**common, sft=SFTConfig(num_sample_prompts=2, sample_max_new_tokens=3))
    from nemo_rlhf.trainers.rm import RMConfig, RMRunConfig

    return RMRunConfig(**common, rm=RMConfig(**extra))


def _params(trainer) -> dict:
    from nemo_rlhf.models.engine import unwrap

    per_stage = trainer.model_cfg.num_layers // trainer.dims.pp
    return {_global_name(n, trainer.dims.pp_rank, per_stage): p
            for n, p in unwrap(trainer.model).named_parameters()}


def _run(trainer_cls, cfg, ref_weights):
    tr = trainer_cls(cfg)
    if ref_weights is not None and tr.dims.pp > 1:  # PP stages draw their init differently
        with torch.no_grad():
            for name, p in _params(tr).items():
                p.copy_(ref_weights[name])
    init = {n: p.detach().clone() for n, p in _params(tr).items()}
    final = tr.fit()
    return tr, init, {"train": [(h["train/loss"], h.get("train/accuracy")) for h in tr.history],
                      "final": {k: v for k, v in final.items() if k.startswith(("val/", "final/"))}}


def _worker(rank: int, data: str, exp: str):
    from nemo_rlhf.trainers.rm import RMTrainer
    from nemo_rlhf.trainers.sft import SFTTrainer

    data, exp = Path(data), Path(exp)
    out = {}
    for kind, cls in (("sft", SFTTrainer), ("rm", RMTrainer)):
        ref = None
        for name, (tp, pp) in LAYOUTS.items():
            save = kind == "sft" and name == "dp2"
            cfg = _configs(kind, data, exp / f"{kind}_{name}", tp, pp, checkpoints=save)
            tr, init, res = _run(cls, cfg, ref)
            if name == "dp2":
                ref = init
                if save:
                    out["sft_trained"] = {n: p.detach().clone() for n, p in _params(tr).items()}
            out[f"{kind}_{name}"] = res
    # resume: continue the saved 2-step SFT run to step 3; compare with 3 steps in one go
    cfg = _configs("sft", data, exp / "sft_dp2", 1, 1, checkpoints=True)
    cfg.trainer.max_steps, cfg.exp_manager.resume = STEPS + 1, "auto"
    tr = SFTTrainer(cfg)
    out["resumed_at"] = tr.step
    tr.fit()
    out["resumed_history"] = [h["train/loss"] for h in tr.history]
    cfg = _configs("sft", data, exp / "sft_straight", 1, 1)
    cfg.trainer.max_steps = STEPS + 1
    tr = SFTTrainer(cfg)
    tr.fit()
    out["straight_history"] = [h["train/loss"] for h in tr.history]
    # RM from the SFT checkpoint (written at DP=2), loaded into PP=2
    cfg = _configs("rm", data, exp / "rm_init", 1, 2,
                   init_from=str(exp / "sft_dp2" / "checkpoints" / f"step_{STEPS}"))
    tr = RMTrainer(cfg)
    out["rm_init_params"] = {n: p.detach().clone() for n, p in _params(tr).items()}
    # the same at PP=2 with rm.freeze_layers=1: embedding + layer 0 (stage 0) stay, the rest trains
    # (its checkpoint holds zero placeholder moments for the frozen layers, so that
    # megatron's stacked per-layer tensors are whole; a resume loads it and continues)
    frozen_kw = dict(freeze_layers=1, init_from=str(exp / "sft_dp2" / "checkpoints" / f"step_{STEPS}"))
    cfg = _configs("rm", data, exp / "rm_frozen", 1, 2, checkpoints=True, **frozen_kw)
    tr = RMTrainer(cfg)
    before = {n: p.detach().clone() for n, p in _params(tr).items()}
    tr.fit()
    trained = {n: p.detach().clone() for n, p in _params(tr).items()}
    out["rm_frozen_changed"] = {n: not torch.equal(p, before[n]) for n, p in trained.items()}
    out["rm_frozen_trainable"] = {n: p.requires_grad for n, p in _params(tr).items()}
    cfg = _configs("rm", data, exp / "rm_frozen", 1, 2, checkpoints=True, **frozen_kw)
    cfg.trainer.max_steps, cfg.exp_manager.resume = STEPS + 1, "auto"
    tr = RMTrainer(cfg)
    out["rm_frozen_resumed_at"] = tr.step
    out["rm_frozen_resumed_equal"] = all(torch.equal(p.detach(), trained[n]) for n, p in _params(tr).items())
    tr.fit()
    out["rm_frozen_after_resume_changed"] = {n: not torch.equal(p.detach(), trained[n]) for n, p in _params(tr).items()}
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    from nemo_rlhf.tasks.precedence import DemoTaskConfig, make_demo_dataset

    data = tmp_path_factory.mktemp("data")
    make_demo_dataset(data, DemoTaskConfig(seed=0, n_sft=32, n_pref=32, n_ppo=8, n_eval=8, n_val=6))
    return run_ranks(_worker, world_size=2, data=str(data), exp=str(tmp_path_factory.mktemp("exp")))


@pytest.mark.parametrize("kind", ["sft", "rm"])
@pytest.mark.parametrize("layout", ["tp2", "pp2"])
def test_two_steps_match_the_tp1_run(results, kind, layout):
    for r in results:
        ref, got = r[f"{kind}_dp2"], r[f"{kind}_{layout}"]
        assert len(ref["train"]) == len(got["train"]) == STEPS
        for (l_ref, a_ref), (l_got, a_got) in zip(ref["train"], got["train"]):
            assert l_got == pytest.approx(l_ref, rel=1e-4, abs=1e-5)
            assert a_got == a_ref
        assert got["final"].keys() == ref["final"].keys() and ref["final"]
        for key, value in ref["final"].items():
            assert got["final"][key] == pytest.approx(value, rel=1e-4, abs=1e-5), key


@pytest.mark.parametrize("kind", ["sft", "rm"])
def test_training_steps_change_the_loss(results, kind):
    (l1, _), (l2, _) = results[0][f"{kind}_dp2"]["train"]
    assert l2 != pytest.approx(l1, rel=1e-3)


def test_rm_final_reward_stats_are_reported(results):
    final = results[0]["rm_dp2"]["final"]
    assert final["final/train_reward_std"] > 0 and "final/train_accuracy" in final


def test_rm_init_from_sft_checkpoint_loads_backbone_resharded_and_not_the_head(results):
    sft = results[0]["sft_trained"]  # DP=2 rank: the whole model
    seen = set()
    for r in results:  # PP=2 stages
        for name, p in r["rm_init_params"].items():
            if name.startswith("reward_head."):  # SFT's value head is zeros: not loaded
                assert name != "reward_head.weight" or torch.count_nonzero(p) == p.numel()
                continue
            torch.testing.assert_close(p, sft[name], rtol=0, atol=0, msg=name)
            seen.add(name)
    assert seen == {n for n in sft if not n.startswith("value_head.")}


def test_rm_freeze_layers_keeps_the_embedding_and_lower_layers_and_trains_the_rest(results):
    changed = {n: c for r in results for n, c in r["rm_frozen_changed"].items()}
    trainable = {n: t for r in results for n, t in r["rm_frozen_trainable"].items()}
    frozen = {n for n in changed if n.startswith(("embedding.", "decoder.layers.0."))}
    assert frozen and not any(changed[n] or trainable[n] for n in frozen)
    above = [n for n in changed if n.startswith("decoder.layers.1.") and n.endswith("weight")]
    assert above and all(changed[n] for n in above)
    assert changed["reward_head.weight"]
    for r in results:
        assert r["rm_frozen_resumed_at"] == STEPS and r["rm_frozen_resumed_equal"]
        after = r["rm_frozen_after_resume_changed"]
        assert not any(after[n] for n in frozen if n in after)
        assert all(after[n] for n in above if n in after)


def test_resumed_sft_run_continues_exactly_where_the_saved_run_stopped(results):
    for r in results:
        assert r["resumed_at"] == STEPS and len(r["resumed_history"]) == 1
        assert r["resumed_history"][0] == pytest.approx(r["straight_history"][-1], rel=1e-6, abs=1e-7)
        assert r["straight_history"][:STEPS] == pytest.approx([l for l, _ in r["sft_dp2"]["train"]],
                                                             rel=1e-6)
