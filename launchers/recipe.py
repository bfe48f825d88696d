"""The demo's recipe on any verifiable task (a :class:`nemo_rlhf.tasks.task.Task`):

    python -m launchers.demo --task package.module:TASK [--model smollm2|tiny] [flags] [-- PPO overrides]

``--task smollm2`` (``make demo``) is this recipe on :data:`nemo_rlhf.tasks.addition.TASK`
and the SmolLM2 model profile, exactly as before the recipe took a task (the same stage
commands, prompt files and pairs: tests/unit/project/test_demo_recipe.py). The stages, each
the project's own entry point run as a subprocess and skipped when its output exists:

1. the model: ``smollm2`` (SmolLM2-135M-Instruct set up offline, ``nemo_rlhf.tools.real_model``)
   or ``tiny`` (``conf/model/tiny.yaml`` with random weights and a printable-ASCII character
   tokenizer: a minute on CPU to try a task's wiring; it can only learn a task by SFT);
2. prompt files from the task's problems (:func:`~nemo_rlhf.tasks.task.write_prompt_files`),
   refused at once when the longest prompt plus the response budget does not fit the
   profile's ``data.max_seq_length`` (:func:`launchers.gates.check_prompt_lengths`);
3. RM data: sampled answers of the policy to the RM prompts, labelled by the task's checker;
   a right against a wrong answer of one prompt is a natural pair; ``--rm-edit-pairs`` per
   prompt are counterfactual edits (``Task.edit_answer``). **When no sampled answer is right**
   (no natural pair: the model cannot do the task) the recipe says so and follows
   InstructGPT's order: SFT on ``--sft-rows`` demonstrations (``Task.demonstrate``) first
   (``--sft-override KEY=VALUE``: Hydra overrides of that SFT job, after the profile's),
   then the RM data from the SFT model; a task without demonstrations is refused, naming
   ``Task.demonstrate``. The sizing loops, each with a cap: SFT continues while its greedy
   exact match on the held-out RM prompts improves (``--sft-more-rounds``); new held-out RM
   prompts are sampled while their natural pairs are too few (:mod:`launchers.rm_heldout`:
   ``--rm-heldout-max-prompts``, ``--rm-heldout-sample-rounds``); an RM the gate would refuse continues while its
   held-out pair accuracy improves (``--rm-more-rounds``);
4. the RM, started from the policy (the imported or the SFT model), and the RM gate
   (:func:`launchers.gates.rm_gate`): PPO starts only against an RM whose natural held-out
   pair accuracy has a 95% Wilson interval above 50%, on at least ``--rm-min-heldout-pairs``
   pairs, and (unless ``--reward checker``) whose right-vs-wrong AUC on the policy's sampled
   answers to the held-out RM prompts, scored by it (:func:`_rm_auc_on_heldout_samples`),
   has a 95% Hanley-McNeil interval above 0.5; otherwise the recipe says what to change and
   returns :data:`launchers.gates.RM_GATE_EXIT` (``--force``: PPO anyway);
5. PPO from the policy against the served RM (``--reward``), held-out evaluation at step 0
   and at the end, the gold guard (``guards.*``: the RM's reward rising while the checker's
   accuracy does not); ``kl.target`` scaled by the task's response length
   (:func:`kl_target_for_task`; the default task keeps its config's) and the profile's
   ``kl.type`` (:attr:`ModelProfile.kl_type`: ``pi`` for the tiny model). A tool task
   (``Task.env``, #51): every evaluation runs episodes; with ``--reward rm|both`` the RM is
   trained on pairs of whole conversations (the policy's sampled episodes, the checker on
   their final answers: :func:`nemo_rlhf.tasks.task.build_preference_pairs`) and reads
   PPO's episodes whole, with ``--reward checker`` no RM is trained; the profile's
   ``optim.lr`` for it (:func:`_tool_task_lr_choice`);
6. the before / after table, the verdict (:func:`launchers.gates.ppo_verdict`) and
   ``<out>/summary.json``. Every default picked for the task is printed with its reason
   (:func:`picked`; ``summary.json``'s ``defaults``).

A model profile (:class:`ModelProfile`) holds what depends on the model: its PPO config,
response budget, sequence length, prompt formatting, and how its RM and SFT jobs are called.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import launchers.gates as gates
import launchers.rm_heldout as rm_heldout
import launchers.stages as stages
import launchers.summary as summary
from launchers.stages import REPO


@dataclass(frozen=True)
class ModelProfile:
    """What the recipe's stages need to know about a model."""

    name: str
    """``smollm2`` or ``tiny`` (``--model``)."""
    ppo_config: str
    """The PPO job's config name (``conf/<name>.yaml``)."""
    max_new_tokens: int
    """Response budget (tokens) unless the task sets ``Task.max_new_tokens``."""
    max_seq_length: int
    """``data.max_seq_length`` of the SFT, RM and PPO jobs."""
    sft_steps: int
    """SFT steps when the model cannot do the task (``--sft-steps`` default)."""
    rm_overrides: Callable
    """``(a, exp, init_from, train_file, steps, rm_data, tokenizer_dir, profile) -> [overrides]``."""
    sft_overrides: Callable
    """``(a, exp, init_from, sft_data, steps, tokenizer_dir, profile) -> [overrides]``."""
    ppo_overrides: tuple = ()
    """Fixed overrides of the PPO job beyond the config (before the user's)."""
    kl_reference_length: float = 0.0
    """Mean response length (tokens) of the task the PPO config's ``kl.target`` was measured
    on: :func:`kl_target_for_task` scales the target by a task's length over this one
    (0: not measured; the config's target is kept)."""
    kl_type: Optional[str] = None
    """``kl.type`` the recipe gives its PPO job on a task it was not tuned on (None: the
    config's; the default task keeps its config's either way; the user's override wins)."""
    tool_task_lr: Optional[float] = None
    """``optim.lr`` the recipe gives its PPO job on a tool task (``Task.env``; None: the
    config's; the user's ``optim.lr=`` override wins): :func:`_tool_task_lr_choice`."""
    chat_template: Optional[str] = None
    """``data.chat_template`` of its SFT, RM and PPO jobs (None: the prompt as written)."""
    system_prompt: Optional[Callable[[], str]] = None
    """``() -> data.system_prompt`` of those jobs (None: no system message)."""


def _smollm2_rm(a, exp, init_from, train_file, steps, rm_data, tok, profile) -> list[str]:
    return stages.smollm2_rm_overrides(a, exp, init_from, train_file, steps, rm_data, tok)


def _smollm2_sft(a, exp, init_from, sft_data: Path, steps: int, tok, profile) -> list[str]:
    """SmolLM2's SFT job: from the imported model, the chat template it was tuned with.
    Not measured on SmolLM2 yet (the demo's addition task needs no SFT: 14% right)."""
    return ["model=smollm2_135m", f"exp_manager.exp_dir={exp}", f"sft.init_from={init_from}",
            f"data.train_file={sft_data / 'sft.jsonl'}", f"data.val_file={sft_data / 'sft_val.jsonl'}",
            f"data.tokenizer_dir={tok}", "data.chat_template=chatml",
            f"data.system_prompt='{stages.system_prompt()}'", f"data.max_seq_length={profile.max_seq_length}",
            f"trainer.max_steps={steps}", "trainer.global_batch_size=16", "trainer.micro_batch_size=8",
            f"trainer.val_check_interval={steps}", "optim.lr=1.0e-5", "optim.min_lr=1.0e-6",
            f"optim.warmup_steps={min(3, steps - 1)}", "exp_manager.save_interval=0",
            f"trainer.precision={a.precision}"]


def _tiny_rm(a, exp, init_from, train_file, steps, rm_data, tok, profile) -> list[str]:
    return ["--config-name", "rm_tiny", f"exp_manager.exp_dir={exp}", f"rm.init_from={init_from}",
            f"data.train_file={train_file}", f"data.val_file={rm_data / 'preference_val.jsonl'}",
            f"+rm.extra_val_files.same_form={rm_data / 'same_form_val.jsonl'}",
            f"data.tokenizer_dir={tok}", f"data.max_seq_length={profile.max_seq_length}",
            f"trainer.max_steps={steps}", f"trainer.val_check_interval={steps}",
            f"trainer.log_every_n_steps={max(1, steps // 4)}", f"optim.warmup_steps={min(20, steps - 1)}",
            f"rm.reward_stats_max_pairs={stages.RM_STATS_PAIRS}", f"trainer.precision={a.precision}"]


def _tiny_sft(a, exp, init_from, sft_data: Path, steps: int, tok, profile) -> list[str]:
    return ["--config-name", "sft_tiny", f"exp_manager.exp_dir={exp}", f"sft.init_from={init_from}",
            f"data.train_file={sft_data / 'sft.jsonl'}", f"data.val_file={sft_data / 'sft_val.jsonl'}",
            f"data.tokenizer_dir={tok}", f"data.max_seq_length={profile.max_seq_length}",
            f"trainer.max_steps={steps}", f"trainer.val_check_interval={steps}",
            f"trainer.log_every_n_steps={max(1, steps // 4)}", f"optim.warmup_steps={min(20, steps - 1)}",
            f"trainer.precision={a.precision}"]


PROFILES = {
    # kl_reference_length: docs/demo.md's measured mean held-out response lengths at PPO's
    # start: SmolLM2 on two-digit addition 14.385 tokens (target 6), the tiny demo's
    # reversal 5.05 tokens (conf/ppo_tiny.yaml's target 1.0)
    "smollm2": ModelProfile("smollm2", "ppo_smollm2", stages.SMOLLM2_MAX_NEW_TOKENS, 96, 50,
                            _smollm2_rm, _smollm2_sft, kl_reference_length=14.385, chat_template="chatml",
                            system_prompt=stages.system_prompt),
    # kl_type pi: conf/ppo_tiny.yaml's adaptive rule (horizon 2000) moves beta at most 0.64% a
    # step at 64 rollouts; at a target below what the policy reaches it let kl_mean run 2.7x
    # the target (0.82 at 0.3) where pi held 1.3x (docs/algorithms.md, "The pi KL controller"),
    # and issue 53's sorting run ended at 2.89x; at the tiny demo's own target pi changed nothing
    # tool_task_lr 1e-5: on calc, PPO at conf/ppo_tiny.yaml's 1e-4 lost held-out accuracy
    # (docs/tasks.md, "Why PPO does not fix the copy errors"); at 1e-5 it kept it
    "tiny": ModelProfile("tiny", "ppo_tiny", 8, 64, 600, _tiny_rm, _tiny_sft,
                         ("reward.normalization=fixed", "guards.gold_window=1"), kl_reference_length=5.05,
                         kl_type="pi", tool_task_lr=1.0e-5),
}
"""``--model`` -> profile."""


def picked(a, key: str, value, reason: str) -> None:
    """Record and print a default the recipe picked for the task (``a.defaults``, written to
    ``summary.json``'s ``defaults``): ``default: key = value (reason)``."""
    if not hasattr(a, "defaults"):
        a.defaults = {}
    a.defaults[key] = {"value": value, "reason": reason}
    print(f"default: {key} = {value} ({reason})", flush=True)


def config_kl_target(config_name: str) -> float:
    """``kl.target`` of ``conf/<config_name>.yaml`` (over its parents), else the schema's
    (:class:`nemo_rlhf.trainers.ppo.config.KLConfig`)."""
    kl = stages._composed(config_name).get("kl") or {}
    if kl.get("target") is not None:
        return float(kl["target"])
    from nemo_rlhf.trainers.ppo.config import KLConfig

    return float(KLConfig().target)


def kl_target_for_task(config_target: float, task_length: float, reference_length: float) -> float:
    """The KL target (nats per sequence) for a task whose responses are ``task_length``
    tokens long on average, when ``config_target`` was measured on responses of
    ``reference_length``: the per-token budget kept, ``config_target * task_length /
    reference_length`` (a sequence's KL is a sum over its tokens), rounded to 0.01 and at
    least 0.01. Raises ``ValueError`` on a non-positive reference length."""
    if reference_length <= 0:
        raise ValueError(f"kl_target_for_task: reference_length={reference_length}: must be > 0")
    return max(0.01, round(config_target * max(task_length, 1.0) / reference_length, 2))


def _kl_target_choice(a, profile: ModelProfile, samples: list[dict], default: bool) -> list[str]:
    """The ``kl.target`` override of the PPO job ([] to keep the config's), recorded with
    its reason (:func:`picked`). The demo's default task keeps the config's target (the one
    docs/demo.md measured); another task's is scaled by its responses' mean length (the
    PPO-start policy's RM samples) over the profile's ``kl_reference_length``; the user's
    ``kl.target=`` override wins either way."""
    base = config_kl_target(profile.ppo_config)
    user = [o for o in a.ppo_overrides if o.startswith("kl.target=")]
    if user:
        picked(a, "kl.target", user[-1].split("=", 1)[1], "your override")
        return []
    if default:
        picked(a, "kl.target", base, f"conf/{profile.ppo_config}.yaml's, the target docs/demo.md measured "
                                     f"on this task ({profile.kl_reference_length:g} tokens a response)")
        return []
    lengths = [float(r["length"]) for r in samples if r.get("length") is not None]
    if not lengths or profile.kl_reference_length <= 0:
        why = "the samples recorded no lengths" if not lengths else "the profile names no kl_reference_length"
        picked(a, "kl.target", base, f"conf/{profile.ppo_config}.yaml's ({why})")
        return []
    mean = sum(lengths) / len(lengths)
    target = kl_target_for_task(base, mean, profile.kl_reference_length)
    picked(a, "kl.target", target, f"nats per sequence: conf/{profile.ppo_config}.yaml's {base:g} measured at "
                                   f"{profile.kl_reference_length:g} tokens a response, scaled to this task's "
                                   f"{mean:.1f} (mean length of the policy's {len(lengths)} RM samples)")
    return [f"kl.target={target}"]


def _kl_type_choice(a, profile: ModelProfile, default: bool) -> list[str]:
    """The ``kl.type`` override of the PPO job ([]: the config's), recorded with its reason
    (:func:`picked`): the profile's :attr:`ModelProfile.kl_type` on a task other than the
    default one; the user's ``kl.type=`` override wins (it comes later on the command line)."""
    user = [o for o in a.ppo_overrides if o.startswith("kl.type=")]
    if default or profile.kl_type is None:
        return []
    if user:
        picked(a, "kl.type", user[-1].split("=", 1)[1], "your override")
        return []
    picked(a, "kl.type", profile.kl_type, f"the {profile.name} profile's: one update a PPO step, so beta can follow "
                                          f"a kl.target scaled to this task within the run (conf/{profile.ppo_config}"
                                          f".yaml's adaptive rule is tuned to the demo's task; docs/algorithms.md)")
    return [f"kl.type={profile.kl_type}"]


def _tool_task_lr_choice(a, profile: ModelProfile, task) -> list[str]:
    """The ``optim.lr`` override of the PPO job on a tool task (``Task.env``; [] elsewhere,
    or when the profile names no :attr:`ModelProfile.tool_task_lr`), recorded with its reason
    (:func:`picked`); the user's ``optim.lr=`` override wins (it comes later on the command
    line). Measured on the tiny model's calc task only (docs/tasks.md, "Why PPO does not fix
    the copy errors"): after SFT on demonstrations the errors left are systematic (the same
    result miscopied in most samples), so the checker's reward has little to reinforce and
    PPO's updates at the config's learning rate were mostly noise that cost accuracy."""
    if task.env is None or profile.tool_task_lr is None:
        return []
    user = [o for o in a.ppo_overrides if o.startswith("optim.lr=")]
    if user:
        picked(a, "optim.lr", user[-1].split("=", 1)[1], "your override")
        return []
    base = float(stages._composed(profile.ppo_config)["optim"]["lr"])
    picked(a, "optim.lr", profile.tool_task_lr,
           f"the {profile.name} profile's for a tool task, not conf/{profile.ppo_config}.yaml's {base:g}: after SFT a "
           f"tool task's errors are systematic (calc: the problems the SFT model gets wrong were right in 2-7% of "
           f"sampled episodes), so the checker's reward has little to reinforce; on calc, PPO at {base:g} lowered "
           f"its own sampled reward (0.88-0.91 over the last 10 steps, 0.96 at lr 0) and the held-out accuracy "
           f"(8 runs of 8, mean -1.9 points); at {profile.tool_task_lr:g}, 7 runs: mean -0.2 points (docs/tasks.md, "
           f"\"Why PPO does not fix the copy errors\")")
    return [f"optim.lr={profile.tool_task_lr}"]


def prepare_model(profile: ModelProfile, out: Path, seed: int) -> dict:
    """``{"checkpoint", "tokenizer_dir"}`` of the initial policy: SmolLM2 set up offline, or
    the tiny model's random weights written by ``python -m launchers.recipe init-tiny``."""
    if profile.name == "smollm2":
        from nemo_rlhf.tools.real_model import SetupError, setup

        try:
            return setup(REPO / "models" / "smollm2")
        except SetupError as exc:
            raise SystemExit(f"model set-up failed: {exc}") from None
    folder = out / "model"
    ckpt = folder / "checkpoints" / "step_0"
    if stages.latest_checkpoint(folder) is None:
        stages.run_stage([sys.executable, "-m", "launchers.recipe", "init-tiny", str(folder), str(seed)],
                         out / "logs" / "model.log")
    return {"checkpoint": str(ckpt), "tokenizer_dir": str(ckpt / "tokenizer")}


def importable(spec: str) -> None:
    """Put the folder the task's module came from on ``PYTHONPATH``, so the stages (other
    processes, run from the repository) import it too."""
    module_name = spec.partition(":")[0]
    module = sys.modules.get(module_name)
    path = Path(getattr(module, "__file__", "") or "")
    if not path.is_file():
        return
    up = len(module_name.split(".")) - (0 if path.name == "__init__.py" else 1)
    root = str(path.resolve().parents[up])
    paths = os.environ.get("PYTHONPATH", "").split(os.pathsep)
    if root not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join([root, *[p for p in paths if p]])


def _sample(a, policy, prompts: Path, out_stem: Path, seed: int, stage_args: list, log: Path) -> list[dict]:
    """``a.rm_samples_per_prompt`` answers per prompt at ``a.rm_temperature``, labelled by the
    checker (``nemo_rlhf.evaluate``), written once to ``<out_stem>.jsonl``; its rows."""
    samples = out_stem.with_suffix(".jsonl")
    if not samples.exists():
        stages.run_stage([sys.executable, "-m", "nemo_rlhf.evaluate", f"checkpoint={policy}", f"data={prompts}",
                          f"out={out_stem.with_suffix('.json')}", *stage_args, f"temperature={a.rm_temperature}",
                          f"num_samples={a.rm_samples_per_prompt}", f"samples_out={samples}", f"seed={seed}",
                          "num_examples=0", "batch_size=128"], log)
    return _read_rows(samples)


def _read_rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _sft_first(a, task, profile: ModelProfile, out: Path, data: Path, policy, tok, probe: list[dict]) -> Path:
    """SFT on the task's demonstrations (the model got none of ``probe`` right); returns the
    SFT checkpoint. Refuses a task without ``Task.demonstrate``."""
    from nemo_rlhf.tasks.task import demonstration_rows

    n = len(probe)
    print(f"\nthe model cannot do task {task.name!r}: 0 of {n} sampled answers to the RM prompts are "
          f"right, so there is no natural preference pair and PPO would have no right answer to "
          f"reinforce. InstructGPT's order: SFT on demonstrations first, then the RM and PPO.", flush=True)
    if task.demonstrate is None:
        raise SystemExit(f"task {task.name!r}: the model ({profile.name}) got 0 of {n} sampled answers "
                         f"right and the task has no demonstration writer to teach it first: give "
                         f"Task.demonstrate, (prompt, extras) -> a right response, for SFT; or start "
                         f"from a model that gets some answers right")
    sft_data = out / "sft_data"
    if not (sft_data / "sft.jsonl").exists():
        def rows(name, limit):
            try:
                return demonstration_rows(task, _read_rows(data / name)[:limit])
            except ValueError as exc:
                raise SystemExit(str(exc)) from None
        sft_data.mkdir(parents=True, exist_ok=True)
        stages.write_atomic(sft_data / "sft_val.jsonl",
                            "".join(json.dumps(r) + "\n" for r in rows("rm_val_prompts.jsonl", 64)))
        stages.write_atomic(sft_data / "sft.jsonl",
                            "".join(json.dumps(r) + "\n" for r in rows("ppo_prompts.jsonl", a.sft_rows)))
    exp = out / "sft"
    if stages.latest_checkpoint(exp) is None:
        stages.run_stage([sys.executable, "-m", "nemo_rlhf.train_sft",
                          *profile.sft_overrides(a, exp, policy, sft_data, a.sft_steps, tok, profile),
                          *a.sft_overrides], out / "logs" / "sft.log")  # --sft-override: the user's win
    return stages.latest_checkpoint(exp)


def _sft_exact_match(ckpt, data: Path, out_json: Path, stage_args: list, log: Path) -> float:
    """Greedy exact match (the task's checker) of ``ckpt`` on the held-out RM prompts
    (``rm_val_prompts.jsonl``: none of them is an SFT row, those are the PPO prompts), one
    ``nemo_rlhf.evaluate`` written to ``out_json`` and reused for the same checkpoint."""
    if out_json.exists():
        done = json.loads(out_json.read_text())
        if Path(done.get("checkpoint", "")).resolve() == Path(ckpt).resolve():
            return float(done["accuracy"])
    stages.run_stage([sys.executable, "-m", "nemo_rlhf.evaluate", f"checkpoint={ckpt}",
                      f"data={data / 'rm_val_prompts.jsonl'}", f"out={out_json}", *stage_args, "num_examples=0"],
                     log)
    return float(json.loads(out_json.read_text())["accuracy"])


def _sft_until_it_stops_improving(a, profile: ModelProfile, out: Path, data: Path, sft, tok,
                                  stage_args: list) -> tuple:
    """SFT's sizing loop: after the first ``a.sft_steps``, measure the SFT model's greedy
    exact match on the held-out RM prompts (:func:`_sft_exact_match`) and continue SFT
    from it for ``a.sft_steps`` more steps (``<out>/sft_more<N>``) while each round raises
    that exact match, at most ``a.sft_more_rounds`` rounds (the cap; none when it is already
    100%); the best SFT model is PPO's and the RM's start. ``a.sft_more_rounds == 0``: no measurement, ``(sft, [])``.

    Returns ``(the best SFT checkpoint, [{round, steps, exact_match, checkpoint}])`` (round
    0: the first SFT)."""
    if a.sft_more_rounds <= 0:
        return sft, []
    logs, sft_data = out / "logs", out / "sft_data"
    best = sft
    best_em = _sft_exact_match(sft, data, sft_data / "exact_match_0.json", stage_args, logs / "sft_eval.log")
    rounds = [{"round": 0, "steps": a.sft_steps, "exact_match": best_em, "checkpoint": str(sft)}]
    print(f"SFT ({a.sft_steps} steps): greedy exact match {100 * best_em:.1f}% on the held-out RM prompts",
          flush=True)
    if best_em >= 1.0:
        print("100.0%: no round can raise it, SFT stops here", flush=True)
    while len(rounds) - 1 < a.sft_more_rounds and best_em < 1.0:
        n = len(rounds)
        exp = out / f"sft_more{n}"
        if stages.latest_checkpoint(exp) is None:
            stages.run_stage([sys.executable, "-m", "nemo_rlhf.train_sft",
                              *profile.sft_overrides(a, exp, best, sft_data, a.sft_steps, tok, profile),
                              *a.sft_overrides], logs / f"{exp.name}.log")
        ckpt = stages.latest_checkpoint(exp)
        em = _sft_exact_match(ckpt, data, sft_data / f"exact_match_{n}.json", stage_args, logs / "sft_eval.log")
        rounds.append({"round": n, "steps": a.sft_steps, "exact_match": em, "checkpoint": str(ckpt)})
        print(f"SFT round {n} of at most --sft-more-rounds {a.sft_more_rounds} ({a.sft_steps} more steps): "
              f"greedy exact match {100 * em:.1f}%", flush=True)
        if em <= best_em:
            print(f"no better than {100 * best_em:.1f}%: SFT stops here", flush=True)
            break
        best, best_em = ckpt, em
    return best, rounds


def trains_rm(task, a) -> bool:
    """Whether the recipe trains an RM: always, but on a tool task (``Task.env``) with
    ``--reward checker``, where nothing would read it (the RM of a tool task is trained on
    pairs of whole conversations, #51)."""
    return task.env is None or a.reward != "checker"


def _policy_and_rm_data(a, task, profile: ModelProfile, out: Path, data: Path, ckpt, tok, stage_args: list,
                        clock: "stages.StageTimes") -> tuple:
    """Stage 3 (module docstring): the policy the RM data comes from (the model, or the SFT
    model when the model got no sampled answer right) and the RM's pairs. Records on
    ``clock`` (started by the caller) ``first_samples_and_sft`` (with SFT: the original
    model's samples, which showed it cannot do the task, and SFT) and ``rm_samples``.

    Returns:
        ``(policy, sft checkpoint or None, initial sample accuracy (0.0 with SFT, else
        None), the policy's RM training samples, pair counts by file, the SFT rounds of
        :func:`_sft_until_it_stops_improving`)``.
    """
    from nemo_rlhf.tasks.task import build_preference_pairs, count_right

    rm_data, logs = out / "rm_data", out / "logs"
    policy, sft, probe_acc = ckpt, None, None
    initial = rm_data / "initial_samples_train.jsonl"  # the initial model's, when it got none right
    if stages.latest_checkpoint(out / "sft") is None:
        probe = _read_rows(initial) if initial.exists() else _sample(
            a, ckpt, data / "rm_prompts.jsonl", rm_data / "samples_train", 1, stage_args, logs / "rm_samples.log")
        if count_right(probe) == 0:
            probe_acc = 0.0
            if not initial.exists():  # kept: a rerun (e.g. after adding Task.demonstrate) reuses it
                (rm_data / "samples_train.jsonl").rename(initial)
            sft = _sft_first(a, task, profile, out, data, ckpt, tok, probe)
    else:
        sft = stages.latest_checkpoint(out / "sft")
        probe_acc = 0.0
    sft_rounds: list[dict] = []
    if sft is not None:
        sft, sft_rounds = _sft_until_it_stops_improving(a, profile, out, data, sft, tok, stage_args)
        policy = sft
        clock.stop("first_samples_and_sft")
        clock.start()
    samples_train = _sample(a, policy, data / "rm_prompts.jsonl", rm_data / "samples_train", 1, stage_args,
                            logs / "rm_samples.log")
    if trains_rm(task, a):  # not a tool task against the checker (run_recipe): its held-out pairs
        samples_val = _sample(a, policy, data / "rm_val_prompts.jsonl", rm_data / "samples_val", 2, stage_args,
                              logs / "rm_samples.log")
        val_file, a.rm_heldout_sizing = rm_heldout.size_heldout_prompts(
            a, task, rm_data, data, samples_val,
            lambda prompts, stem, seed: _sample(a, policy, prompts, stem, seed, stage_args, logs / "rm_samples.log"),
            lambda rows: len(build_preference_pairs(rows, max_pairs_per_prompt=4)))
    if count_right(samples_train) == 0:
        raise SystemExit(f"task {task.name!r}: after SFT ({a.sft_steps} steps on {a.sft_rows} demonstrations) "
                         f"the model still got 0 of {len(samples_train)} sampled answers right; raise "
                         f"--sft-steps or --sft-rows")
    if sft is not None:
        k, n = count_right(samples_train), len(samples_train)
        print(f"after SFT: {k} of {n} sampled answers to the RM prompts right ({100 * k / n:.1f}%, 95% Wilson "
              f"interval {gates.pct_interval(*gates.wilson_interval(k, n))}; T={a.rm_temperature}); its "
              f"greedy held-out exact match is PPO's step-0 evaluation", flush=True)
    if not trains_rm(task, a):
        clock.stop("rm_samples")
        return policy, sft, probe_acc, samples_train, {"train": 0, "val": 0, "val_same_form": 0}, sft_rounds
    edits = a.rm_edit_pairs if task.edit_answer is not None else 0
    pair_counts = {}
    for split in ("train", "val"):  # held-out: the natural pairs only; the same-form ones are their own file
        pair_counts[split] = stages.pairs_from_samples(
            task, rm_data / "samples_train.jsonl" if split == "train" else val_file,
            rm_data / f"preference_{split}.jsonl", 4, edits if split == "train" else 0)
    pair_counts["val_same_form"] = stages.pairs_from_samples(
        task, rm_data / "samples_val.jsonl", rm_data / "same_form_val.jsonl", 0,
        stages.SAME_FORM_PER_PROMPT if task.edit_answer is not None else 0)
    print(f"RM pairs from the model's own samples: {pair_counts}", flush=True)
    if min(pair_counts["train"], pair_counts["val"]) == 0 or (
            task.edit_answer is not None and pair_counts["val_same_form"] == 0):
        gate = gates.no_pairs_gate(pair_counts, count_right(samples_train), len(samples_train), a)
        print(gate.message, flush=True)
        summary.refused(a, out, data, sft, gate, pair_counts, clock, stage_args, logs, sft_rounds)
        raise SystemExit(gates.RM_GATE_EXIT)
    clock.stop("rm_samples")
    return policy, sft, probe_acc, samples_train, pair_counts, sft_rounds


def _train_rm_until_it_stops_improving(a, rm, accuracy, out: Path, rm_data: Path, steps: int, train_rm,
                                       gate_of) -> tuple:
    """The RM's sizing loop: while the RM gate (``gate_of(accuracy)``) would refuse the RM
    and its natural held-out pairs are enough to measure it, continue the RM from its
    checkpoint for ``steps`` more steps on the same pairs (``<out>/rm_more<N>``), keeping
    the RM with the best held-out pair accuracy; stop when a round does not improve it,
    when the gate passes, or after ``a.rm_more_rounds`` rounds (the cap). An RM that
    passes the gate at once (the default demo's) trains exactly its ``steps``.

    Returns ``(rm checkpoint, its held-out pair accuracy, [{round, steps, accuracy}])``."""
    rounds: list[dict] = []
    best, best_acc = rm, accuracy
    while len(rounds) < a.rm_more_rounds:
        gate = gate_of(best_acc)
        if gate.passed or best_acc is None or gate.fields["natural_heldout_pairs"] < a.rm_min_heldout_pairs:
            break  # passes, or no measurement to improve on (more training cannot add held-out pairs)
        n = len(rounds) + 1
        print(f"the RM's held-out pair accuracy {100 * best_acc:.1f}% does not pass the RM gate: {steps} more "
              f"RM steps (round {n} of at most --rm-more-rounds {a.rm_more_rounds})", flush=True)
        exp = out / f"rm_more{n}"
        if stages.latest_checkpoint(exp) is None:
            train_rm(exp, best, rm_data / "preference_train.jsonl", steps)
        acc = stages.rm_accuracy(exp)
        rounds.append({"round": n, "steps": steps, "heldout_pair_accuracy": acc, "checkpoint":
                       str(stages.latest_checkpoint(exp))})
        if acc is None or acc <= best_acc:
            print(f"round {n}: held-out pair accuracy {'n/a' if acc is None else f'{100 * acc:.1f}%'}, no better: "
                  f"the RM stops here (the best: {100 * best_acc:.1f}%)", flush=True)
            break
        best, best_acc = stages.latest_checkpoint(exp), acc
    return best, best_acc, rounds


def _rm_auc_on_heldout_samples(a, policy, rm, data: Path, rm_data: Path, stage_args: list, logs: Path) -> dict:
    """The RM's right-vs-wrong AUC on what PPO will score (:func:`launchers.gates.rm_auc`):
    the policy's answers to the held-out RM prompts, sampled as the RM's held-out samples were
    (``a.rm_samples_per_prompt`` at ``a.rm_temperature``, seed 2), each scored by the RM
    (``nemo_rlhf.evaluate`` with ``rm_checkpoint``) and labelled by the checker:
    ``<rm_data>/rm_auc_samples.jsonl``, reused while it was scored by the same RM."""
    out_json, rows = rm_data / "rm_auc_samples.json", rm_data / "rm_auc_samples.jsonl"
    done = json.loads(out_json.read_text()) if out_json.exists() else {}
    if not rows.exists() or Path(done.get("rm_checkpoint", "")).resolve() != Path(str(rm)).resolve():
        rows.unlink(missing_ok=True)
        stages.run_stage([sys.executable, "-m", "nemo_rlhf.evaluate", f"checkpoint={policy}",
                          f"data={data / 'rm_val_prompts.jsonl'}", f"out={out_json}", *stage_args,
                          f"temperature={a.rm_temperature}", f"num_samples={a.rm_samples_per_prompt}",
                          f"samples_out={rows}", "seed=2", "num_examples=0", "batch_size=128",
                          f"rm_checkpoint={rm}"], logs / "rm_auc.log")
    return gates.rm_auc(_read_rows(rows))


def run_recipe(a, task, checker: str, profile: ModelProfile) -> int:
    """The recipe (module docstring) on ``task`` (its stages name the checker ``checker``)
    with ``profile``'s model; writes ``<out>/summary.json``; returns 0, or
    :data:`launchers.gates.RM_GATE_EXIT` when the RM gate refused PPO."""
    from nemo_rlhf.tasks.task import count_right, env_overrides, write_prompt_files

    default = a.task == "smollm2"
    out = REPO / (a.out or ("experiments/smollm2" if default else f"experiments/{task.name}"))
    data = REPO / a.data if a.data else (REPO / "data/addition" if default else out / "data")
    logs = out / "logs"
    clock = stages.StageTimes(out / "summary.json")
    py = sys.executable
    new_tokens = f"max_new_tokens={task.max_new_tokens or profile.max_new_tokens}"
    a.defaults = dict(getattr(a, "defaults", {}))  # demo.main's picks (model, precision, SFT steps, RM epochs)
    if task.max_new_tokens is None:
        picked(a, "max_new_tokens", profile.max_new_tokens, f"the {profile.name} profile's response budget "
                                                            f"(the task sets no Task.max_new_tokens)")
    picked(a, "ppo_config", profile.ppo_config, f"the {profile.name} model profile's PPO config")
    if task.max_seq_length is not None and task.max_seq_length != profile.max_seq_length:
        picked(a, "max_seq_length", task.max_seq_length, f"Task.max_seq_length, not the {profile.name} profile's "
                                                          f"{profile.max_seq_length} (data.max_seq_length of SFT, RM, PPO)")
        profile = dataclasses.replace(profile, max_seq_length=task.max_seq_length)
    checkers = [f"checker={checker}",
                *([f"extra_checkers=[{','.join(task.extra_checkers)}]"] if task.extra_checkers else []),
                f"precision={a.precision}", *env_overrides(task)]  # a tool task: every evaluation runs episodes
    gates.refuse_rm_on_tool_task(task, a.reward, a.refresh_rounds)

    clock.start()
    model = prepare_model(profile, out, a.model_seed)
    ckpt, tok = model["checkpoint"], model["tokenizer_dir"]
    clock.stop("model_setup")

    clock.start()
    try:
        write_prompt_files(task, data, n_rm=a.rm_prompts, n_rm_val=a.rm_val_prompts, n_ppo=a.ppo_prompts)
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    budget = task.max_new_tokens or profile.max_new_tokens
    gates.check_prompt_lengths(data, tok, profile, budget, "Task.max_new_tokens" if task.max_new_tokens
                         else f"the {profile.name} profile's")
    clock.stop("data")

    clock.start()
    rm_data = out / "rm_data"
    settings = {
        "rm_prompts": a.rm_prompts, "rm_samples_per_prompt": a.rm_samples_per_prompt,
        "rm_temperature": a.rm_temperature, "rm_edit_pairs": a.rm_edit_pairs,
        "rm_epochs": a.rm_epochs, "rm_freeze_layers": a.rm_freeze_layers, "rm_lr": a.rm_lr,
        "heldout_pairs": "natural", "precision": a.precision}  # before 2026-12-02: natural + same-form in one file
    if not default:  # (the default's settings file predates these keys: it stays as it was)
        settings.update({"task": task.name, "model": profile.name, "rm_val_prompts": a.rm_val_prompts,
                         "sft_steps": a.sft_steps, "sft_rows": a.sft_rows})
    if getattr(a, "rm_heldout_max_prompts", None) is None:
        a.rm_heldout_max_prompts, why = rm_heldout.default_max_prompts(a.rm_val_prompts)
        picked(a, "rm_heldout_max_prompts", a.rm_heldout_max_prompts, why)
    sizing = {"rm_heldout_sample_rounds": a.rm_heldout_sample_rounds, "rm_more_rounds": a.rm_more_rounds,
              "rm_heldout_max_prompts": a.rm_heldout_max_prompts,
              "sft_more_rounds": a.sft_more_rounds,  # the sizing loops' caps: recorded since issue 53
              "sft_override": list(a.sft_overrides)}  # the SFT model is the RM data's policy
    stages.check_stage_settings(rm_data / "settings.json", {**settings, **sizing}, added=tuple(sizing))
    stage_args = [new_tokens, *checkers]
    policy, sft, probe_acc, samples_train, pair_counts, sft_rounds = _policy_and_rm_data(
        a, task, profile, out, data, ckpt, tok, stage_args, clock)
    right = count_right(samples_train)

    rm_exp = out / "rm"
    if not trains_rm(task, a):  # (#51) a tool task against the checker: no RM stage
        rm = train_rm = None
        gate = gates.GateResult(True, "a tool task (Task.env) with --reward checker: no RM is trained; PPO's "
                                "reward is the checker", {"applies": False, "skipped": "tool task: --reward checker"})
    else:
        clock.start()

        def train_rm(exp: Path, init_from: str, train_file: Path, steps: int, extra=()) -> None:
            overrides = [*profile.rm_overrides(a, exp, init_from, train_file, steps, rm_data, tok, profile), *extra]
            if task.edit_answer is None:  # no same-form pairs to validate on
                overrides = [o for o in overrides if not o.startswith("+rm.extra_val_files.same_form=")]
            stages.run_stage([py, "-m", "nemo_rlhf.train_rm", *overrides], logs / f"{exp.name}.log")

        rm_steps = max(1, int(a.rm_epochs * pair_counts["train"] // 16))
        picked(a, "rm_steps", rm_steps, f"--rm-epochs {a.rm_epochs:g} passes over {pair_counts['train']} training "
                                        f"pairs in batches of 16")
        if stages.latest_checkpoint(rm_exp) is None:  # from the policy, as InstructGPT's RM (sec. 3.5)
            train_rm(rm_exp, policy, rm_data / "preference_train.jsonl", rm_steps)
        rm = stages.latest_checkpoint(rm_exp)

        def gate_of(accuracy, auc=None):
            return gates.rm_gate(accuracy, pair_counts["val"], a.rm_min_heldout_pairs, reward=a.reward,
                                 custom_task=not default, has_edit_answer=task.edit_answer is not None,
                                 sft_steps=a.sft_steps if sft is not None else None, a=a, auc=auc)

        rm, rm_accuracy, rm_rounds = _train_rm_until_it_stops_improving(
            a, rm, stages.rm_accuracy(rm_exp), out, rm_data, rm_steps, train_rm, gate_of)
        clock.stop("rm")

        clock.start()
        auc = None if a.reward == "checker" else _rm_auc_on_heldout_samples(a, policy, rm, data, rm_data, stage_args,
                                                                            logs)
        clock.stop("rm_auc")
        gate = gate_of(rm_accuracy, auc)
        gate.fields["more_rm_rounds"] = rm_rounds
        print(gate.message, flush=True)
        if not gate.passed and a.force:
            print("--force: PPO trains against this RM anyway", flush=True)
            gate.fields["forced"] = True
        elif not gate.passed:
            summary.refused(a, out, data, sft, gate, pair_counts, clock, stage_args, logs, sft_rounds)
            return gates.RM_GATE_EXIT

    clock.start()
    ppo_exp = out / "ppo"
    reward = {"rm": [], "checker": ["reward.rm_weight=0", f"reward.functions=[{{name: '{checker}'}}]"],
              "both": [f"reward.functions=[{{name: '{checker}'}}]"]}[a.reward]
    if default:  # the command line of the runs docs/stages.md measured
        reward = {"rm": [], "checker": ["reward.rm_weight=0", "reward.functions=[{name: two_digit_addition}]"],
                  "both": ["reward.functions=[{name: two_digit_addition}]"]}[a.reward]
    task_args = [] if default else [  # the default's command line is the one docs/stages.md measured
        f"trainer.eval_checker='{checker}'", f"trainer.eval_extra_checkers=[{','.join(task.extra_checkers)}]",
        f"data.max_seq_length={profile.max_seq_length}"]
    kl_target = _kl_target_choice(a, profile, samples_train, default)
    kl_type = _kl_type_choice(a, profile, default)
    lr = _tool_task_lr_choice(a, profile, task)
    ppo_args = [f"exp_manager.init_from={policy}", f"data.train_file={data / 'ppo_prompts.jsonl'}",
                f"data.val_file={data / 'eval.jsonl'}", f"data.tokenizer_dir={tok}",
                f"rollout.{new_tokens}", f"trainer.precision={a.precision}", *task_args, *profile.ppo_overrides,
                *kl_type, *kl_target, *lr, *a.ppo_recipe, *reward, *env_overrides(task), *a.ppo_overrides]
    base_steps = stages.first_stage_steps(a, stages.ppo_max_steps(profile.ppo_config, a.ppo_overrides))
    stages.ppo_stage(ppo_args, rm if a.reward != "checker" else None, ppo_exp, profile.ppo_config, a.nproc,
                     base_steps)
    clock.stop("ppo")

    clock.start()
    rounds = []
    if a.refresh_rounds:
        rounds, rm = stages.refresh_rounds(
            a, out=out, logs=logs, first_rm=rm, ppo_exp=ppo_exp, ppo_args=ppo_args,
            config_name=profile.ppo_config, base_steps=base_steps, prompts=data / "ppo_prompts.jsonl",
            base_pairs=rm_data / "preference_train.jsonl", train_rm=train_rm, rm_batch=16,
            eval_args=stage_args, task=task if task.edit_answer is not None else None)
    clock.stop("refresh")

    # before / after: the PPO run's own greedy evaluations of step 0 and of its last step
    # (the held-out set, the same checkers); a separate `nemo_rlhf.evaluate` only when the
    # run did not evaluate (it would repeat the same decoding: 52 s of the 25-minute demo)
    clock.start()
    last = stages.latest_checkpoint(ppo_exp)
    baseline = stages.ppo_evaluation(ppo_exp, 0)
    if baseline is None:
        baseline = stages.evaluate_checkpoint(Path(policy), data, out / "baseline_eval.json", logs / "eval.log",
                                              *stage_args, "num_examples=8")
    ppo_step = int(last.name.split("_")[-1])
    final = stages.ppo_evaluation(ppo_exp, ppo_step)
    if final is None:
        final = stages.evaluate_checkpoint(last, data, out / "ppo_eval.json", logs / "eval.log", *stage_args,
                                           "num_examples=8")
    original = None
    if sft is not None:  # PPO started from the SFT model: the original model's held-out numbers, once
        original = stages.evaluate_checkpoint(Path(ckpt), data, out / "original_eval.json", logs / "eval.log",
                                              *stage_args, "num_examples=0")
    clock.stop("eval")
    code = summary.report(a, task, profile, out, ppo_exp, rm_exp, rm, policy, ckpt, sft, probe_acc, right,
                          len(samples_train), baseline, final, pair_counts, rounds, clock, original, ppo_step,
                          gate=gate.fields, n_heldout=summary.count_rows(data / "eval.jsonl"),
                          sft_rounds=sft_rounds)
    stages.keep_last_checkpoint(a, out)  # the run has finished: nothing later needs the older ones
    return code


def main(argv=None) -> int:
    """``python -m launchers.recipe init-tiny FOLDER SEED``: the tiny profile's random model."""
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 3 or argv[0] != "init-tiny":
        raise SystemExit("usage: python -m launchers.recipe init-tiny FOLDER SEED")
    from launchers.tiny_model import write_tiny_model

    print(f"wrote {write_tiny_model(Path(argv[1]), int(argv[2]))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
