"""The demo pipelines behind ``make demo``: RLHF on a real model (default) or on a tiny one.

    python -m launchers.demo [--task smollm2|tiny|calc|package.module:TASK] [--model smollm2|tiny]
                             [--out DIR] [--nproc 1] [-- <extra PPO overrides>]

``--task package.module:TASK``: the recipe below on your own verifiable task, a
:class:`nemo_rlhf.tasks.task.Task` (prompts, a checker, optionally an answer-edit rule and a
demonstration writer; docs/tasks.md), from ``--model``: :mod:`launchers.recipe`. When the
model gets no sampled answer right, the recipe does SFT on the task's demonstrations first.

``--task calc`` (#51): the recipe on the tool task :data:`nemo_rlhf.tasks.calc.TASK` (two-digit
multiplication with a calculator the policy calls, ``env.name=digit_calculator``) with the
tiny model unless ``--model`` says otherwise; with ``--reward rm|both`` its RM is trained on
pairs of whole conversations (the policy's episodes), with ``--reward checker`` none is.
Its samples, SFT gate and held-out evaluations run episodes with the calculator
(docs/tasks.md, "A tool task").

``--task smollm2`` (the default): SmolLM2-135M-Instruct, set up offline from its PyPI
package (``nemo_rlhf/tools/real_model.py``), learns two-digit addition asked through its
chat template ("What is 26+28? Answer with just the number.") with the InstructGPT recipe:
the reward is a learned RM served as its own process; the rule-based checker only labels
the RM's preference pairs and scores the held-out set (the "gold" metric):

1. model set-up (package -> GGUF -> Hugging Face folder -> checkpoint; skipped when done);
2. prompt files (``nemo_rlhf/tasks/addition.py``): fixed held-out 200, RM and PPO sets;
3. RM data: several sampled answers per RM prompt from the model itself, labelled by the
   checker; a right answer against a wrong one of the same prompt is a pair, and
   ``--rm-edit-pairs`` per prompt are a sample against itself with only the stated number
   changed (same wording, right vs wrong sum: the pairs that make the RM score the sum,
   not the form); held-out same-form pairs measure exactly that;
4. RM training from the SmolLM2 backbone (``rm.freeze_layers`` lower layers kept fixed);
5. PPO (``conf/ppo_smollm2.yaml``) against the served RM (``--reward rm``, the default),
   the checker (``--reward checker``) or both (``--reward both``), with held-out evaluation
   every ``trainer.val_check_interval`` steps and the gold-metric guard (``guards.*``: the
   RM's reward rising while the checker's accuracy falls stops the run);
6. optional closed loop (``--refresh-rounds N``): the policy's samples on which the RM
   contradicts the checker become new RM pairs, the RM continues from its checkpoint on
   them and PPO resumes against the refreshed RM (:func:`launchers.stages.refresh_rounds`);
7. before / after: the PPO run's own greedy held-out evaluations of the initial policy
   (step 0) and of the last step (accuracy by the checker, answer-format compliance,
   length), and a table of samples (:func:`launchers.stages.ppo_evaluation`).

``--task tiny`` (about 5 minutes): number reversal taught by a sloppy demonstrator
(``nemo_rlhf/tasks/reversal.py``: the SFT rows copy the number 60% of the time, the
preference pairs always prefer the reversal) on a tiny model trained from scratch: data ->
SFT -> RM (started from the SFT model) -> served RM + PPO -> evaluation. SFT imitates the copy; PPO against the RM
learns the reversal (docs/demo.md, "The tiny demo": 29.5% -> 94.0% held-out on an AVX2 CPU).

Every stage is the project's own entry point run as a subprocess (exactly what a user would
run by hand), and every stage is skipped when its output already exists (rerunning the demo
after an interruption continues where it stopped; the PPO stage auto-resumes). At the end
it prints the baseline and final held-out accuracy, the RM's held-out pair accuracy and the
wall time of each stage, and writes them to ``<out>/summary.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from launchers import stages
from launchers.gates import RM_GATE_EXIT
from launchers.recipe import PROFILES, importable, picked, run_recipe

def run_tiny(a) -> int:
    """The tiny synthetic pipeline (``--task tiny``)."""
    out, data = stages.REPO / (a.out or "experiments/demo"), stages.REPO / (a.data or "data/reversal")
    logs = out / "logs"
    clock = stages.StageTimes(out / "summary.json")

    from nemo_rlhf.tasks.reversal import ReversalTaskConfig, make_reversal_dataset

    try:
        make_reversal_dataset(data, ReversalTaskConfig())
    except FileExistsError as exc:
        raise SystemExit(f"--data: {exc}") from None
    clock.stop("data")

    clock.start()
    if stages.latest_checkpoint(out / "sft") is None:
        stages.run_stage([sys.executable, "-m", "nemo_rlhf.train_sft", "--config-name", "sft_tiny",
                          f"exp_manager.exp_dir={out / 'sft'}",
                          f"data.train_file={data / 'sft.jsonl'}", f"data.val_file={data / 'sft_val.jsonl'}",
                          f"data.tokenizer_dir={data / 'tokenizer'}", f"trainer.precision={a.precision}",
                          *a.sft_overrides], logs / "sft.log")
    sft = stages.latest_checkpoint(out / "sft")
    clock.stop("sft")

    clock.start()

    def train_rm(exp: Path, init_from, train_file: Path, steps, extra=()) -> None:
        stages.run_stage([sys.executable, "-m", "nemo_rlhf.train_rm", "--config-name", "rm_tiny",
                          f"exp_manager.exp_dir={exp}",
                          f"data.train_file={train_file}", f"data.val_file={data / 'preference_val.jsonl'}",
                          f"data.tokenizer_dir={data / 'tokenizer'}", f"trainer.precision={a.precision}",
                          *([f"rm.init_from={init_from}"] if init_from else []),
                          *([f"trainer.max_steps={steps}", f"trainer.val_check_interval={steps}",
                             f"optim.warmup_steps={min(3, steps - 1)}"] if steps else []),
                          *extra, *a.rm_overrides], logs / f"{exp.name}.log")

    if stages.latest_checkpoint(out / "rm") is None:  # from the SFT model, as InstructGPT's RM (sec. 3.5)
        train_rm(out / "rm", sft, data / "preference.jsonl", None)
    rm = stages.latest_checkpoint(out / "rm")
    clock.stop("rm")

    clock.start()
    baseline = stages.evaluate_checkpoint(sft, data, out / "sft_eval.json", logs / "eval.log",
                                          f"precision={a.precision}")
    clock.stop("eval_sft")

    clock.start()
    ppo_exp = out / "ppo"
    ppo_args = [f"exp_manager.init_from={sft}", f"data.train_file={data / 'ppo_prompts.jsonl'}",
                f"data.val_file={data / 'eval.jsonl'}", f"data.tokenizer_dir={data / 'tokenizer'}",
                "reward.normalization=fixed", f"trainer.precision={a.precision}", *a.ppo_overrides]
    base_steps = stages.first_stage_steps(a, stages.ppo_max_steps("ppo_tiny", a.ppo_overrides))
    stages.ppo_stage(ppo_args, rm, ppo_exp, "ppo_tiny", a.nproc, base_steps)
    clock.stop("ppo")

    clock.start()
    rounds = []
    if a.refresh_rounds:
        rounds, rm = stages.refresh_rounds(
            a, out=out, logs=logs, first_rm=rm, ppo_exp=ppo_exp, ppo_args=ppo_args,
            config_name="ppo_tiny", base_steps=base_steps, prompts=data / "ppo_prompts.jsonl",
            base_pairs=data / "preference.jsonl", train_rm=train_rm,
            rm_batch=stages.rm_global_batch(a.rm_overrides), eval_args=[f"precision={a.precision}"])
    clock.stop("refresh")

    clock.start()
    final = stages.evaluate_checkpoint(stages.latest_checkpoint(ppo_exp), data, out / "ppo_eval.json",
                                       logs / "eval.log", f"precision={a.precision}")
    clock.stop("eval_ppo")

    rm_acc = stages.rm_accuracy(rm.parent.parent)
    kl = stages.kl_summary(ppo_exp)
    summary = {
        "sft_accuracy": baseline["accuracy"], "ppo_accuracy": final["accuracy"],
        "improvement_points": 100 * (final["accuracy"] - baseline["accuracy"]),
        "rm_heldout_pair_accuracy": rm_acc, **kl,
        "heldout_accuracy_by_step": stages.metric_by_step(ppo_exp, "eval/accuracy"),
        "reward_auc_by_step": stages.metric_by_step(ppo_exp, "eval/reward_auc"),
        "refresh_rounds": rounds,
        "sft_mean_response_length": baseline.get("mean_response_length"),
        "ppo_mean_response_length": final.get("mean_response_length"),
        "wall_time_s": {k: round(v, 1) for k, v in clock.times.items()}, "wall_time_s_kept": clock.kept,
        "checkpoints": {"sft": str(sft), "rm": str(rm), "first_rm": str(stages.latest_checkpoint(out / "rm")),
                        "ppo": str(stages.latest_checkpoint(ppo_exp))},
        "tensorboard": str(ppo_exp / "tensorboard"),
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    print("\n=== demo summary ===")
    print(f"SFT baseline held-out exact match : {100 * baseline['accuracy']:.1f}%")
    print(f"PPO policy held-out exact match   : {100 * final['accuracy']:.1f}% "
          f"({summary['improvement_points']:+.1f} points)")
    print(f"RM held-out preference accuracy   : "
          f"{'n/a' if rm_acc is None else f'{100 * rm_acc:.1f}%'}")
    print(f"final kl_mean (nats/sequence)     : {stages.kl_line(kl)}")
    stages.print_reward_auc(summary["reward_auc_by_step"])
    stages.print_rounds(rounds)
    print(clock.line())
    print(f"TensorBoard: tensorboard --logdir {ppo_exp / 'tensorboard'}")
    stages.keep_last_checkpoint(a, out)
    return 0


SMOLLM2_RECIPE = {
    "32": {"rm_epochs": 0.6, "ppo": {"optim.lr": 1.0e-5}},
    "bf16-mixed": {"rm_epochs": 1.2, "ppo": {"optim.lr": 3.0e-5, "ppo.num_rollout_samples": 64,
                                             "ppo.global_batch_size": 32}},
}
"""The SmolLM2 demo's settings per precision (docs/demo.md: measured): the RM's passes over its
pairs and the PPO overrides (given before the user's, so theirs win).

bf16-mixed keeps fp32 masters, but the forward runs on bf16 weights, which move only when the
accumulated update passes half a bf16 step (2^-9 to 2^-8 of the weight): at
conf/ppo_smollm2.yaml's lr 1e-5 the policy barely moved in 10 steps (kl_mean 0.72 against
fp32's 5.94 with the same RM), at 3e-5 it moves about as fp32 does at 1e-5. The bf16 RM gets
twice the passes (its steps cost half). bf16 PPO samples 64 rollouts a step instead of the
config's 32, in two optimizer steps of 32 as before: the same number of updates, each on
twice the samples; over five seeds the median gain rose from +22.5 to +31.5 points and the
worst seed from +12.0 to +26.5 (docs/demo.md, "Five seeds of the default").
fp32 keeps 32 (64 is not measured there, and would double its 10-minute PPO stage)."""


def _resolve_demo_precision(precision: str, a=None) -> str:
    """``auto`` resolved once for every stage (:func:`resolve_precision` on the host), printed
    (and recorded in ``a.defaults`` when ``a`` is given and the precision was not chosen)."""
    import torch

    from nemo_rlhf.models.config import resolve_precision

    choice, reason = resolve_precision(precision, torch.device("cpu"))
    print(f"demo precision: {choice} ({reason})", flush=True)
    if a is not None and precision == "auto" and a.task != "tiny":
        picked(a, "precision", choice, f"--precision auto: {reason}")
    return choice


def run_smollm2(a) -> int:
    """The real-model pipeline (``--task smollm2``, the default): the recipe
    (:func:`launchers.recipe.run_recipe`) on two-digit addition and SmolLM2."""
    from nemo_rlhf.tasks.addition import TASK

    return run_recipe(a, TASK, "two_digit_addition", PROFILES["smollm2"])


CALC_TASK = "nemo_rlhf.tasks.calc:TASK"
"""``--task calc``: the tool task (:mod:`nemo_rlhf.tasks.calc`)."""


def run_task(a) -> int:
    """The recipe on the task ``a.task`` names (``package.module:ATTRIBUTE``) with ``a.model``."""
    from nemo_rlhf.tasks.task import load_task

    try:
        task, checker = load_task(a.task)
    except (ValueError, ImportError, AttributeError) as exc:
        raise SystemExit(str(exc)) from None
    importable(a.task)
    return run_recipe(a, task, checker, PROFILES[a.model])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n")[0],
        epilog="Flags are grouped by where they apply. Words after the flags: overrides of the PPO job.")
    ap.add_argument("--task", default="smollm2", metavar="smollm2|tiny|calc|package.module:TASK",
                    help="smollm2: SmolLM2-135M-Instruct on two-digit addition (default); "
                         "tiny: the synthetic demo on a tiny model; calc: the tool task nemo_rlhf.tasks.calc:TASK "
                         "on the tiny model (with --reward checker); package.module:TASK: the recipe on "
                         "your task, a nemo_rlhf.tasks.task.Task (docs/tasks.md), with --model")
    every = ap.add_argument_group("every task")
    every.add_argument("--out", default=None, help="experiment root; relative: to the working directory "
                                                "(default: the repository's experiments/<task>)")
    every.add_argument("--data", default=None, help="dataset folder; relative: to the working directory "
                                                 "(default: the repository's data/addition, data/reversal, "
                                                 "or <out>/data for package.module:TASK)")
    every.add_argument("--nproc", type=int, default=1, help="PPO trainer ranks (torchrun)")
    every.add_argument("--keep-last-checkpoint", action="store_true",
                       help="once the run has finished, each stage (SFT, RM, refresh RMs, PPO) keeps "
                            "only its newest complete checkpoint, the one later stages took and a rerun "
                            "resumes from, if it verifies (docs/tasks.md: SmolLM2, 1.6 GB a checkpoint)")
    every.add_argument("--precision", choices=["32", "bf16-mixed", "auto"], default=None,
                    help="trainer.precision of every stage (samples, RM, RM server, PPO, evaluation), "
                         "resolved once here; auto (the SmolLM2 model's default): bf16-mixed where the CPU "
                         "has bf16 instructions that torch uses (AMX or AVX-512 BF16; a CUDA GPU with bf16), "
                         "and with it the bf16 recipe (SMOLLM2_RECIPE). "
                         "The tiny model's default: 32. Log-probs, KL, advantages and losses stay fp32 either way")
    ap.add_argument("ppo_overrides", nargs="*", help="extra Hydra overrides for the PPO job (a relative "
                                                     "path in one: to the working directory)")
    recipe = ap.add_argument_group("the recipe (--task smollm2 and --task package.module:TASK)")
    recipe.add_argument("--reward", choices=["rm", "checker", "both"], default="rm",
                        help="PPO reward from the served RM (default; the checker only labels its pairs and "
                             "evaluates), the rule-based checker, or their sum (docs/demo.md: measured); "
                             "--task tiny: always the RM")
    recipe.add_argument("--rm-prompts", type=int, default=256, help="prompts sampled for RM pairs")
    recipe.add_argument("--rm-samples-per-prompt", type=int, default=4, help="answers sampled per RM prompt")
    recipe.add_argument("--rm-temperature", type=float, default=0.7,
                        help="sampling temperature of the RM data (and, every task, of the refresh rounds' samples)")
    recipe.add_argument("--rm-epochs", type=float, default=None,
                        help="passes over the RM pairs (may be fractional; default: the SmolLM2 model's "
                             "precision recipe, SMOLLM2_RECIPE; the tiny model's 0.6)")
    recipe.add_argument("--rm-edit-pairs", type=int, default=4,
                        help="minimal pairs per RM prompt that differ only in the stated answer "
                             "(Task.edit_answer; addition: the number); 0 = only natural pairs")
    recipe.add_argument("--rm-val-prompts", type=int, default=64,
                        help="prompts whose samples are the RM's held-out pairs")
    recipe.add_argument("--ppo-prompts", type=int, default=4096,
                        help="PPO prompts at most (the rest of the train problems)")
    recipe.add_argument("--rm-min-heldout-pairs", type=int, default=20,
                        help="the RM gate: fewer natural held-out pairs than this and the RM's accuracy "
                             "is not measured well enough to train against (launchers/gates.py)")
    recipe.add_argument("--rm-heldout-sample-rounds", type=int, default=3,
                        help="while the natural held-out pairs are fewer than --rm-min-heldout-pairs, sample "
                             "new held-out RM prompts (unused Task.train problems, then Task.generate's), at "
                             "most this many more rounds (0: never; launchers/rm_heldout.py)")
    recipe.add_argument("--rm-heldout-max-prompts", type=int, default=None,
                        help="the budget of those rounds: held-out RM prompts in all, the first "
                             "--rm-val-prompts included (default: 8 x --rm-val-prompts)")
    recipe.add_argument("--rm-more-rounds", type=int, default=2,
                        help="while the RM gate would refuse the RM, continue it for as many steps again, "
                             "at most this many rounds, stopping when a round does not raise its held-out "
                             "pair accuracy (0: never)")
    recipe.add_argument("--force", action="store_true",
                        help="start PPO even when the RM gate refuses (its held-out pair accuracy's 95%% "
                             "interval includes 50%%, too few held-out pairs, or its right-vs-wrong AUC on the "
                             f"policy's held-out samples not above 0.5; exit status {RM_GATE_EXIT})")
    smollm2 = ap.add_argument_group("the SmolLM2 model's RM (--task smollm2, or --task package.module:TASK "
                                    "--model smollm2)")
    smollm2.add_argument("--rm-lr", type=float, default=1.0e-4, help="peak learning rate of the RM")
    smollm2.add_argument("--rm-freeze-layers", type=int, default=10,
                         help="lower transformer layers of the RM kept at the pretrained weights")
    custom = ap.add_argument_group("--task package.module:TASK only")
    custom.add_argument("--model", choices=sorted(PROFILES), default=None,
                        help="the model the recipe starts from: smollm2 (default) or tiny (random weights "
                             "and a character tokenizer: it learns by SFT first)")
    custom.add_argument("--sft-steps", type=int, default=None,
                        help="SFT steps when the model gets no sampled answer right "
                             "(default: the model profile's, launchers/recipe.py)")
    custom.add_argument("--sft-more-rounds", type=int, default=2,
                        help="after SFT, continue it for --sft-steps more steps while each round raises its "
                             "greedy exact match on the held-out RM prompts, at most this many rounds (0: never)")
    custom.add_argument("--sft-rows", type=int, default=2000,
                        help="demonstrations (Task.demonstrate) of the PPO prompts for that SFT")
    custom.add_argument("--model-seed", type=int, default=0, help="--model tiny: seed of the random initial weights")
    tiny = ap.add_argument_group("--task tiny only")
    every.add_argument("--sft-override", dest="sft_overrides", action="append", default=[],
                       metavar="KEY=VALUE", help="a Hydra override of the SFT job(s), after the recipe's own "
                                                 "(repeatable; --task tiny: its SFT; the recipe: the SFT it runs "
                                                 "when the model gets no sampled answer right, every round; a "
                                                 "relative path in it: to the working directory, where every "
                                                 "stage runs)")
    tiny.add_argument("--rm-override", dest="rm_overrides", action="append", default=[],
                      metavar="KEY=VALUE", help="a Hydra override of the RM job(s) (repeatable; paths as in "
                                                "--sft-override)")
    refresh = ap.add_argument_group("the refresh rounds (every task; needs the RM reward)")
    refresh.add_argument("--refresh-rounds", type=int, default=0,
                         help="rounds of bad-case replay after PPO: the policy's samples on which the RM "
                              "contradicts the checker become new RM pairs, the RM continues from its "
                              "checkpoint on them, PPO resumes against the refreshed RM")
    refresh.add_argument("--refresh-ppo-steps", type=int, default=None,
                         help="PPO steps after each refresh (default: trainer.max_steps split evenly over "
                              "the rounds + 1 stages, so the PPO total stays trainer.max_steps)")
    refresh.add_argument("--refresh-prompts", type=int, default=128,
                         help="PPO prompts the policy answers for each refresh")
    refresh.add_argument("--refresh-heldout-prompts", type=int, default=128,
                         help="PPO prompts after --refresh-prompts that the policy also answers and no round "
                              "trains on: the labeller's pairs of those answers check the refreshed RM")
    refresh.add_argument("--refresh-min-gain", type=float, default=0.05,
                         help="the refreshed RM replaces the current one only if it is right on that many more "
                              "of the check pairs (0.05 = 5 points); otherwise PPO continues against the current "
                              "RM; negative: always replace (unchecked)")
    refresh.add_argument("--refresh-samples-per-prompt", type=int, default=4,
                         help="sampled answers per refresh prompt (at --rm-temperature)")
    refresh.add_argument("--refresh-pairs-per-prompt", type=int, default=2,
                         help="disagreement pairs (and, for the recipe's tasks with Task.edit_answer, "
                              "same-wording edits) kept per prompt")
    refresh.add_argument("--refresh-rm-steps", type=int, default=None,
                         help="RM steps of each refresh, continuing the RM (default: --refresh-rm-epochs "
                              "passes over the round's new + replayed pairs)")
    refresh.add_argument("--refresh-rm-epochs", type=float, default=2.0,
                         help="passes over the round's RM data when --refresh-rm-steps is not given")
    refresh.add_argument("--refresh-replay", type=float, default=1.0,
                         help="old pairs replayed per new pair in each refresh (against forgetting)")
    a = ap.parse_args(argv)
    for flag in ("out", "data"):  # the user's paths are theirs: relative to where they ran the demo
        value = getattr(a, flag)
        if value is not None:
            setattr(a, flag, os.path.abspath(os.path.expanduser(value)))
    a.ppo_recipe = []
    a.defaults = {}  # what the recipe picked for the task, with why (launchers.recipe.picked; summary.json)
    if a.task == "calc":  # the tool task's short name: its module path, the tiny model (its digit vocabulary)
        a.task = CALC_TASK
        if a.model is None:
            a.model = "tiny"
            picked(a, "model", "tiny", "--task calc: the digit-vocabulary calculator is the tiny model's")
    custom = a.task not in ("smollm2", "tiny")
    if custom and ":" not in a.task:
        ap.error(f"--task {a.task!r}: give smollm2, tiny or package.module:TASK (a nemo_rlhf.tasks.task.Task)")
    if a.model is not None and not custom:
        ap.error(f"--model applies to --task package.module:TASK; --task {a.task} has its own model")
    if custom and a.model is None:
        picked(a, "model", "smollm2", "--model not given: SmolLM2-135M-Instruct, the demo's model")
    a.model = a.model or "smollm2"
    if a.sft_steps is None and custom:
        picked(a, "sft_steps", PROFILES[a.model].sft_steps, f"the {a.model} profile's (used only when the "
                                                            f"model gets no sampled answer right)")
    a.sft_steps = PROFILES[a.model].sft_steps if a.sft_steps is None else a.sft_steps
    if a.task == "smollm2" or (custom and a.model == "smollm2"):
        a.precision = _resolve_demo_precision(a.precision or "auto", a)
        recipe = SMOLLM2_RECIPE[a.precision]
        if a.rm_epochs is None:
            picked(a, "rm_epochs", recipe["rm_epochs"], f"SMOLLM2_RECIPE[{a.precision}], measured in docs/demo.md")
        a.rm_epochs = recipe["rm_epochs"] if a.rm_epochs is None else a.rm_epochs
        a.ppo_recipe = [f"{key}={value}" for key, value in recipe["ppo"].items()]  # before the user's: theirs win
        picked(a, "ppo_recipe", " ".join(a.ppo_recipe), f"SMOLLM2_RECIPE[{a.precision}]'s PPO overrides, measured "
                                                        f"in docs/demo.md (yours, after them, win)")
    else:
        if a.precision is None and custom:
            picked(a, "precision", "32", "the tiny model's default")
        a.precision = a.precision or "32"
        if a.rm_epochs is None and custom:
            picked(a, "rm_epochs", 0.6, "the tiny model's default")
        a.rm_epochs = 0.6 if a.rm_epochs is None else a.rm_epochs
    if a.refresh_rounds and a.task != "tiny" and a.reward == "checker":
        ap.error("--refresh-rounds refreshes the served RM; it needs --reward rm or both")
    return run_smollm2(a) if a.task == "smollm2" else run_tiny(a) if a.task == "tiny" else run_task(a)


def ppo_config_name(a) -> str:
    """The PPO job's config of the parsed demo arguments ``a`` (``conf/<name>.yaml``)."""
    if a.task == "tiny" or (a.task != "smollm2" and a.model == "tiny"):
        return "ppo_tiny"
    return "ppo_smollm2"


if __name__ == "__main__":
    sys.exit(main())
