"""One PPO step: this project's trainer vs TRL's ``PPOTrainer``, same model, data and batches.

Both sides train the same Llama-style architecture from the same fp32 weights on the same
prompts, with the same prompt / response lengths, rollout batch, mini-batch, micro-batch
and PPO epochs, on the same CPU threads, one after the other in clean processes:

* **ours**: :class:`nemo_rlhf.trainers.ppo.trainer.PPOTrainer` (megatron-core, one rank):
  Actor and Critic on ONE backbone (value head), Reference offloaded (its weights swapped
  into the backbone for the reference pass; ``--reference colocated`` keeps a resident
  copy instead), scores from an in-process megatron reward model of the same size (the
  trainer's ``score`` step is replaced by a forward of that model on the rollout's token
  ids, so that both sides do the same reward work; in production the RM is a separate
  served process, see ``nemo_rlhf/reward``).
* **trl**: ``trl.experimental.ppo.PPOTrainer`` (trl 0.26 to 0.29.1, the ``bench`` extra):
  policy ``LlamaForCausalLM``, a SEPARATE value model ``LlamaForSequenceClassification``
  (its own backbone), a resident reference ``LlamaForCausalLM`` and an in-process reward
  model ``LlamaForSequenceClassification``. It runs in its own virtual environment
  (``--trl-python``, default ``.venv-bench/bin/python``), because trl 0.29.1 pulls
  transformers 5.x, which this project's environment does not use.

Same weights: the ours process builds the actor-critic and the reward model, exports them
with :mod:`nemo_rlhf.tools.hf_convert` (policy; value model = the policy's backbone + our
value head as ``score``; RM backbone + reward head as ``score``), and the TRL process loads
them and checks its logits / values / rewards against ours on a probe batch.

Same work: ``min_new_tokens = max_new_tokens`` on our side and no stop token on TRL's, so
every response has ``--new`` tokens; prompts are random token ids of ``--prompt`` tokens
(no padding); temperature 1, no top-k / top-p. Per PPO step each side runs: generation,
three forward passes (ours: actor logits + values, reference, RM; TRL: reference, value
model, RM -- TRL takes the old log-probs from the generation scores; with
``--old-logprobs-from-rollout`` ours takes its old log-probs and values from the decode too
and runs two: reference, RM), then ``--epochs``
passes over ``--batch / --mini`` mini-batches of ``--mini / --micro`` micro-batches
(ours: one forward/backward of the shared backbone per micro-batch; TRL: policy AND value
model forward/backward). Our side also clips the gradient norm (TRL's loop does not).
``--recompute`` turns activation recompute on for the training passes of both sides (ours:
``model.recompute_granularity=full``, every layer; TRL: ``gradient_checkpointing_enable()``
on the policy and the value model): each trained layer keeps only its input and runs its
forward again in the backward, trading about one more forward for the activations' memory.

Measured, after ``--warmup`` untimed PPO steps, over ``--steps`` steps (mean):

* seconds per PPO step and episodes/s (= rollout batch / step seconds);
* phase split: generation / reference + RM + values (everything between the end of
  generation and the first training forward, incl. GAE) / training (PPO epochs);
  ours from the trainer's own timers, TRL's by wrapping its module-level
  ``batch_generation`` and ``forward`` and an ``on_step_end`` callback;
* peak memory: the process's peak resident set size (Linux ``VmHWM``) during the timed
  steps (reset through ``/proc/self/clear_refs`` after the warm-up, the C heap's free memory
  returned to the kernel first on both sides), and RSS after set-up.
  This is whole-process host RSS (torch CPU tensors + Python + libraries), not tracemalloc
  (which does not see torch's allocator); the two environments import different
  libraries, so the set-up RSS is printed too; and the torch tensors still alive after the
  timed steps (distinct host storages the garbage collector reaches): the models, gradients
  and optimizer states, so that nothing left over from set-up goes unnoticed;
* model-state memory (bytes) of the trained models: parameters + gradients + Adam states
  (exp_avg, exp_avg_sq, step; fp32 master copies if any), counted from the real tensors:
  our shared actor-critic vs TRL's policy + separate value model; frozen copies
  (reference, reward model) are printed separately. Gradients are counted as one fp32
  copy of the trained parameters on both sides (ours: megatron DDP's persistent
  ``main_grad`` buffer; TRL: ``.grad``, materialised at every backward).

``--profile N`` also profiles one more step of ours with ``torch.profiler`` and prints the
share of self CPU time in GEMM ops and the top ``N`` ops.

Run (1 torch thread per side by default, ``--threads``)::

    python benchmarks/bench_ppo_vs_trl.py                      # tiny preset
    python benchmarks/bench_ppo_vs_trl.py --model smollm2 --batch 8 --steps 1
    python benchmarks/bench_ppo_vs_trl.py --model smollm2 --batch 32 --steps 1

Set up the TRL side once (``.venv-bench`` is git-ignored by its own ``.gitignore``)::

    python3.11 -m venv .venv-bench && echo '*' > .venv-bench/.gitignore
    .venv-bench/bin/pip install torch==2.13.0 "trl>=0.26,<=0.29.1"   # or: pip install -e .[bench]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MIB = 1024 * 1024

# --model presets: (conf/model preset, vocab, prompt, new, rollout batch, mini, micro, fwd micro, epochs)
PRESETS = {
    # conf/model/tiny.yaml (the demo's model); vocabulary 128 (= its padded size, so both
    # sides compute the same logits width); the demo's rollout and micro batch sizes. The
    # mini-batch is the whole rollout by default: with more than one mini-batch TRL steps
    # its optimizer once per gradient_accumulation_steps micro-batches, which then spans
    # several mini-batches, so the two sides would not take the same optimizer steps.
    "tiny": dict(preset="tiny", vocab=128, prompt=32, new=16, batch=64, mini=None, micro=16,
                 fwd_micro=32, epochs=2),
    # conf/model/llama.yaml = SmolLM2-135M's shape (30 layers, hidden 576, 9 heads, 3 KV
    # heads, ffn 1536, tied embeddings), vocabulary 49152, random weights.
    "smollm2": dict(preset="llama", vocab=49152, prompt=64, new=32, batch=8, mini=None,
                    micro=8, fwd_micro=8, epochs=1),
}


# --------------------------------------------------------------------------- memory
def _status_kib(field: str) -> int:
    m = re.search(rf"^{field}:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.M)
    return int(m.group(1)) if m else -1


def rss_mib() -> float:
    return _status_kib("VmRSS") / 1024


def reset_peak_rss() -> bool:
    """Reset the kernel's peak-RSS mark (VmHWM) of this process; False if not allowed.

    First hands the C heap's free memory back to the kernel (glibc's ``malloc_trim``, where
    there is one), so the mark starts from live memory: what set-up freed (our side's HF
    export of three models, TRL's model loading) would otherwise stay resident and count
    toward the peak. Both sides call this at the same point (after the warm-up steps).
    """
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def peak_rss_mib() -> float:
    return _status_kib("VmHWM") / 1024


def live_tensor_mib() -> float:
    """MiB of the distinct host storages of every torch tensor the garbage collector can
    reach (models, gradients, optimizer states, and anything set-up left alive), each
    storage counted once; autograd's saved tensors and allocator caches are not seen."""
    import gc

    import torch

    gc.collect()
    storages = {}
    for o in gc.get_objects():
        try:
            if isinstance(o, torch.Tensor) and o.device.type == "cpu":
                st = o.untyped_storage()
                storages[st.data_ptr()] = st.nbytes()
        except (RuntimeError, TypeError):  # a tensor without storage (meta, sparse, ...)
            continue
    return sum(storages.values()) / 2**20


GEMM_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::linear", "aten::matmul")


def _profile_step(trainer, rows: int) -> str:
    """One more PPO step of our side under ``torch.profiler`` (CPU, after the timed steps):
    the share of self CPU time in GEMM ops, and the top ``rows`` ops by self CPU time."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        trainer.train_step()
        trainer.step += 1
    events = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in events)
    gemm = sum(e.self_cpu_time_total for e in events if e.key in GEMM_OPS)
    head = (f"profile of one more step of ours: {total / 1e6:.2f} s of self CPU time in ops, "
            f"{gemm / max(total, 1):.1%} of it in GEMMs ({', '.join(GEMM_OPS)})\n")
    return head + events.table(sort_by="self_cpu_time_total", row_limit=rows)


def _tensor_bytes(t) -> int:
    return t.numel() * t.element_size()


def _adam_bytes(optimizer, params) -> int:
    ids = {id(p) for p in params}
    total = 0
    for p, st in optimizer.state.items():
        if id(p) in ids:
            total += sum(_tensor_bytes(v) for v in st.values() if hasattr(v, "numel"))
    return total


def _prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    """Random prompt ids in ``[1, vocab - 2]`` (0 is the pad id, ``vocab - 1`` the EOS id)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, vocab - 1, (n, length), generator=g).tolist()


def _mean(xs):
    return sum(xs) / max(len(xs), 1)


# --------------------------------------------------------------------------- ours
class _Tok:
    """The trainer only needs the special ids (and decode for stop strings, unused)."""

    def __init__(self, vocab: int):
        self.eos_id, self.pad_id = vocab - 1, 0

    def decode(self, ids):
        return " ".join(map(str, ids))


def run_ours(a: argparse.Namespace, work: Path) -> dict:
    import torch

    torch.set_num_threads(a.threads)
    rss_import = rss_mib()
    from safetensors.torch import save_file

    from nemo_rlhf.data.datasets import PromptSample
    from nemo_rlhf.distributed import initialize_distributed
    from nemo_rlhf.models.actor_critic import build_model
    from nemo_rlhf.models.config import load_model_preset
    from nemo_rlhf.tools.hf_convert import hf_config, megatron_to_hf, model_full_tensors
    from nemo_rlhf.models.engine import model_forward, unwrap, wrap_ddp
    from nemo_rlhf.trainers.mixed_precision import MixedPrecisionOptimizer
    from nemo_rlhf.trainers.ppo.config import PPOConfig, validate_batch_sizes
    from nemo_rlhf.trainers.ppo.reference import ReferencePolicy
    from nemo_rlhf.trainers.ppo.trainer import PPOTrainer

    rss_import = max(rss_import, rss_mib())
    cfg = PPOConfig()
    cfg.model = load_model_preset(a.preset, vocab_size=a.vocab,
                                  max_position_embeddings=a.prompt + a.new,
                                  hidden_dropout=0.0, attention_dropout=0.0,
                                  recompute_granularity="full" if a.recompute else None)
    cfg.trainer.seed = a.seed
    cfg.trainer.precision = "32"
    cfg.exp_manager.exp_dir = str(work / "ours_exp")
    # the run's fingerprint hashes a tokenizer and a prompt file: stand-ins (the prompts are
    # random ids, handed to the trainer directly)
    (work / "tok").mkdir(exist_ok=True)
    (work / "tok" / "tokenizer.json").write_text("{}")
    (work / "prompts.jsonl").write_text("")
    cfg.data.tokenizer_dir, cfg.data.train_file = str(work / "tok"), str(work / "prompts.jsonl")
    cfg.reference.mode = a.reference
    cfg.rollout.max_new_tokens = cfg.rollout.min_new_tokens = a.new
    cfg.rollout.temperature, cfg.rollout.top_k, cfg.rollout.top_p = 1.0, 0, 1.0
    cfg.rollout.stop_token_ids, cfg.rollout.stop_strings = [], []
    p = cfg.ppo
    p.num_rollout_samples, p.global_batch_size = a.batch, a.mini
    p.micro_batch_size, p.forward_micro_batch_size, p.ppo_epochs = a.micro, a.fwd_micro, a.epochs
    p.clip_eps, p.value_clip, p.value_loss_coef = 0.2, 0.2, a.vf_coef
    p.entropy_coef, p.gamma, p.lam = 0.0, 1.0, 0.95
    p.normalize_advantages, p.missing_eos_penalty = True, None
    p.old_logprobs_from_rollout = a.old_logprobs_from_rollout
    cfg.kl.type, cfg.kl.init_kl_coef = "fixed", a.kl_coef
    cfg.optim.lr, cfg.optim.warmup_steps, cfg.optim.weight_decay = a.lr, 0, 0.0

    dims = initialize_distributed(cfg.parallel, seed=cfg.trainer.seed,
                                  num_layers=cfg.model.num_layers,
                                  num_attention_heads=cfg.model.num_attention_heads,
                                  num_query_groups=cfg.model.num_query_groups)
    validate_batch_sizes(cfg.ppo, dims.dp)

    def make_stage():
        return build_model(cfg.model, dims, "32", kind="actor_critic", seed=cfg.trainer.seed)

    model = make_stage()
    reference = ReferencePolicy(model, cfg.reference.mode, build_fn=make_stage)
    ddp = wrap_ddp(model)
    optimizer = MixedPrecisionOptimizer(ddp, cfg.optim, mp_group=dims.mp_group, fp16=False)
    rm = build_model(cfg.model, dims, "32", kind="reward", seed=cfg.trainer.seed + 1).eval()
    with torch.no_grad():  # a non-zero reward head (the default init is zero)
        g = torch.Generator().manual_seed(a.seed + 2)
        rm.reward_head.weight.copy_(torch.randn(rm.reward_head.weight.shape, generator=g) * 0.02)
    # one batch more than the run uses: TRL's (accelerate's) gradient accumulation syncs at
    # every micro-batch once its dataloader reaches its last batch
    n_prompts = a.batch * (a.warmup + a.steps + 1)
    prompt_ids = _prompts(n_prompts, a.prompt, a.vocab, a.seed)
    prompts = [PromptSample(prompt_ids=ids, prompt="", extras={}) for ids in prompt_ids]
    trainer = PPOTrainer(cfg, dims, ddp, optimizer, reference, None, _Tok(a.vocab), prompts, None)

    def score(idx, batch):
        """In-process RM: reward head at each row's last response token (timed as the
        trainer's own scoring step is, under ``reward``)."""
        with trainer.timers("reward"), torch.no_grad():
            out = []
            for s in range(0, batch.input_ids.shape[0], a.fwd_micro):
                rewards = model_forward(rm, batch.input_ids[s:s + a.fwd_micro],
                                        batch.attention_mask[s:s + a.fwd_micro])
                last = batch.prompt_length + batch.response_lengths[s:s + a.fwd_micro] - 1
                out.append(rewards.gather(1, last.unsqueeze(1)).squeeze(1).float())
        return torch.cat(out), {}

    trainer.score = score

    # --- export the same weights for the TRL side, with a probe batch to check them
    actor = unwrap(ddp)
    hf_cfg = hf_config(cfg.model, "llama", torch.float32, token_ids={"pad_token_id": 0})
    hf_cfg["eos_token_id"] = None
    hf_cfg["bos_token_id"] = None
    policy = megatron_to_hf(model_full_tensors(actor), cfg.model, "llama")
    value = {k: v for k, v in policy.items() if k.startswith("model.")}
    value["score.weight"] = actor.value_head.weight.detach().clone().contiguous()
    reward = megatron_to_hf(model_full_tensors(rm), cfg.model, "llama", reward=True)
    assert float(rm.reward_head.bias.abs().max()) == 0.0  # HF's score has no bias
    for name, tensors in (("policy", policy), ("value", value), ("reward", reward)):
        save_file(tensors, str(work / f"{name}.safetensors"))
    probe = torch.tensor(_prompts(2, a.prompt + a.new, a.vocab, a.seed + 3))
    with torch.no_grad():
        logits, values = model_forward(actor, probe, torch.ones_like(probe))
        rm_out = model_forward(rm, probe, torch.ones_like(probe))
    torch.save({"ids": probe, "logits": logits[..., :a.vocab].float(), "values": values.float(),
                "rewards": rm_out.float()}, work / "probe.pt")
    (work / "hf_config.json").write_text(json.dumps(hf_cfg))
    (work / "prompts.json").write_text(json.dumps(prompt_ids))
    # nothing of the export or the probe outlives the set-up (the loop variable ``tensors``
    # held the RM's exported copy, 513 MiB at the SmolLM2 shape, through the timed steps)
    del policy, value, reward, tensors, probe, logits, values, rm_out
    rss_setup = rss_mib()

    phases = {"generation": ("rollout",),
              "ref_rm_values": ("reward", "old_logprobs_values", "reference_logprobs", "advantages"),
              "training": ("train",)}
    steps, peak_reset = [], False
    for i in range(a.warmup + a.steps):
        if i == a.warmup:
            peak_reset = reset_peak_rss()
        c0 = time.process_time()
        m = trainer.train_step()
        trainer.step += 1
        if i >= a.warmup:
            row = {k: sum(m.get(f"timing/{t}_s", 0.0) for t in ts) for k, ts in phases.items()}
            row["step"] = m["timing/step_s"]
            row["cpu"] = time.process_time() - c0
            row["ratio_max_first_minibatch"] = m.get("first_minibatch/ratio_max")
            row["kl_mean"] = m.get("kl_mean")
            steps.append(row)
    opt_steps = trainer.cfg.ppo.ppo_epochs * (a.batch // a.mini)
    peak = peak_rss_mib()
    live = live_tensor_mib()
    profile = _profile_step(trainer, a.profile) if a.profile else None
    # MFU: the step's model FLOPs (nemo_rlhf.metrics.flops) over the fp32 GEMM rate of this
    # process, same threads, measured now (1024^3, best of 5)
    from nemo_rlhf.metrics.flops import ppo_step_flops
    from nemo_rlhf.models.config import host_gemm_gflops

    flops = ppo_step_flops(cfg.model, batch=a.batch, prompt_len=a.prompt, response_len=a.new,
                           ppo_epochs=trainer.cfg.ppo.ppo_epochs).to_dict()
    gemm_peak = host_gemm_gflops(n=1024, reps=5)["fp32"]
    executed = executed_gflops(cfg.model, a)

    # --- model state (bytes)
    trained = optimizer.params
    param_b = sum(_tensor_bytes(q) for q in trained)
    grad_b = sum(_tensor_bytes(q.detach().float()) for q in trained)  # one fp32 copy
    main_grad_b = sum(_tensor_bytes(q.main_grad) for q in trained if getattr(q, "main_grad", None) is not None)
    adam_b = _adam_bytes(optimizer.optimizer, optimizer.masters)
    masters_b = sum(_tensor_bytes(mm) for mm, q in zip(optimizer.masters, optimizer.params) if mm is not q)
    head_params = sum(q.numel() for n, q in actor.named_parameters() if n.startswith("value_head"))
    return {
        "side": "ours", "steps": steps, "rss_import_mib": rss_import, "rss_setup_mib": rss_setup,
        "profile": profile, "flops": flops, "gemm_peak_gflops": gemm_peak,
        "executed_gflops": executed,
        "peak_rss_mib": peak, "peak_reset": peak_reset, "optimizer_steps_per_ppo_step": opt_steps,
        "live_tensor_mib": live,
        "state": {
            "trained_params": sum(q.numel() for q in trained), "value_head_params": head_params,
            "param_bytes": param_b, "grad_bytes": grad_b, "main_grad_buffer_bytes": main_grad_b,
            "adam_bytes": adam_b, "master_bytes": masters_b,
            "trained_total_bytes": param_b + grad_b + adam_b + masters_b,
            "reference_bytes": (reference.host_bytes() if a.reference == "offload" else
                                sum(_tensor_bytes(q) for q in reference.resident.parameters())),
            "reward_model_bytes": sum(_tensor_bytes(q) for q in rm.parameters()),
        },
        "model": {k: getattr(cfg.model, k) for k in (
            "name", "num_layers", "hidden_size", "num_attention_heads", "num_query_groups",
            "ffn_hidden_size", "vocab_size", "share_embeddings_and_output_weights")},
    }


# --------------------------------------------------------------------------- TRL
def run_trl(a: argparse.Namespace, work: Path) -> dict:
    import warnings

    warnings.filterwarnings("ignore")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import torch

    torch.set_num_threads(a.threads)
    import datasets
    import transformers
    import trl
    import trl.experimental.ppo.ppo_trainer as ppo_mod
    from safetensors.torch import load_file
    from tokenizers import Tokenizer, models
    from transformers import (LlamaConfig, LlamaForCausalLM, LlamaForSequenceClassification,
                              PreTrainedTokenizerFast, TrainerCallback)
    from trl.experimental.ppo import PPOConfig, PPOTrainer

    transformers.logging.set_verbosity_error()
    datasets.disable_progress_bars()
    rss_import = rss_mib()
    torch.manual_seed(a.seed)
    hf_cfg = json.loads((work / "hf_config.json").read_text())
    for k in ("architectures", "model_type", "torch_dtype", "id2label", "label2id", "num_labels"):
        hf_cfg.pop(k, None)
    tied = hf_cfg["tie_word_embeddings"]

    def load(cls, name, **extra):
        m = cls(LlamaConfig(**hf_cfg, **extra)).float()
        missing, unexpected = m.load_state_dict(load_file(str(work / f"{name}.safetensors")), strict=False)
        allowed = {"lm_head.weight"} if (tied and cls is LlamaForCausalLM) else set()
        if set(missing) - allowed or unexpected:
            raise SystemExit(f"{name}: missing {missing}, unexpected {unexpected}")
        if tied and cls is LlamaForCausalLM:
            m.tie_weights()
        return m

    policy = load(LlamaForCausalLM, "policy")
    ref = load(LlamaForCausalLM, "policy")
    value = load(LlamaForSequenceClassification, "value", num_labels=1)
    reward = load(LlamaForSequenceClassification, "reward", num_labels=1)
    probe = torch.load(work / "probe.pt")
    with torch.no_grad():
        ids = probe["ids"]
        diffs = {
            "logits": float((policy(ids).logits - probe["logits"]).abs().max()),
            "values": float((value.score(value.model(ids).last_hidden_state).squeeze(-1)
                             - probe["values"]).abs().max()),
            "rewards": float((reward.score(reward.model(ids).last_hidden_state).squeeze(-1)
                              - probe["rewards"]).abs().max()),
        }
    del probe, ids  # the probe's tensors do not outlive the check (as on our side)

    vocab = hf_cfg["vocab_size"]
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t1"))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="t0", eos_token=f"t{vocab - 1}")
    prompts = json.loads((work / "prompts.json").read_text())
    ds = datasets.Dataset.from_dict({"input_ids": prompts})

    marks: list[dict] = []  # one per PPO update

    def timed_generation(*args, **kw):
        t0 = time.perf_counter()
        out = orig_generation(*args, **kw)
        marks.append({"gen_start": t0, "gen_end": time.perf_counter(), "train_start": None,
                      "resp_cols": int(out[0].shape[1] - args[1].shape[1])})
        return out

    def timed_forward(model, *args, **kw):
        if torch.is_grad_enabled() and marks and marks[-1]["train_start"] is None:
            marks[-1]["train_start"] = time.perf_counter()
        return orig_forward(model, *args, **kw)

    orig_generation, orig_forward = ppo_mod.batch_generation, ppo_mod.forward
    ppo_mod.batch_generation, ppo_mod.forward = timed_generation, timed_forward
    step_ends: list[float] = []
    cpu_ends: list[float] = []
    peak_reset = [False]

    class Clock(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            step_ends.append(time.perf_counter())
            cpu_ends.append(time.process_time())
            if len(step_ends) == a.warmup:
                peak_reset[0] = reset_peak_rss()

    args = PPOConfig(
        output_dir=str(work / "trl_out"), report_to="none", save_strategy="no", logging_steps=1,
        disable_tqdm=True, use_cpu=True, bf16=False, fp16=False, seed=a.seed,
        # TRL's rollout batch is per_device_train_batch_size * gradient_accumulation_steps,
        # split into num_mini_batches mini-batches of micro-batches
        per_device_train_batch_size=a.micro, gradient_accumulation_steps=a.batch // a.micro,
        num_mini_batches=a.batch // a.mini, num_ppo_epochs=a.epochs,
        local_rollout_forward_batch_size=a.fwd_micro, response_length=a.new,
        total_episodes=a.batch * (a.warmup + a.steps), temperature=1.0, stop_token=None,
        missing_eos_penalty=None, num_sample_generations=0, learning_rate=a.lr,
        lr_scheduler_type="constant", kl_coef=a.kl_coef, kl_estimator="k1", cliprange=0.2,
        cliprange_value=0.2, vf_coef=a.vf_coef, gamma=1.0, lam=0.95, whiten_rewards=False,
        per_device_eval_batch_size=a.micro, dataloader_num_workers=0,
    )
    trainer = PPOTrainer(args=args, processing_class=tokenizer, model=policy, ref_model=ref,
                         reward_model=reward, train_dataset=ds, value_model=value,
                         eval_dataset=ds.select(range(a.micro)), callbacks=[Clock()])
    if a.recompute:
        # HF's activation checkpointing, every layer; no-grad passes (generation, scoring) run
        # without it and keep the KV cache. Enabled after the trainer is built: trl 0.29.1's
        # PolicyAndValueWrapper records the flag then and, when set, calls a
        # gradient_checkpointing_disable() it does not have before each generation.
        for m in (policy, value):
            m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    opt = trainer.optimizer.optimizer if hasattr(trainer.optimizer, "optimizer") else trainer.optimizer
    opt_steps = [0]
    opt.register_step_post_hook(lambda *_: opt_steps.__setitem__(0, opt_steps[0] + 1))
    rss_setup = rss_mib()
    t_train, c_train = time.perf_counter(), time.process_time()
    trainer.train()
    peak = peak_rss_mib()
    live = live_tensor_mib()
    if len(marks) != a.warmup + a.steps or len(step_ends) != len(marks):
        raise SystemExit(f"expected {a.warmup + a.steps} PPO updates, saw {len(marks)} / {len(step_ends)}")
    steps = []
    for i in range(a.warmup, len(marks)):
        m, start = marks[i], (step_ends[i - 1] if i else t_train)
        steps.append({"generation": m["gen_end"] - m["gen_start"],
                      "ref_rm_values": m["train_start"] - m["gen_end"],
                      "training": step_ends[i] - m["train_start"],
                      "step": step_ends[i] - start, "resp_cols": m["resp_cols"],
                      "cpu": cpu_ends[i] - (cpu_ends[i - 1] if i else c_train)})

    # --- model state (bytes): policy and value model trained, one Adam over both
    pol_params = [q for q in policy.parameters() if q.requires_grad]
    val_params = [q for q in value.parameters() if q.requires_grad]

    def part(params):
        pb = sum(_tensor_bytes(q) for q in params)
        return {"params": sum(q.numel() for q in params), "param_bytes": pb,
                "grad_bytes": sum(_tensor_bytes(q.detach().float()) for q in params),
                "adam_bytes": _adam_bytes(opt, params)}

    pol, val = part(pol_params), part(val_params)
    for d in (pol, val):
        d["total_bytes"] = d["param_bytes"] + d["grad_bytes"] + d["adam_bytes"]
    return {
        "side": "trl", "steps": steps, "rss_import_mib": rss_import, "rss_setup_mib": rss_setup,
        "peak_rss_mib": peak, "peak_reset": peak_reset[0], "weight_check": diffs,
        "live_tensor_mib": live,
        "optimizer_steps_per_ppo_step": opt_steps[0] / len(marks),
        "versions": {"trl": trl.__version__, "transformers": transformers.__version__,
                     "torch": torch.__version__},
        "state": {"policy": pol, "value_model": val,
                  "trained_total_bytes": pol["total_bytes"] + val["total_bytes"],
                  "reference_bytes": sum(_tensor_bytes(q) for q in ref.parameters()),
                  "reward_model_bytes": sum(_tensor_bytes(q) for q in reward.parameters())},
    }


# --------------------------------------------------------------------------- driver
def _child(python: str, role: str, a: argparse.Namespace, work: Path) -> dict:
    out = work / f"{role}.json"
    cmd = [python, str(Path(__file__).resolve()), "--_role", role, "--_work", str(work),
           "--_args", json.dumps(vars(a))]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": str(a.threads)}
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True)
    if proc.returncode != 0 or not out.exists():
        sys.stdout.write(proc.stdout[-6000:])
        raise SystemExit(f"{role} side failed (exit {proc.returncode})")
    res = json.loads(out.read_text())
    res["wall_s"] = time.perf_counter() - t0
    return res


def executed_gflops(model_cfg, a: argparse.Namespace) -> dict:
    """GFLOP per PPO step that each side's code computes (matrix products and attention,
    :mod:`nemo_rlhf.metrics.flops`'s counts), not model FLOPs: where model FLOPs charge the
    output layer on every position, here it runs only where a side runs it.

    With ``Fb`` a backbone forward over ``batch x (prompt + new)`` tokens (no output layer),
    ``Lall`` the output layer on every position and ``Lr`` on the response positions only:

    * TRL: generation; reference ``Fb + Lall`` (HF computes the logits of every position),
      value model ``Fb`` and RM ``Fb`` (score heads, no output layer); per PPO epoch the
      policy ``3 (Fb + Lall)`` and the value model ``3 Fb``; with recompute (HF's, the
      decoder layers) ``+ Fb`` per trained model.
    * ours: generation; old log-probs + values ``Fb + Lr`` (fused, chunked output layer on
      the response positions; skipped with ``--old-logprobs-from-rollout``), reference
      ``Fb + Lr``, RM ``Fb``; per PPO epoch the shared backbone ``3 (Fb + Lr)``; with
      recompute (every layer) ``+ Fb``.
    """
    from nemo_rlhf.metrics.flops import decode_flops, forward_flops

    S = a.prompt + a.new
    fb = forward_flops(model_cfg, a.batch, S, logits=False)
    l_all = forward_flops(model_cfg, a.batch, S) - fb
    l_r = a.batch * a.new * 2 * model_cfg.hidden_size * model_cfg.padded_vocab_size
    gen = decode_flops(model_cfg, a.batch, a.prompt, a.new)
    rc = 1 if a.recompute else 0
    trl = gen + (fb + l_all) + 2 * fb + a.epochs * (3 * (fb + l_all) + 3 * fb + rc * 2 * fb)
    ours = (gen + (0 if a.old_logprobs_from_rollout else fb + l_r) + (fb + l_r) + fb
            + a.epochs * (3 * (fb + l_r) + rc * fb))
    return {"ours": ours / 1e9, "trl": trl / 1e9}


def _print_mfu(ours: dict, mean: dict, threads: int) -> None:
    """Our phases' model FLOP/s over the fp32 GEMM rate measured in the same process: an
    MFU for this machine (model FLOPs: :mod:`nemo_rlhf.metrics.flops`; the train phase is
    ``ppo_epochs`` forward + backward passes, 3x a forward, over ``batch x (prompt + new)``
    tokens; the rollout a prefill plus one decode step per new token)."""
    f, peak = ours["flops"], ours["gemm_peak_gflops"]
    print(f"\nMFU of ours (model FLOPs / the fp32 GEMM rate of this process, 1024^3, {threads} "
          f"thread(s): {peak:.1f} GFLOP/s):")
    for label, key, phase in (("rollout (generation)", "rollout", "generation"),
                              ("train phase (PPO epochs)", "train", "training")):
        seconds = mean[phase]
        rate = f[key] / max(seconds, 1e-9) / 1e9
        print(f"  {label:26} {f[key] / 1e9:10.2f} GFLOP in {seconds:7.3f} s = {rate:7.1f} GFLOP/s "
              f"= {rate / peak:6.1%} of the GEMM rate")


def _fmt_b(n: float) -> str:
    return f"{n / MIB:,.1f} MiB"


def report(a: argparse.Namespace, ours: dict, trl: dict | None) -> None:
    m = ours["model"]
    print(f"\nmodel: {a.model} ({m['num_layers']} layers, hidden {m['hidden_size']}, heads "
          f"{m['num_attention_heads']}/{m['num_query_groups']} KV, ffn {m['ffn_hidden_size']}, vocab "
          f"{m['vocab_size']}, tied embeddings {m['share_embeddings_and_output_weights']}), fp32, "
          f"{a.threads} threads")
    print(f"per PPO step: {a.batch} prompts x {a.prompt} tokens, {a.new} new tokens (sampled, "
          f"temperature 1), mini-batch {a.mini}, micro-batch {a.micro}, forward micro-batch "
          f"{a.fwd_micro}, {a.epochs} PPO epoch(s); {a.warmup} warm-up step(s), mean of {a.steps} timed"
          + (f", best of {a.rounds} alternating rounds" if a.rounds > 1 else "")
          + ("; ours: old log-probs and values from the rollout" if a.old_logprobs_from_rollout else "")
          + ("; activation recompute on both sides (ours: model.recompute_granularity=full; TRL: "
             "gradient_checkpointing_enable on the policy and value model)" if a.recompute else ""))
    print(f"optimizer steps per PPO step: ours {ours['optimizer_steps_per_ppo_step']:g}"
          + (f", trl {trl['optimizer_steps_per_ppo_step']:g}" if trl else "")
          + (" (TRL accumulates over gradient_accumulation_steps micro-batches, which spans "
             "all mini-batches of an epoch when num_mini_batches > 1)" if a.batch != a.mini else ""))
    print(f"ours: reference {a.reference}, in-process megatron RM; trl: "
          + (f"trl {trl['versions']['trl']}, transformers {trl['versions']['transformers']}, "
             f"torch {trl['versions']['torch']}" if trl else "not run"))
    if trl:
        w = trl["weight_check"]
        print(f"same weights: max |ours - trl| logits {w['logits']:.1e}, values {w['values']:.1e}, "
              f"RM rewards {w['rewards']:.1e}; TRL response columns per step "
              f"{sorted({s['resp_cols'] for s in trl['steps']})}")
    rows = [("seconds per PPO step", "step"), ("  generation s", "generation"),
            ("  reference + RM + values s", "ref_rm_values"), ("  training (PPO epochs) s", "training")]
    sides = [ours] + ([trl] if trl else [])
    for s in sides:
        for r in s["steps"]:
            r["other"] = r["step"] - r["generation"] - r["ref_rm_values"] - r["training"]
    rows.append(("  other (logging, gc, data) s", "other"))
    mean = {s["side"]: {k: _mean([r[k] for r in s["steps"]]) for _, k in rows} for s in sides}
    print(f"\n{'':32} {'ours':>12} {'trl':>12} {'ours/trl':>9}")

    def line(label, o, t, fmt="{:>12.3f}", ratio=True):
        ts = fmt.format(t) if t is not None else f"{'-':>12}"
        r = f"{o / t:>9.2f}" if (t and ratio) else f"{'-':>9}"
        print(f"{label:32} {fmt.format(o)} {ts} {r}")

    for label, k in rows:
        line(label, mean["ours"][k], mean["trl"][k] if trl else None)
    for label, k in rows[1:]:
        line(f"  {k} share of step", mean["ours"][k] / mean["ours"]["step"],
             mean["trl"][k] / mean["trl"]["step"] if trl else None, "{:>12.1%}", ratio=False)
    eps = {s: a.batch / mean[s]["step"] for s in mean}
    line("episodes/s", eps["ours"], eps.get("trl"))
    cpu = {s["side"]: _mean([r["cpu"] for r in s["steps"]]) for s in sides}
    line("process CPU seconds per step", cpu["ours"], cpu.get("trl"))
    line("peak RSS during timed steps MiB", ours["peak_rss_mib"], trl["peak_rss_mib"] if trl else None,
         "{:>12.0f}")
    line("live tensors after the steps MiB", ours["live_tensor_mib"],
         trl["live_tensor_mib"] if trl else None, "{:>12.0f}")
    line("RSS after set-up MiB", ours["rss_setup_mib"], trl["rss_setup_mib"] if trl else None, "{:>12.0f}")
    line("RSS after imports MiB", ours["rss_import_mib"], trl["rss_import_mib"] if trl else None,
         "{:>12.0f}")
    line("peak RSS - RSS after imports MiB", ours["peak_rss_mib"] - ours["rss_import_mib"],
         trl["peak_rss_mib"] - trl["rss_import_mib"] if trl else None, "{:>12.0f}")
    if not ours["peak_reset"] or (trl and not trl["peak_reset"]):
        print("  (peak RSS could not be reset after the warm-up: lifetime peak)")

    _print_mfu(ours, mean["ours"], a.threads)
    ex = ours["executed_gflops"]
    print(f"\nGFLOP per step each side computes (matrix products + attention, see "
          f"executed_gflops): ours {ex['ours']:.0f}, trl {ex['trl']:.0f}, ratio "
          f"{ex['ours'] / ex['trl']:.3f}: at equal FLOP/s the step-time ratio")
    if trl:
        rate = {s_: ex[s_] / mean[s_]["step"] for s_ in ("ours", "trl")}
        print(f"  achieved: ours {rate['ours']:.1f} GFLOP/s, trl {rate['trl']:.1f} GFLOP/s "
              f"({rate['ours'] / rate['trl']:.2f}x)")

    st = ours["state"]
    print("\nmodel state (parameters + gradients + Adam states, fp32 bytes):")
    print(f"  ours  shared actor-critic: {st['trained_params']:,} params (value head "
          f"{st['value_head_params']:,}): params {_fmt_b(st['param_bytes'])} + grads "
          f"{_fmt_b(st['grad_bytes'])} + Adam {_fmt_b(st['adam_bytes'])}"
          + (f" + masters {_fmt_b(st['master_bytes'])}" if st["master_bytes"] else "")
          + f" = {_fmt_b(st['trained_total_bytes'])} ({st['trained_total_bytes']:,} B)")
    if trl:
        ts = trl["state"]
        for name in ("policy", "value_model"):
            d = ts[name]
            print(f"  trl   {name:21}: {d['params']:,} params: params {_fmt_b(d['param_bytes'])} + "
                  f"grads {_fmt_b(d['grad_bytes'])} + Adam {_fmt_b(d['adam_bytes'])} = "
                  f"{_fmt_b(d['total_bytes'])}")
        print(f"  trl   policy + separate critic: {_fmt_b(ts['trained_total_bytes'])} "
              f"({ts['trained_total_bytes']:,} B)")
        print(f"  ratio trained state ours / trl = {st['trained_total_bytes'] / ts['trained_total_bytes']:.3f}; "
              f"separate critic alone = {ts['value_model']['total_bytes'] / st['trained_total_bytes']:.2f}x "
              f"of our whole actor-critic state")
        print(f"  frozen: reference ours {_fmt_b(st['reference_bytes'])} ({a.reference}"
              + (": one host copy; its CUDA swap adds a stash" if a.reference == "offload" else "")
              + f") vs trl {_fmt_b(ts['reference_bytes'])} (resident); reward model ours "
              f"{_fmt_b(st['reward_model_bytes'])} vs trl {_fmt_b(ts['reward_model_bytes'])}")
    if ours.get("profile"):
        print("\n" + ours["profile"])
    print("\nper-step timings (s):")
    for s in sides:
        for i, r in enumerate(s["steps"]):
            print(f"  {s['side']:4} step {i + 1}: " + ", ".join(
                f"{k} {r[k]:.3f}" for _, k in rows) + f", cpu {r['cpu']:.3f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", choices=sorted(PRESETS), default="tiny")
    p.add_argument("--batch", type=int, help="rollout batch (prompts per PPO step)")
    p.add_argument("--mini", type=int, help="PPO mini-batch (one optimizer step); default: --batch (one mini-batch)")
    p.add_argument("--micro", type=int, help="training micro-batch")
    p.add_argument("--fwd-micro", type=int, help="forward-only micro-batch (rollout scoring)")
    p.add_argument("--prompt", type=int, help="prompt tokens")
    p.add_argument("--new", type=int, help="new tokens per response")
    p.add_argument("--epochs", type=int, help="PPO epochs per step")
    p.add_argument("--vocab", type=int)
    p.add_argument("--steps", type=int, default=3, help="timed PPO steps")
    p.add_argument("--warmup", type=int, default=1, help="untimed PPO steps first")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads per side (on a shared 2-core machine 2 threads can be "
                        "far slower than 1: OpenMP waits for a descheduled thread)")
    p.add_argument("--rounds", type=int, default=1,
                   help="run both sides this many times, alternating; report each side's best round")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--kl-coef", type=float, default=0.05)
    p.add_argument("--vf-coef", type=float, default=0.1)
    p.add_argument("--reference", choices=["offload", "colocated"], default="offload")
    p.add_argument("--trl-python", default=str(REPO / ".venv-bench" / "bin" / "python"),
                   help="interpreter of the environment with trl<=0.29.1")
    p.add_argument("--old-logprobs-from-rollout", action="store_true",
                   help="ours: ppo.old_logprobs_from_rollout (old log-probs and values from the "
                        "decode, no forward-only pass; TRL takes its old log-probs from generation too)")
    p.add_argument("--recompute", action="store_true",
                   help="activation recompute in the training passes on both sides: ours "
                        "model.recompute_granularity=full (every layer), TRL the policy's and value "
                        "model's gradient_checkpointing_enable()")
    p.add_argument("--skip-trl", action="store_true")
    p.add_argument("--profile", type=int, default=0,
                   help="after the timed steps, profile one more step of ours and print this "
                        "many top ops by self CPU time (0: off)")
    p.add_argument("--json", help="also write both sides' raw results here")
    p.add_argument("--_role", help=argparse.SUPPRESS)
    p.add_argument("--_work", help=argparse.SUPPRESS)
    p.add_argument("--_args", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a._role:  # a child: the arguments come resolved from the parent
        ns = argparse.Namespace(**json.loads(a._args))
        work = Path(a._work)
        res = (run_ours if a._role == "ours" else run_trl)(ns, work)
        (work / f"{a._role}.json").write_text(json.dumps(res))
        return
    preset = PRESETS[a.model]
    for k, v in preset.items():
        if getattr(a, k, None) is None:
            setattr(a, k, v)
    if a.mini is None:
        a.mini = a.batch
    a.micro = min(a.micro, a.mini)
    a.fwd_micro = min(a.fwd_micro, a.batch)
    if a.batch % a.mini or a.mini % a.micro or a.batch % a.fwd_micro:
        raise SystemExit("need --batch % --mini == 0, --mini % --micro == 0, --batch % --fwd-micro == 0")
    if a.warmup < 1:
        raise SystemExit("--warmup must be >= 1 (first-step allocations and lazy init)")
    if not a.skip_trl and not Path(a.trl_python).exists():
        raise SystemExit(f"{a.trl_python} not found: create the TRL environment (see this file's "
                         f"docstring) or pass --skip-trl / --trl-python")
    ours = trl = None

    def best(old, new):  # the round with the lowest mean step time
        key = lambda r: _mean([x["step"] for x in r["steps"]])  # noqa: E731
        return new if old is None or key(new) < key(old) else old

    for r in range(a.rounds):  # sides alternate, so both see the same machine load
        with tempfile.TemporaryDirectory(prefix="bench_ppo_") as tmp:
            work = Path(tmp)
            print(f"round {r + 1}/{a.rounds}: ours ({a.model}) ...", flush=True)
            ours = best(ours, _child(sys.executable, "ours", a, work))
            if not a.skip_trl:
                print(f"round {r + 1}/{a.rounds}: trl ...", flush=True)
                trl = best(trl, _child(a.trl_python, "trl", a, work))
    report(a, ours, trl)
    if a.json:
        Path(a.json).write_text(json.dumps({"args": vars(a), "ours": ours, "trl": trl}, indent=2))


if __name__ == "__main__":
    main()
