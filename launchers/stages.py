"""The demo's stage machinery, shared by :mod:`launchers.demo` (the tiny pipeline, the
command line) and :mod:`launchers.recipe` (the recipe on a task): running a stage as a
subprocess with its log (:func:`run_stage`), what each stage left behind
(:func:`latest_checkpoint`, :func:`metric_by_step`), the evaluations, the RM pairs and
their settings, the PPO stage and the refresh rounds, the stage timings and the summary
lines. Imports no other launcher module but :mod:`launchers.local` (inside the PPO stage).
"""

from __future__ import annotations

import json
import math
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Optional


REPO = Path(__file__).resolve().parents[1]


_processes_started = 0
"""Stage processes started by this process (:class:`StageTimes` tells a stage that did its
work from one whose outputs existed)."""


def note_process() -> None:
    """Count a stage process as started (:func:`run_stage`, :func:`ppo_stage`)."""
    global _processes_started
    _processes_started += 1


class StageTimes:
    """Wall time (s) of each demo stage, for ``summary.json``'s ``wall_time_s``.

    A stage that started no process (every output it makes existed: a rerun) keeps the time
    the run that did its work recorded, from ``summary``'s previous ``wall_time_s``
    (:attr:`kept` names those stages); without a previous value its own (short) time counts.

    Args:
        summary: ``<out>/summary.json`` (absent or unreadable: nothing to keep).
    """

    def __init__(self, summary: Path):
        self.times: dict[str, float] = {}
        self.kept: list[str] = []
        try:
            self.previous = dict(json.loads(summary.read_text()).get("wall_time_s") or {})
        except (OSError, ValueError, AttributeError):
            self.previous = {}
        self.start()

    def start(self) -> None:
        """A stage starts now."""
        self._t, self._n = time.time(), _processes_started

    def stop(self, name: str) -> None:
        """Stage ``name`` (started by the last :meth:`start`) ends now."""
        if _processes_started == self._n and name in self.previous:
            self.times[name] = float(self.previous[name])
            self.kept.append(name)
        else:
            self.times[name] = time.time() - self._t

    def line(self) -> str:
        """The printed ``wall time (s)`` line, naming the kept stages."""
        text = "wall time (s): " + ", ".join(f"{k} {v:.0f}" for k, v in self.times.items())
        if self.kept:
            text += f" ({', '.join(self.kept)}: kept from the run that did the work; this run skipped them)"
        return text


TERMINATED_EXIT_CODE = 143
"""The demo's exit code when a SIGTERM stopped it during a stage (128 + 15, as a shell reports it)."""


class _SigtermToStage:
    """While entered (main thread only): SIGTERM to this process is forwarded to the running
    stage (:attr:`proc`), which stops its own way (a trainer saves), and :attr:`received` is
    set; without it the default action killed the demo alone and left the stage running. A
    SIGTERM that comes before the stage's process exists is forwarded once it does."""

    def __init__(self) -> None:
        self.proc: Optional[subprocess.Popen] = None
        self.received = False
        self._previous = None

    def __enter__(self) -> "_SigtermToStage":
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        self.received = True
        self.forward()

    def forward(self) -> None:
        """Send SIGTERM to the stage if it runs and one was received."""
        if self.received and self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)

    def __exit__(self, *exc) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)


def run_stage(cmd: list[str], log: Path) -> None:
    """Run a stage in the working directory (as the PPO stage runs: a relative path in an
    override means what it means to the user), tee its output to ``log``; raise with the
    log's tail on failure. A SIGTERM to the demo meanwhile is passed to the stage; once the
    stage has exited, the demo exits with :data:`TERMINATED_EXIT_CODE` and says so (a rerun
    of the same command skips the finished stages and resumes).

    Raises:
        SystemExit: the stage failed (its exit code and ``log`` named), or
            :data:`TERMINATED_EXIT_CODE` after a SIGTERM.
    """
    note_process()
    print(f"$ {' '.join(cmd)}", flush=True)
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "a") as f, _SigtermToStage() as sigterm:
        sigterm.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                        text=True, bufsize=1)
        sigterm.forward()  # a SIGTERM that came before the process existed
        for line in sigterm.proc.stdout:
            f.write(line)
            if "Warning" not in line and "warnings.warn" not in line:
                sys.stdout.write(line)
        code = sigterm.proc.wait()
    if sigterm.received:
        print(f"SIGTERM: passed to the stage, which exited {code}: {' '.join(cmd)}\nsee {log}; "
              f"the same command resumes (finished stages are skipped)", file=sys.stderr, flush=True)
        raise SystemExit(TERMINATED_EXIT_CODE)
    if code != 0:
        raise SystemExit(f"stage failed (exit {code}): {' '.join(cmd)}\nsee {log}")


def prune_finished_stages(out: Path) -> list[str]:
    """``--keep-last-checkpoint``, once the run has finished (every stage done, each later
    stage having loaded what it took): every stage's ``checkpoints/`` folder under ``out``
    keeps only its newest complete checkpoint, which is what every later stage took
    (:func:`latest_checkpoint`) and what a rerun resumes from. A folder is pruned only when that
    checkpoint verifies (:func:`~nemo_rlhf.checkpoint.io.verify_checkpoint`: every file at its
    recorded size and sha256), since it is then the only one left: the jobs themselves refuse
    ``exp_manager.keep_last=1`` for that reason. Incomplete step folders are not touched
    (:func:`~nemo_rlhf.checkpoint.policy.prune_plan`). Returns one line per pruned or kept folder."""
    from nemo_rlhf.checkpoint.layout import find_latest_checkpoint, list_checkpoints, verify_checkpoint
    from nemo_rlhf.checkpoint.policy import prune, prune_plan

    lines = []
    for root in sorted(p for p in out.rglob("checkpoints") if p.is_dir()):
        newest = find_latest_checkpoint(root)
        if newest is None or sum(ok for _, _, ok in list_checkpoints(root)) < 2:
            continue
        problems = verify_checkpoint(newest)
        if problems:
            lines.append(f"{root}: kept every checkpoint, the newest ({newest.name}) does not verify: "
                         f"{problems[0]}")
            continue
        delete, _ = prune_plan(root, 1)
        freed = sum(f.stat().st_size for p, _ in delete for f in Path(p).rglob("*") if f.is_file())
        deleted = prune(root, 1)
        lines.append(f"{root}: kept {newest.name}, deleted {', '.join(p.name for p in deleted)} "
                     f"({freed / 1e9:.2f} GB)")
    return lines


def keep_last_checkpoint(a, out: Path) -> None:
    """:func:`prune_finished_stages` with ``--keep-last-checkpoint``, printed."""
    if getattr(a, "keep_last_checkpoint", False):
        for line in prune_finished_stages(out):
            print(f"--keep-last-checkpoint: {line}", flush=True)


def latest_checkpoint(exp: Path):
    from nemo_rlhf.checkpoint import find_latest_checkpoint

    return find_latest_checkpoint(exp / "checkpoints")


def evaluate_checkpoint(ckpt: Path, data: Path, out: Path, log: Path, *args: str) -> dict:
    """``nemo_rlhf.evaluate`` of ``ckpt`` on ``data/eval.jsonl`` into ``out``, reused only
    when ``out`` is the evaluation of that very checkpoint (a PPO run continued by a refresh
    round has a newer final checkpoint than the file)."""
    if out.exists():
        done = json.loads(out.read_text())
        if Path(done.get("checkpoint", "")).resolve() == Path(ckpt).resolve():
            return done
    run_stage([sys.executable, "-m", "nemo_rlhf.evaluate", f"checkpoint={ckpt}",
               f"data={data / 'eval.jsonl'}", f"out={out}", *args], log)
    return json.loads(out.read_text())


def ppo_evaluation(exp: Path, step: int, num_examples: int = 8) -> dict | None:
    """The PPO run's own held-out evaluation of ``step`` (greedy, written by the trainer to
    ``<exp>/eval_samples/step_<step>.jsonl``) in the form of ``nemo_rlhf.evaluate``'s
    output: ``accuracy`` (the ``correct`` column: ``trainer.eval_checker``),
    ``just_the_number`` when that checker ran, ``mean_response_length`` (tokens) and the
    first ``num_examples`` rows as ``examples`` (``correct``: the checker's); for episodes
    (``env.name``) also ``episode`` (``turns_mean``, ``tool_calls_mean``,
    ``malformed_call_rate``: the run's ``eval/episode/*`` of that step) and each example's
    ``episode`` text. ``None`` when
    the run did not evaluate that step (``trainer.val_check_interval=0``): the caller then
    runs ``nemo_rlhf.evaluate`` itself. The demo measured both on the same checkpoints:
    14.0% / 14.385 tokens at step 0 and 53.5% / 11.815 at step 10 from each."""
    path = exp / "eval_samples" / f"step_{step:06d}.jsonl"
    if not path.is_file():
        return None
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if not rows:
        return None
    out = {"checkpoint": f"{exp} step {step}", "source": str(path), "num_responses": len(rows),
           "accuracy": sum(r["correct"] for r in rows) / len(rows),
           "mean_response_length": sum(r["length"] for r in rows) / len(rows),
           "examples": [{"prompt": r["prompt"], "response": r["response"], "correct": r["correct"]}
                        for r in rows[:num_examples]]}
    if all("just_the_number" in r for r in rows):
        out["just_the_number"] = sum(r["just_the_number"] for r in rows) / len(rows)
    if all("turns" in r for r in rows):  # episodes (env.name): the run's eval/episode/* of that step
        out["episode"] = {k: metric_by_step(exp, f"eval/episode/{k}").get(step)
                          for k in ("turns_mean", "tool_calls_mean", "malformed_call_rate")}
        for ex, r in zip(out["examples"], rows):
            ex["episode"] = r.get("episode")
    return out


def episode_note(ev: dict) -> Optional[str]:
    """``tool calls <mean> an episode, <turns> turns, malformed <rate>%`` of an evaluation
    that ran episodes (its ``episode`` record), else None."""
    e = ev.get("episode") or {}
    if e.get("tool_calls_mean") is None:
        return None
    return (f"tool calls {e['tool_calls_mean']:.2f} an episode, {e['turns_mean']:.2f} turns, malformed "
            f"{100 * e['malformed_call_rate']:.1f}%")


SMOLLM2_MAX_NEW_TOKENS = 24
"""Response budget of the SmolLM2 demo in tokens (rollout, evaluation and RM samples)."""


SAME_FORM_PER_PROMPT = 4
"""Held-out same-form pairs per RM validation prompt: a sample against itself with only the
stated number changed (right vs wrong sum in the same wording)."""


def pairs_from_samples(task, samples: Path, out: Path, max_pairs_per_prompt: int, edit_pairs: int) -> int:
    """Write the preference pairs of a samples file: up to ``max_pairs_per_prompt`` natural
    pairs (a right sample against a wrong one of the same prompt) and ``edit_pairs``
    counterfactual pairs per prompt (``task.edit_answer``:
    :func:`nemo_rlhf.tasks.task.edit_pairs`); return the pair count."""
    from nemo_rlhf.tasks.task import build_preference_pairs, edit_pairs as make_edit_pairs

    if not out.exists():
        rows = [json.loads(line) for line in samples.read_text().splitlines() if line.strip()]
        pairs = build_preference_pairs(rows, max_pairs_per_prompt=max_pairs_per_prompt) \
            if max_pairs_per_prompt else []
        if edit_pairs:
            pairs += make_edit_pairs(task, rows, per_prompt=edit_pairs)
        tmp = out.with_suffix(".tmp")
        tmp.write_text("".join(json.dumps(p) + "\n" for p in pairs))
        tmp.rename(out)
    return sum(1 for line in out.read_text().splitlines() if line.strip())


def _setting_name(key: str) -> str:
    """A settings.json key as the user gives it: ``rm_prompts`` -> ``--rm-prompts`` (the
    recipe's ``rm_*`` / ``sft_*`` flags), other keys as they are (``precision``, ``task``)."""
    return "--" + key.replace("_", "-") if key.startswith(("rm_", "sft_")) else key


def check_stage_settings(path: Path, settings: dict, added=()) -> None:
    """Record the RM stages' settings; refuse to continue an output folder made with others
    (its pairs and RM would be reused silently), naming each flag with its old and new value.

    ``added``: keys recorded only since a later version (the sizing loops' caps, issue 53):
    a settings file without one cannot say what was used; that is printed, the current value
    is added to the file and the run continues (a recorded value that differs is refused as
    any other)."""
    if path.exists():
        recorded = json.loads(path.read_text())
        before = {"precision": "32", **recorded}  # fp32 before the flag existed
        missing = [k for k in added if k in settings and k not in before]
        changed = {k: (before.get(k), v) for k, v in settings.items() if k not in missing and before.get(k) != v}
        if changed:
            diff = ", ".join(f"{_setting_name(k)} {old} -> {new}" for k, (old, new) in changed.items())
            raise SystemExit(f"{path.parent.parent} holds RM data and an RM made with other settings "
                             f"({diff}); pass a new --out (nothing there is overwritten)")
        if missing:
            now = ", ".join(f"{_setting_name(k)} {settings[k]}" for k in missing)
            print(f"{path} was written before it recorded these settings, so it cannot say "
                  f"which were used: continuing with {now} (now recorded there)", flush=True)
            path.write_text(json.dumps({**recorded, **{k: settings[k] for k in missing}}, indent=2))
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(settings, indent=2))


def smollm2_rm_overrides(a, exp: Path, init_from, train_file: Path, steps: int, rm_data: Path,
                         tokenizer_dir) -> list[str]:
    """The Hydra overrides of the SmolLM2 demo's RM job (``python -m nemo_rlhf.train_rm``):
    ``steps`` steps of 16 pairs from ``init_from`` (the imported model, or an RM to
    continue), validated at the end on the held-out pairs and the same-form pairs."""
    return ["model=smollm2_135m", f"exp_manager.exp_dir={exp}",
            f"rm.init_from={init_from}", f"rm.freeze_layers={a.rm_freeze_layers}",
            f"data.train_file={train_file}",
            f"data.val_file={rm_data / 'preference_val.jsonl'}", f"data.tokenizer_dir={tokenizer_dir}",
            # '+': a new key of the (struct) dict; `rm.extra_val_files={...}` is refused by Hydra
            f"+rm.extra_val_files.same_form={rm_data / 'same_form_val.jsonl'}",
            "data.chat_template=chatml", f"data.system_prompt='{system_prompt()}'",
            "data.max_seq_length=96", f"trainer.max_steps={steps}", "trainer.global_batch_size=16",
            "trainer.micro_batch_size=8", f"trainer.val_check_interval={steps}",
            "trainer.log_every_n_steps=5", f"optim.lr={a.rm_lr}", f"optim.min_lr={a.rm_lr / 10}",
            "optim.warmup_steps=3", "model.value_head_init_std=0.02",
            f"rm.reward_stats_max_pairs={RM_STATS_PAIRS}", f"trainer.precision={a.precision}"]


RM_STATS_PAIRS = 256
"""Training pairs the SmolLM2 RM's final reward mean/std are computed over
(``rm.reward_stats_max_pairs``; the whole set costs minutes on 2 cores)."""


def ppo_max_steps(config_name: str, overrides) -> int:
    """``trainer.max_steps`` of the PPO stage: the last override of it, else the config's."""
    for o in reversed(list(overrides)):
        if o.startswith("trainer.max_steps="):
            return int(o.split("=", 1)[1])
    return int(_composed(config_name).trainer.max_steps)


def rm_global_batch(overrides) -> int:
    """``trainer.global_batch_size`` of the tiny RM job: the last override, else conf/rm_tiny.yaml's."""
    for o in reversed(list(overrides)):
        if o.startswith("trainer.global_batch_size="):
            return int(o.split("=", 1)[1])
    return int(_composed("rm_tiny").trainer.global_batch_size)


def _composed(config_name: str):
    """The values of ``conf/<config_name>.yaml`` over its parent job configs (its
    ``defaults`` entries naming another file of ``conf/``), as a plain OmegaConf merge:
    enough for the scalar keys the demo reads, without importing the trainers."""
    from omegaconf import OmegaConf

    raw = OmegaConf.load(REPO / "conf" / f"{config_name}.yaml")
    parents = [d for d in raw.get("defaults", []) if isinstance(d, str)
               and (REPO / "conf" / f"{d}.yaml").is_file()]
    own = OmegaConf.masked_copy(raw, [k for k in raw if k not in ("defaults", "hydra")])
    return OmegaConf.merge(*(_composed(p) for p in parents), own)


def first_stage_steps(a, total: int) -> int:
    """PPO steps before the first RM refresh: ``total`` (``trainer.max_steps``) less
    ``a.refresh_rounds * a.refresh_ppo_steps``; ``a.refresh_ppo_steps`` is set here when
    None (the total split evenly over the rounds). Raises ``SystemExit`` naming the flags
    when nothing is left for the first stage."""
    if not a.refresh_rounds:
        return total
    if a.refresh_ppo_steps is None:
        a.refresh_ppo_steps = max(1, total // (a.refresh_rounds + 1))
    first = total - a.refresh_rounds * a.refresh_ppo_steps
    if first < 1 or a.refresh_ppo_steps < 1:
        raise SystemExit(f"trainer.max_steps={total} leaves no PPO step before the first refresh with "
                         f"--refresh-rounds {a.refresh_rounds} --refresh-ppo-steps {a.refresh_ppo_steps}")
    return first


def ppo_stage(ppo_args: list, rm, ppo_exp: Path, config_name: str, nproc: int, max_steps: int) -> None:
    """PPO to ``max_steps`` against ``rm`` (served as its own process; None: no RM). The run
    auto-resumes from ``ppo_exp``: after an RM refresh it continues with the new RM. Its
    output is also appended to ``<ppo_exp>/../logs/<ppo_exp name>.log`` (``<out>/logs/ppo.log``,
    beside the other stages' logs)."""
    from launchers.local import LocalRunConfig, run_ppo_with_rm
    from nemo_rlhf.checkpoint import read_metadata

    done = latest_checkpoint(ppo_exp)
    if done is not None and int(read_metadata(done).get("step", 0)) >= max_steps:
        return  # a rerun of a finished stage: not even a resume (it would record this stage's RM)
    note_process()
    code = run_ppo_with_rm(
        [*ppo_args, f"trainer.max_steps={max_steps}"],
        LocalRunConfig(rm_checkpoint=None if rm is None else str(rm), nproc=nproc,
                       exp_dir=str(ppo_exp), config_name=config_name,
                       trainer_log=str(ppo_exp.parent / "logs" / f"{ppo_exp.name}.log")))
    if code != 0:
        raise SystemExit(f"PPO stage exited with {code}; see {ppo_exp}")


def refresh_rounds(a, *, out: Path, logs: Path, first_rm: Path, ppo_exp: Path, ppo_args: list,
                    config_name: str, base_steps: int, prompts: Path, base_pairs: Path, train_rm,
                    rm_batch: int, eval_args: list, task=None) -> tuple[list[dict], Path]:
    """The closed loop: ``a.refresh_rounds`` rounds of bad-case replay and RM refresh.

    Each round: the current policy samples ``a.refresh_samples_per_prompt`` answers to the
    first ``a.refresh_prompts`` PPO prompts; the labeller (the task's checker) scores them
    and the current RM scores them (``nemo_rlhf.evaluate rm_checkpoint=...``); the pairs on
    which the RM contradicts the labeller (``nemo_rlhf.data.bad_cases``), plus, with a
    ``task`` (its ``edit_answer``), same-wording edits of those samples
    (:func:`nemo_rlhf.tasks.task.edit_pairs`), are the
    round's new pairs; the RM continues from its checkpoint (``rm.init_from`` an RM loads
    its head too) on the new pairs mixed with ``a.refresh_replay`` times as many replayed
    old ones (against forgetting), for ``a.refresh_rm_steps`` steps (default
    ``a.refresh_rm_epochs`` passes of ``rm_batch`` pairs); the pool of all pairs grows by
    the new ones (the next round replays from it). With no new pair the RM is kept.

    The round is checked before PPO uses it: the policy also answers the next
    ``a.refresh_heldout_prompts`` PPO prompts, which no round trains on, and the
    labeller's pairs of those answers (:func:`nemo_rlhf.data.bad_cases.labelled_pairs`)
    are validated by the RM job before its first step and after its last
    (``trainer.val_at_start``, ``rm.extra_val_files.policy_unseen``). The refreshed RM
    replaces the current one only when it ranks those pairs better by at least
    ``a.refresh_min_gain`` (:func:`refresh_verdict`); otherwise the current RM stays (the
    round's pairs still join the pool). Why: a round that does not improve the RM on the
    policy's own answers only perturbs the reward, and PPO spends its steps on what moved
    (docs/demo.md measured one such round at -7.5 points against a control, and a round
    on old pairs alone at -6.5). PPO resumes from its last checkpoint against the RM kept
    for ``a.refresh_ppo_steps`` more steps (a new RM's identity restarts the trainer's
    reward normalisation, logged).

    Returns ``(rounds, last RM checkpoint)``: per round the disagreement statistics, the
    pairs added, the RM's held-out numbers before and after, the check on the unseen
    prompts and its verdict, and the PPO held-out accuracy at the round's last step.
    """
    from nemo_rlhf.data.bad_cases import disagreement_pairs, labelled_pairs
    from nemo_rlhf.tasks.task import edit_pairs

    py, rm, pairs_file = sys.executable, first_rm, base_pairs
    rounds = []
    for r in range(1, a.refresh_rounds + 1):
        rdir = out / "refresh" / f"round_{r}"
        rdir.mkdir(parents=True, exist_ok=True)
        policy = latest_checkpoint(ppo_exp)
        subset = rdir / "prompts.jsonl"
        all_lines = [ln for ln in prompts.read_text().splitlines() if ln.strip()]
        lines = all_lines[:a.refresh_prompts + a.refresh_heldout_prompts]
        if not subset.exists():
            subset.write_text("".join(ln + "\n" for ln in lines))
        train_prompts = {json.loads(ln)["prompt"] for ln in lines[:a.refresh_prompts]}
        unseen_prompts = {json.loads(ln)["prompt"] for ln in lines[a.refresh_prompts:]} - train_prompts
        samples = rdir / "samples.jsonl"
        if not samples.exists():
            run_stage([py, "-m", "nemo_rlhf.evaluate", f"checkpoint={policy}", f"data={subset}",
                       f"out={rdir / 'samples.json'}", *eval_args, f"rm_checkpoint={rm}",
                       f"temperature={a.rm_temperature}", f"num_samples={a.refresh_samples_per_prompt}",
                       f"samples_out={samples}", f"seed={100 + r}", "num_examples=0", "batch_size=128"],
                      logs / "refresh.log")
        all_rows = [json.loads(ln) for ln in samples.read_text().splitlines() if ln.strip()]
        rows = [x for x in all_rows if x["prompt"] in train_prompts]
        found, stats = disagreement_pairs(rows, max_pairs_per_prompt=a.refresh_pairs_per_prompt,
                                          extra_keys=("answer",), seed=r)
        unseen = labelled_pairs([x for x in all_rows if x["prompt"] in unseen_prompts],
                                max_pairs_per_prompt=a.refresh_pairs_per_prompt, extra_keys=("answer",), seed=r)
        unseen_file = rdir / "policy_unseen_pairs.jsonl"  # the round's check set
        if not unseen_file.exists():
            write_atomic(unseen_file, "".join(json.dumps(p) + "\n" for p in unseen))
        new = [{k: v for k, v in p.items() if not k.endswith("_rm_score")} for p in found]
        if task is not None:
            involved = {(p["prompt"], x) for p in found for x in (p["chosen"], p["rejected"])}
            new += edit_pairs(task, [x for x in rows if (x["prompt"], x["response"]) in involved],
                              per_prompt=a.refresh_pairs_per_prompt, seed=r)
        pool = rdir / "preference_pool.jsonl"  # every pair so far: the next rounds' replay
        refresh = rdir / "rm_refresh_train.jsonl"  # this round's RM data: new + replayed old
        if not refresh.exists():
            old_pairs = [ln for ln in pairs_file.read_text().splitlines() if ln.strip()]
            replay = random.Random(r).sample(old_pairs, min(len(old_pairs),
                                                            round(a.refresh_replay * len(new))))
            lines = [json.dumps(p) for p in new] + replay
            random.Random(r).shuffle(lines)
            write_atomic(pool, "".join(ln + "\n" for ln in old_pairs + [json.dumps(p) for p in new]))
            write_atomic(refresh, "".join(ln + "\n" for ln in lines))
        refresh_pairs = sum(1 for _ in refresh.open())
        before = _rm_numbers(rm.parent.parent)
        rm_exp = out / f"rm_round_{r}"
        check = {"pairs": len(unseen), "before": None, "after": None, "min_gain": a.refresh_min_gain,
                 "kept_refreshed_rm": False}
        if new and latest_checkpoint(rm_exp) is None:
            steps = a.refresh_rm_steps or max(2, math.ceil(a.refresh_rm_epochs * refresh_pairs / rm_batch))
            train_rm(rm_exp, str(rm), refresh, steps,
                     extra=["trainer.val_at_start=true"]
                     + ([f"+rm.extra_val_files.policy_unseen={unseen_file}"] if unseen else []))
        if new:
            by_step = metric_by_step(rm_exp, "val_policy_unseen/accuracy")
            if by_step:
                check["before"], check["after"] = by_step[min(by_step)], by_step[max(by_step)]
            keep, why = refresh_verdict(check["before"], check["after"], len(unseen), a.refresh_min_gain)
            check["kept_refreshed_rm"], check["verdict"] = keep, why
            print(f"refresh round {r}: {why}", flush=True)
            if keep:
                rm = latest_checkpoint(rm_exp)
        else:
            check["verdict"] = "the RM agrees with the labeller on every pair; it is kept"
            print(f"refresh round {r}: {check['verdict']}", flush=True)
        pairs_file = pool
        steps = base_steps + r * a.refresh_ppo_steps
        ppo_stage(ppo_args, rm, ppo_exp, config_name, a.nproc, steps)
        record = {"round": r, "policy_checkpoint": str(policy), "rm_checkpoint": str(rm),
                  "policy_samples": len(rows), "disagreement": stats.as_dict(),
                  "pairs_added": len(new), "rm_refresh_pairs": refresh_pairs,
                  "rm_pool_pairs": sum(1 for _ in pool.open()),
                  "rm_before": before, "rm_after": _rm_numbers(rm_exp) if new else before,
                  "rm_policy_unseen": check, "ppo_step": steps,
                  "ppo_heldout_accuracy": metric_by_step(ppo_exp, "eval/accuracy").get(steps),
                  "ppo_heldout_accuracy_before": metric_by_step(ppo_exp, "eval/accuracy").get(
                      steps - a.refresh_ppo_steps)}
        print(f"refresh round {r}: {stats.disagreements}/{stats.candidate_pairs} candidate pairs "
              f"disagreed ({100 * stats.disagreement_rate:.1f}%), {len(new)} pairs added; RM "
              f"{before} -> {record['rm_after']}; PPO held-out at step {steps}: "
              f"{record['ppo_heldout_accuracy']}", flush=True)
        rounds.append(record)
    return rounds, rm


def refresh_verdict(before, after, pairs: int, min_gain: float) -> tuple[bool, str]:
    """Whether a refresh round's RM replaces the current one, and why (one line).

    Args:
        before / after: the current and the refreshed RM's accuracy (0-1) on the round's
            check pairs (the policy's answers to prompts no round trains on); None when not
            measured.
        pairs: how many check pairs there were.
        min_gain: the least ``after - before`` that keeps the refreshed RM; negative keeps
            it whatever the check says (the demo's behaviour before the check existed).

    Returns:
        ``(keep, reason)``.
    """
    if min_gain < 0:
        return True, f"the refreshed RM is used (--refresh-min-gain {min_gain} < 0: not checked)"
    if not pairs or before is None or after is None:
        return False, ("no right-vs-wrong pair among the answers to the unseen prompts: the refreshed RM "
                       "cannot be checked, the current RM is kept (more --refresh-heldout-prompts, or "
                       "--refresh-min-gain -1 to use it unchecked)")
    verdict = (f"on {pairs} pairs of the policy's answers to unseen prompts the refreshed RM is right on "
               f"{100 * after:.1f}%, the current one on {100 * before:.1f}% ({100 * (after - before):+.1f} "
               f"points; --refresh-min-gain {100 * min_gain:.1f})")
    if after - before >= min_gain:
        return True, verdict + ": the refreshed RM is used"
    return False, verdict + ": the current RM is kept"


def write_atomic(path: Path, text: str) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    tmp.rename(path)


def _rm_numbers(rm_exp: Path) -> dict:
    """An RM's last held-out pair accuracy and same-form pair accuracy (None if not logged)."""
    return {"pair_accuracy": rm_accuracy(rm_exp),
            "same_form_accuracy": rm_accuracy(rm_exp, "val_same_form/accuracy")}


def print_reward_auc(by_step: dict[int, float]) -> None:
    """The line on ``eval/reward_auc`` (:func:`nemo_rlhf.trainers.ppo.evaluation.reward_auc`):
    how well the reward told right held-out answers from wrong ones, first and last
    evaluation; nothing when the run logged none."""
    if by_step:
        first, last = min(by_step), max(by_step)
        values = (f"{by_step[first]:.2f} (step {first}) -> " if first != last else "") + \
            f"{by_step[last]:.2f} (step {last})"
        print(f"reward's right-vs-wrong AUC on the policy's held-out answers: {values}; 0.5: it no "
              f"longer tells them apart")


def print_rounds(rounds: list[dict]) -> None:
    for r in rounds:
        d = r["disagreement"]
        print(f"refresh round {r['round']}: disagreement {100 * d['disagreement_rate']:.1f}% "
              f"({d['disagreements']}/{d['candidate_pairs']} pairs of {r['policy_samples']} samples), "
              f"+{r['pairs_added']} pairs; RM pair/same-form accuracy {r['rm_before']} -> "
              f"{r['rm_after']}; {r['rm_policy_unseen']['verdict']}; PPO held-out "
              f"{r['ppo_heldout_accuracy_before']} -> {r['ppo_heldout_accuracy']} (step {r['ppo_step']})")


def metric_by_step(exp: Path, key: str) -> dict[int, float]:
    """``{step: value}`` of ``key`` in ``exp/metrics.jsonl`` (the last value of a step)."""
    path, out = exp / "metrics.jsonl", {}
    if path.exists():
        for line in path.read_text().splitlines():
            row = json.loads(line)
            if key in row:
                out[int(row["step"])] = row[key]
    return out


def _kl_target(ppo_exp: Path) -> tuple:
    """``(kl.type, kl.target)`` of the PPO run, from its resolved ``<ppo_exp>/config.yaml``;
    the target is None with ``kl.type=fixed`` (a fixed coefficient aims at no KL), and both
    are None when the run wrote no config."""
    path = ppo_exp / "config.yaml"
    if not path.is_file():
        return None, None
    from omegaconf import OmegaConf

    kl = OmegaConf.to_container(OmegaConf.load(path)).get("kl") or {}
    kind, target = kl.get("type"), kl.get("target")
    return kind, (float(target) if kind in ("adaptive", "pi") and target is not None else None)


def kl_summary(ppo_exp: Path) -> dict:
    """The PPO run's final ``kl_mean`` (nats per sequence), its controller's ``kl.type`` and
    ``kl.target``, and the ratio of the two (rounded to 0.01; None without a target)."""
    kl = last_metric(ppo_exp, "kl_mean")
    kind, target = _kl_target(ppo_exp)
    ratio = round(kl / target, 2) if kl is not None and target else None
    return {"final_kl_mean": kl, "kl_type": kind, "kl_target": target, "final_kl_to_target": ratio}


def kl_line(k: dict) -> str:
    """One line of :func:`kl_summary`: ``6.30 (kl.target 6 of kl.type=pi: 1.05x)``."""
    if k["final_kl_mean"] is None:
        return "n/a"
    line = f"{k['final_kl_mean']:.2f}"
    if k["kl_target"]:
        line += f" (kl.target {k['kl_target']:g} of kl.type={k['kl_type']}: {k['final_kl_to_target']:.2f}x)"
    elif k["kl_type"]:
        line += f" (kl.type={k['kl_type']}: no target)"
    return line


def system_prompt() -> str:
    from nemo_rlhf.tasks.addition import SMOLLM2_SYSTEM_PROMPT

    return SMOLLM2_SYSTEM_PROMPT


def rm_accuracy(rm_exp: Path, key: str = "val/accuracy"):
    """The RM's last validation accuracy (``key``), from its metrics log if it wrote one."""
    return last_metric(rm_exp, key)


def last_metric(exp: Path, key: str):
    path = exp / "metrics.jsonl"
    value = None
    if path.exists():
        for line in path.read_text().splitlines():
            row = json.loads(line)
            if key in row:
                value = row[key]
    return value
