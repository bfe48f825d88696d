"""SFT and RM of a mixture-of-experts model with the router losses on (one spawn, one rank):
each training call hands ``forward_backward`` the step's non-padding token count (here, one
rank: the sum of its micro-batches' attention masks), and the losses change the update
(the gradient norm differs from the same run without them)."""

from __future__ import annotations

from tests.distributed.harness import run_ranks

ROUTER_LOSSES = dict(moe_aux_loss_coeff=0.5, moe_z_loss_coeff=0.05)


def _worker(rank: int, data: str, exp: str):
    import nemo_rlhf.trainers.rm as rm_module
    import nemo_rlhf.trainers.sft as sft_module
    from nemo_rlhf.data.datasets import DataConfig
    from nemo_rlhf.models.config import load_model_preset
    from nemo_rlhf.trainers.mixed_precision import OptimizerConfig
    from nemo_rlhf.trainers.rm import RMConfig, RMRunConfig, RMTrainer
    from nemo_rlhf.trainers.sft import SFTConfig, SFTRunConfig, SFTTrainer
    from nemo_rlhf.trainers.supervised import SupervisedExpManagerConfig, SupervisedTrainerConfig

    calls = []

    def spy(real):
        def forward_backward(model, micro_batches, loss_fn, forward_only=False, **kw):
            if not forward_only:
                calls.append((float(kw.get("routed_tokens") or 0),
                              sum(int(mb["attention_mask"].sum()) for mb in micro_batches)))
            return real(model, micro_batches, loss_fn, forward_only=forward_only, **kw)
        return forward_backward

    sft_module.forward_backward = spy(sft_module.forward_backward)
    rm_module.forward_backward = spy(rm_module.forward_backward)

    def common(run: str, train: str, losses: dict):
        return dict(
            model=load_model_preset("tiny", num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32,
                                    value_head_init_std=0.05, **losses),
            optim=OptimizerConfig(lr=1e-3),
            data=DataConfig(train_file=f"{data}/{train}", tokenizer_dir=f"{data}/tokenizer", max_seq_length=16),
            trainer=SupervisedTrainerConfig(max_steps=2, global_batch_size=4, micro_batch_size=2,
                                            log_every_n_steps=1),
            exp_manager=SupervisedExpManagerConfig(exp_dir=f"{exp}/{run}", tensorboard=False, checkpoints=False))

    out = {}
    for losses in ({}, ROUTER_LOSSES):
        tag = "on" if losses else "off"
        calls.clear()
        SFTTrainer(SFTRunConfig(**common(f"sft_{tag}", "sft.jsonl", losses),
                                sft=SFTConfig(num_sample_prompts=0))).fit()
        out[f"sft_{tag}"] = list(calls)
        calls.clear()
        RMTrainer(RMRunConfig(**common(f"rm_{tag}", "preference.jsonl", losses), rm=RMConfig())).fit()
        out[f"rm_{tag}"] = list(calls)
    return out


def test_sft_and_rm_weight_the_router_losses_by_the_steps_tokens(tmp_path):
    import json

    from nemo_rlhf.tasks.precedence import DemoTaskConfig, make_demo_dataset

    data = tmp_path / "data"
    make_demo_dataset(data, DemoTaskConfig(n_sft=8, n_pref=16, n_ppo=4, n_eval=4, n_val=8))
    out = run_ranks(_worker, world_size=1, data=str(data), exp=str(tmp_path / "exp"))[0]

    def grad_norms(run):
        rows = [json.loads(x) for x in (tmp_path / "exp" / run / "metrics.jsonl").read_text().splitlines()]
        return [r["grad_norm"] for r in rows if "grad_norm" in r]

    for job in ("sft", "rm"):
        on = out[f"{job}_on"]
        assert len(on) >= 2  # one training call per step at least
        # the step's count, handed to every call of the step (here the whole step is one
        # call per step: 4 rows in micro-batches of 2)
        for routed, masks in on:
            assert routed == masks > 0
        off, with_losses = grad_norms(f"{job}_off"), grad_norms(f"{job}_on")
        assert len(off) == len(with_losses) == 2
        assert off[0] != with_losses[0]  # the router losses reach the update
