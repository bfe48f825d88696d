"""Held-out accuracy of a tool task *with the tool*, before and after PPO (#51).

The recipe measures a tool task itself (``python -m launchers.demo --task calc --reward
checker``: ``nemo_rlhf.evaluate`` and the PPO trainer run episodes with ``env.name``); this
script measures a given checkpoint without the recipe's stages. It builds
the PPO trainer (``conf/ppo_tiny.yaml`` + the overrides given, ``env.name`` set), runs one
greedy episode per held-out row (``data.val_file``) through the trainer's own episode code
(:func:`~nemo_rlhf.rollout.episodes.run_episodes`, the rollout source's encoders), scores
each final answer (the last policy turn) with the reward functions' checker
(``--checker``), then trains ``trainer.max_steps`` PPO steps and evaluates again.

Printed (one JSON line each): ``heldout`` before and after (accuracy, tool-call rate =
episodes with at least one evaluated call, malformed rate, turns per episode, truncated
rate, the first episodes' texts and every wrong one's ``[prompt, answer, text]``), and every
PPO step's metrics (every scalar the step returns: ``episode/*``, reward, KL, entropy,
advantages, the critic's).

    PYTHONPATH=. python benchmarks/tool_task_eval.py --checker nemo_rlhf.tasks.calc:TASK.score \
        exp_manager.init_from=<sft checkpoint> data.train_file=... data.val_file=... \
        data.tokenizer_dir=... env.name=digit_calculator ... trainer.max_steps=10

One process, one rank (``exp_manager.exp_dir`` gets the run's checkpoints). ``--show-batch N``
prints the first step's batch token by token instead (:func:`first_batch_tokens`) and trains
nothing.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def heldout_episodes(trainer, checker) -> dict:
    """Greedy episodes of the current policy on every held-out row; their metrics."""
    from nemo_rlhf.rollout.trajectory import POLICY
    from nemo_rlhf.trainers.ppo.episode_source import run_episode_batch

    src, cfg = trainer.rollout_source, trainer.cfg
    rows = trainer.eval_prompts
    problems = [{"prompt": r.prompt, **r.extras} for r in rows]
    # the trainer's own episode path (the rollout's encoders and limits), greedy
    episodes = run_episode_batch(cfg, trainer.dims, src.actor.model, src.tok, problems,
                                 replace(cfg.rollout, greedy=True), call_index=10_000,
                                 factory=src.factory).episodes
    finals = []
    for ep in episodes:
        tr = ep.trajectory
        last = [s for s in tr.segments if s.kind == POLICY][-1]
        finals.append(src.tok.decode([t for t in tr.token_ids[last.start:last.end] if t != src.tok.eos_id]))
    scores = checker([p["prompt"] for p in problems], finals, [dict(r.extras) for r in rows])
    n = len(episodes)
    text = [src.tok.decode(ep.trajectory.token_ids[ep.trajectory.prompt_length:], skip_special_tokens=False)
            for ep in episodes]
    last_info = [ep.infos[-1] if ep.infos else {} for ep in episodes]
    return {"n": n, "accuracy": sum(s > 0.5 for s in scores) / n,
            "tool_call_rate": sum(i.get("tool_calls", 0) > 0 for i in last_info) / n,
            "malformed_rate": sum(i.get("malformed_calls", 0) > 0 for i in last_info) / n,
            "turns_mean": sum(ep.trajectory.turns for ep in episodes) / n,
            "truncated_rate": sum(bool(ep.trajectory.truncated) for ep in episodes) / n,
            "examples": [[p["prompt"], t] for p, t in list(zip(problems, text))[:4]],
            "wrong": [[p["prompt"], p.get("answer"), t] for p, t, s in zip(problems, text, scores) if s <= 0.5]}


def first_batch_tokens(trainer, n_rows: int) -> dict:
    """The first PPO step's batch, token by token, for the first ``n_rows`` episodes and the
    first two the checker scored wrong: each token after the prompt with its loss mask, the
    behaviour, old and reference log-probs, the token reward, the critic's value, the
    advantage (as the update reads it: whitened for ``gae``) and the return. The trainer's own
    step 1-5 (prompts, episodes, scores, forwards, :meth:`compute_advantages`); nothing is
    trained. What docs/tasks.md, "Why PPO does not fix the copy errors", checked by hand."""
    from nemo_rlhf.algorithms import ppo as P

    cfg, tok = trainer.cfg, trainer.rollout_source.tok
    idx = trainer.sample_prompts()
    batch = trainer.rollout(idx)
    scores, _ = trainer.score(idx, batch)
    fwd = trainer.compute_old_and_reference(batch)
    adv, metrics = trainer.compute_advantages(batch, scores, fwd)
    beta = trainer.kl_ctl.value if cfg.kl.in_reward else 0.0  # the token rewards, as step_advantages builds them
    rewards, _ = P.compute_token_rewards(fwd.kl_logprobs, fwd.ref_logprobs, scores, batch.response_mask, beta,
                                         kl_estimator=cfg.kl.estimator, kl_clamp=cfg.kl.clamp, ended=batch.ended,
                                         missing_eos_penalty=cfg.ppo.missing_eos_penalty)
    P_len, wrong = batch.prompt_length, [i for i, s in enumerate(scores.tolist()) if s <= 0.5]
    rows = []
    for i in list(range(min(n_rows, len(scores)))) + wrong[:2]:
        n = int(batch.response_lengths[i])
        col = lambda t: [round(float(x), 4) for x in t[i, :n].tolist()]  # noqa: E731
        rows.append({"row": i, "score": float(scores[i]), "prompt": tok.decode(batch.input_ids[i, :P_len].tolist(),
                                                                                skip_special_tokens=False),
                     "tokens": [tok.decode([t], skip_special_tokens=False) for t in batch.input_ids[i, P_len:P_len + n]],
                     "loss_mask": [int(x) for x in batch.response_mask[i, :n].tolist()],
                     "behaviour_logprob": col(batch.logprobs), "old_logprob": col(fwd.old_logprobs),
                     "ref_logprob": col(fwd.ref_logprobs), "token_reward": col(rewards),
                     "value": col(fwd.values) if fwd.values is not None else None,
                     "advantage": col(adv.advantages), "return": col(adv.returns)})
    return {"right": sum(s > 0.5 for s in scores.tolist()), "of": len(scores), "kl_coef": beta,
            "estimator": cfg.ppo.advantage_estimator, "whitened": cfg.ppo.normalize_advantages,
            "metrics": {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float))}, "rows": rows}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checker", required=True, help="reward function spec (package.module:attr)")
    ap.add_argument("--show-batch", type=int, default=0, metavar="N",
                    help="print the first PPO step's batch token by token (N episodes and two wrong ones), "
                         "then stop without training")
    ap.add_argument("overrides", nargs="*", help="Hydra overrides of conf/ppo_tiny.yaml")
    a = ap.parse_args(argv)
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from nemo_rlhf.reward.functions import get_reward_function
    from nemo_rlhf.train_ppo import build

    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base=None):
        cfg = OmegaConf.to_object(compose("ppo_tiny", overrides=a.overrides))
    trainer = build(cfg)
    checker = get_reward_function(a.checker)
    if a.show_batch:
        print(json.dumps({"first_batch": first_batch_tokens(trainer, a.show_batch)}), flush=True)
        return 0
    print(json.dumps({"heldout": "before", **heldout_episodes(trainer, checker)}), flush=True)
    for _ in range(cfg.trainer.max_steps):
        m = trainer.train_step()
        trainer.step += 1  # as the training loop does (nemo_rlhf.trainers.loop.fit): prompts and seeds follow it
        print(json.dumps({"step": {k: float(v) for k, v in m.items() if isinstance(v, (int, float))}}), flush=True)
    print(json.dumps({"heldout": "after", **heldout_episodes(trainer, checker)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
