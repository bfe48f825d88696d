"""The recipe's ``<out>/summary.json`` and its printed before / after table
(:func:`report`), or the summary of a run the RM gate refused (:func:`refused`); moved out of
:mod:`launchers.recipe`, which runs the stages."""

from __future__ import annotations

import json
from pathlib import Path

import launchers.gates as gates
import launchers.stages as stages


def count_rows(path: Path) -> int:
    return sum(1 for line in path.read_text().splitlines() if line.strip()) if path.is_file() else 0


def refused(a, out: Path, data: Path, sft, gate: "gates.GateResult", pair_counts: dict, clock, stage_args: list,
             logs: Path, sft_rounds=()) -> None:
    """The RM gate refused PPO: ``<out>/summary.json`` with the gate, the defaults picked and,
    when SFT came first, the SFT model's greedy held-out exact match (one ``nemo_rlhf.evaluate``
    of it: PPO's step-0 evaluation never ran) and its rounds (``sft_rounds``: still rising at
    the cap says more SFT may help)."""
    summary = {"rm_gate": gate.fields, "rm_pairs": pair_counts, "ppo": "not started (RM gate)",
               "exit_status": gates.RM_GATE_EXIT, "defaults": a.defaults,
               "rm_heldout_sizing": getattr(a, "rm_heldout_sizing", None)}
    if sft is not None:
        ev = stages.evaluate_checkpoint(Path(sft), data, out / "sft_eval.json", logs / "eval.log", *stage_args,
                                        "num_examples=0")
        summary["sft_heldout"] = gates.sft_heldout(ev["accuracy"], ev.get("num_responses") or
                                                   count_rows(data / "eval.jsonl"))
        summary["sft_rounds"] = list(sft_rounds)
        print(summary["sft_heldout"]["line"], flush=True)
    summary.update({"wall_time_s": {k: round(v, 1) for k, v in clock.times.items()},
                    "wall_time_s_kept": clock.kept})
    (out / "summary.json").write_text(json.dumps(summary, indent=2))


def report(a, task, profile, out, ppo_exp, rm_exp, rm, policy, ckpt, sft, probe_acc, right, n_samples,
            baseline, final, pair_counts, rounds, clock, original=None, ppo_step=None, gate=None,
            n_heldout=0, sft_rounds=()) -> int:
    """``<out>/summary.json`` and the printed before / after table. ``baseline`` is PPO's
    starting policy at step 0 (the SFT model when ``sft``, else the original model);
    ``original``: the original model's held-out evaluation when SFT came first (else None);
    ``gate``: the RM gate's fields; ``n_heldout``: the held-out problems (eval.jsonl rows).
    The summary's ``verdict`` (:func:`launchers.gates.ppo_verdict`), ``rm_gate``,
    ``sft_heldout`` (SFT first: its greedy held-out exact match with its interval) and
    ``defaults`` (:func:`launchers.recipe.picked`) are printed too."""
    # the RM PPO took: the first (rm_exp), or a later round's (rm_more<N>) when the RM continued
    taken = Path(str(rm)).parents[1] if gate and gate.get("more_rm_rounds") else rm_exp
    rm_acc = stages.rm_accuracy(taken)
    rm_same_form = stages.rm_accuracy(taken, "val_same_form/accuracy")
    kl = stages.kl_summary(ppo_exp)
    fmt = task.extra_checkers[0] if task.extra_checkers else None
    default = a.task == "smollm2"
    summary = {
        "task": "smollm2 two-digit addition" if default else task.name, "reward": a.reward,
        **({} if default else {"model": profile.name, "sft_first": sft is not None,
                               "initial_sample_accuracy": probe_acc,
                               "rm_sample_accuracy": right / n_samples if n_samples else None}),
        "baseline_model": "sft" if sft is not None else "original",
        **({} if original is None else {
            "original_accuracy": original["accuracy"],
            "original_mean_response_length": original.get("mean_response_length"),
            **({} if fmt is None else {"original_format_compliance": original.get(fmt)})}),
        "baseline_accuracy": baseline["accuracy"], "ppo_accuracy": final["accuracy"],
        **({} if task.env is None else {"env": task.env, "baseline_episode": baseline.get("episode"),
                                        "ppo_episode": final.get("episode"),
                                        **({} if original is None else {"original_episode": original.get("episode")})}),
        "improvement_points": 100 * (final["accuracy"] - baseline["accuracy"]),
        **({} if fmt is None and not default else {
            "baseline_format_compliance": baseline.get(fmt), "ppo_format_compliance": final.get(fmt)}),
        "baseline_mean_response_length": baseline.get("mean_response_length"),
        "ppo_mean_response_length": final.get("mean_response_length"),
        "rm_pairs": pair_counts, "rm_heldout_sizing": getattr(a, "rm_heldout_sizing", None),
        "rm_heldout_pair_accuracy": rm_acc,
        "rm_heldout_same_form_accuracy": rm_same_form, **kl,
        "heldout_accuracy_by_step": stages.metric_by_step(ppo_exp, "eval/accuracy"),
        "kl_mean_by_step": stages.metric_by_step(ppo_exp, "kl_mean"),
        "reward_auc_by_step": stages.metric_by_step(ppo_exp, "eval/reward_auc"), "refresh_rounds": rounds,
        "wall_time_s": {k: round(v, 1) for k, v in clock.times.items()}, "wall_time_s_kept": clock.kept,
        "checkpoints": {"policy_init": str(ckpt), **({"sft": str(sft)} if sft is not None else {}),
                        "rm": str(rm), "first_rm": str(stages.latest_checkpoint(rm_exp)),
                        "ppo": str(stages.latest_checkpoint(ppo_exp))},
        "tensorboard": str(ppo_exp / "tensorboard"),
    }
    summary["verdict"] = gates.ppo_verdict(
        gates.heldout_correct(ppo_exp, 0), None if ppo_step is None else gates.heldout_correct(ppo_exp, ppo_step),
        kl, summary["reward_auc_by_step"], before_accuracy=baseline["accuracy"], after_accuracy=final["accuracy"],
        reward_by_step=stages.metric_by_step(ppo_exp, "reward_raw_mean"), reward_is_checker=a.reward == "checker")
    summary["rm_gate"] = gate
    if sft is not None:
        summary["sft_heldout"] = gates.sft_heldout(baseline["accuracy"], baseline.get("num_responses") or n_heldout)
        summary["sft_rounds"] = list(sft_rounds)
    summary["defaults"] = getattr(a, "defaults", {})
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    print("\n=== before / after PPO (held-out, greedy" + (f", episodes with {task.env}" if task.env else "") + ") ===")
    for before, after in zip(baseline["examples"], final["examples"]):
        print(f"{before['prompt']!r}\n   before: {before.get('episode') or before['response']!r} "
              f"({before['correct']:.0f})\n   after : {after.get('episode') or after['response']!r} "
              f"({after['correct']:.0f})")
    title = "SmolLM2-135M-Instruct, two-digit addition" if default else f"{profile.name} model, task {task.name}"
    print(f"\n=== demo summary ({title}) ===")
    if sft is not None:
        print(f"SFT first (the model got 0 sampled answers right): {right}/{n_samples} right after SFT")
    label = (fmt or "").replace("_", " ")
    rows = [("original model (before SFT)", original, None)] if original is not None else []
    rows += [("SFT model (PPO's start, step 0)" if sft is not None else "original model (PPO's start, step 0)",
              baseline, None),
             (f"PPO policy (step {ppo_step})" if ppo_step is not None else "PPO policy",
              final, f"{summary['improvement_points']:+.1f} points over PPO's start")]
    width = max(len(name) for name, _, _ in rows)
    print("held-out accuracy (greedy, the task's checker" + (f"; with the tool: episodes with {task.env}, the "
                                                           f"final answer checked" if task.env else "") + "):")
    for name, ev, note in rows:
        notes = [n for n in (note, f"format: {label} {100 * ev.get(fmt, 0):.1f}%" if fmt else None,
                             f"mean length {ev['mean_response_length']:.1f} tokens"
                             if ev.get("mean_response_length") is not None else None, stages.episode_note(ev)) if n]
        print(f"  {name:<{width}} : {100 * ev['accuracy']:5.1f}% ({'; '.join(notes)})")
    if rm is None:
        print("RM                          : none (a tool task with --reward checker: PPO's reward is the checker)")
    else:
        print(f"RM held-out pair accuracy   : {'n/a' if rm_acc is None else f'{100 * rm_acc:.1f}%'} "
              f"({pair_counts['train']} training pairs); same-form pairs (right vs wrong answer, same "
              f"wording): {'n/a' if rm_same_form is None else f'{100 * rm_same_form:.1f}%'}")
    print(f"final kl_mean (nats/seq)    : {stages.kl_line(kl)}")
    if a.reward != "checker":  # the checker's own AUC is 1 by construction
        stages.print_reward_auc(summary["reward_auc_by_step"])
    stages.print_rounds(rounds)
    if sft is not None:
        print(summary["sft_heldout"]["line"])
    print(summary["verdict"]["line"])
    print(clock.line())
    print(f"TensorBoard: tensorboard --logdir {ppo_exp / 'tensorboard'}")
    return 0
