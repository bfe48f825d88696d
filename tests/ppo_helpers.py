"""Shared helpers for PPO tests: demo data in a temp folder and composed Hydra configs."""

from __future__ import annotations

from pathlib import Path

CONF_DIR = Path(__file__).resolve().parents[1] / "conf"


def make_demo_data(out: Path) -> Path:
    """Small demo dataset (prompts, eval, tokenizer) written once into ``out``."""
    from nemo_rlhf.tasks.precedence import DemoTaskConfig, make_demo_dataset

    if not (out / "ppo_prompts.jsonl").exists():
        make_demo_dataset(out, DemoTaskConfig(n_sft=64, n_pref=64, n_ppo=64, n_eval=16, n_val=16))
    return out


def compose_ppo(data: Path, exp_dir: Path, *overrides: str):
    """``conf/ppo_tiny.yaml`` composed with test overrides, as the typed PPOConfig."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    import nemo_rlhf.train_ppo  # noqa: F401  (registers the schema)

    base = [
        f"data.train_file={data}/ppo_prompts.jsonl", f"data.val_file={data}/eval.jsonl",
        f"data.tokenizer_dir={data}/tokenizer", f"exp_manager.exp_dir={exp_dir}",
        "exp_manager.resume=none", "trainer.max_steps=2", "trainer.val_check_interval=0",
        "trainer.sample_table_every=0", "ppo.num_rollout_samples=8", "ppo.global_batch_size=4",
        "ppo.micro_batch_size=2", "ppo.forward_micro_batch_size=4", "rollout.max_new_tokens=4",
        "reward.normalization=none", "reward.functions=[{name: arithmetic_exact_match}]",
    ]
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        dcfg = compose("ppo_tiny", overrides=base + list(overrides))
    return OmegaConf.to_object(dcfg)


def length_reward(prompts, responses, extras):
    """Test reward with spread: the response's length in characters / 4."""
    return [len(r) / 4.0 for r in responses]


INVALID_AT = {0: float("nan"), 3: float("inf"), 6: 1.0e30}
"""Positions of each call where :func:`invalid_some_reward` plants an invalid score."""


def invalid_some_reward(prompts, responses, extras):
    """:func:`length_reward`, but NaN at position 0, +Inf at 3 and 1e30 (past the default
    ``reward.max_abs_score``) at 6 of every call: three invalid scores per call of 8."""
    out = length_reward(prompts, responses, extras)
    for i, v in INVALID_AT.items():
        if i < len(out):
            out[i] = v
    return out


def all_invalid_reward(prompts, responses, extras):
    """NaN for every sample."""
    return [float("nan")] * len(responses)


def read_metrics(exp: Path, volatile: tuple = ("timing/", "_per_s")) -> dict[int, dict]:
    """``<exp>/metrics.jsonl`` by step, without the keys that contain a ``volatile`` part
    (wall-clock numbers); a step logged twice (a resumed attempt) keeps its last row."""
    import json

    out = {}
    for line in (Path(exp) / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        out[row["step"]] = {k: v for k, v in row.items() if not any(s in k for s in volatile)}
    return out


def read_prompt_ids(exp: Path) -> dict[int, list[int]]:
    """``<exp>/prompt_log.jsonl``: each step's prompt ids (a killed attempt's line is
    superseded by the resumed one's)."""
    import json

    out = {}
    for line in (Path(exp) / "prompt_log.jsonl").read_text().splitlines():
        row = json.loads(line)
        out[row["step"]] = row["prompt_ids"]
    return out


def session_env() -> dict[str, str]:
    """The environment :func:`start_in_session` gives (without ``crash``): this process's,
    one OMP thread, no ``NEMO_RLHF_*`` fault settings."""
    import os

    env = {k: v for k, v in os.environ.items() if not k.startswith("NEMO_RLHF_")}
    env["OMP_NUM_THREADS"] = "1"
    return env


def start_in_session(cmd: list[str], log: Path, cwd: Path, crash: str | None = None):
    """``cmd`` as the leader of its own session, output appended to ``log``, one thread,
    no inherited ``NEMO_RLHF_*`` fault settings (``crash``: ``NEMO_RLHF_CRASH_AT``)."""
    import subprocess

    env = session_env()
    if crash:
        env["NEMO_RLHF_CRASH_AT"] = crash
    Path(log).parent.mkdir(parents=True, exist_ok=True)
    with open(log, "a") as out:
        return subprocess.Popen(cmd, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def end_session(proc, timeout: float) -> int | None:
    """Wait up to ``timeout`` s for ``proc``'s exit code (None: it did not exit), then
    SIGKILL whatever is left of its session (a killed trainer's forked writers)."""
    import os
    import signal
    import subprocess

    try:
        code = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        code = None
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()
    return code



from nemo_rlhf.envs import Environment, StepResult  # noqa: E402  (the test environment below)
from nemo_rlhf.envs.builtin import answer_reward  # noqa: E402


class TwoTurnEnv(Environment):
    """Test environment (``env.name=tests.ppo_helpers:two_turn_env``): every episode has two
    policy turns. The first turn is answered with the observation :attr:`OBSERVATION` (as
    if a tool had been called: ``tool_calls`` 1), the second ends the episode with reward
    1.0 when its last number is the row's ``answer``, else 0.25."""

    OBSERVATION = "=7="

    def reset(self, problem):
        self.problem = problem
        return problem["prompt"]

    def step(self, trajectory_so_far, last_action_text):
        info = {"tool_calls": 1, "malformed_calls": 0}
        if trajectory_so_far.turns == 1:
            return StepResult(self.OBSERVATION, False, None, info)
        return StepResult(None, True, 1.0 if answer_reward(self.problem, last_action_text) else 0.25, info)


def two_turn_env(env_cfg):
    """Factory of :class:`TwoTurnEnv` (one per episode)."""
    return TwoTurnEnv()


def bias_routing(model, bias) -> None:
    """Every MoE router of ``model``: megatron's sigmoid scores with an expert bias
    (DeepSeek-V3's auxiliary-loss-free balancing): the top-k is chosen on ``scores + bias``
    (``bias``: ``[experts]`` float32), the gate weights are the chosen experts' unbiased
    scores; the bias is not updated (``enable_expert_bias`` stays off). Changing the bias
    changes which experts a token goes to and nothing else: the routing-replay tests' stand-in
    for a rollout engine whose router numerics differ from the trainer's."""
    from nemo_rlhf.models.routing_replay import moe_routers

    for r in moe_routers(model):
        r.score_function, r.expert_bias = "sigmoid", bias.clone()
