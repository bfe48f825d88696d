"""The ``env`` config section of PPO (#51): which environment a multi-turn rollout runs, its
per-episode limits and how its observations become tokens.

``env.name`` null (the default) keeps PPO single-turn, exactly as before. Otherwise it names
an environment **factory**, called once per episode with the :class:`EnvConfig`:

* a built-in short name of :data:`BUILTIN_ENVIRONMENTS` (``calculator``: a
  :class:`~nemo_rlhf.envs.ToolEnvironment` with the calculator tool; ``digit_calculator``:
  :class:`~nemo_rlhf.envs.digit_calculator.DigitCalculatorEnv`, calls written ``37*12=`` in
  the tiny model's digit vocabulary), or
* a ``"package.module:function"`` path, as reward functions are named
  (:mod:`nemo_rlhf.reward.functions`): ``function(env_cfg: EnvConfig) -> Environment``.

The episode's ``problem`` (what ``Environment.reset`` receives) is the prompt row as a
dict: ``{"prompt": <raw prompt text>, **extras}`` (e.g. ``answer``); the text ``reset``
returns is encoded like a single-turn prompt (``data.chat_template``, BOS).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

from nemo_rlhf.config import callable_path, check_choice, resolve_callable
from nemo_rlhf.envs.base import EnvLimits, Environment
from nemo_rlhf.envs.parsing import TOOL_CALL_FORMATS

__all__ = ["BUILTIN_ENVIRONMENTS", "EnvConfig", "EnvFactory", "TURN_REWARD_MODES", "get_env_factory"]

TURN_REWARD_MODES = ("sum", "per_turn")
"""Valid ``env.turn_rewards``: where the environment's per-turn rewards go (:class:`EnvConfig`)."""

EnvFactory = Callable[["EnvConfig"], Environment]

BUILTIN_ENVIRONMENTS: dict[str, str] = {
    "calculator": "nemo_rlhf.envs.builtin:calculator_env",
    "digit_calculator": "nemo_rlhf.envs.digit_calculator:digit_calculator_env",
}
"""Short name -> ``"package.module:function"`` of the built-in environment factories; every
other environment is named by its path."""


@dataclass
class EnvConfig:
    """Multi-turn rollouts (group ``env``); ``name`` null: single-turn PPO (the default)."""

    name: Optional[str] = None
    """The environment factory: a short name of :data:`BUILTIN_ENVIRONMENTS` or a
    ``package.module:function`` path (``function(env_cfg) -> Environment``, called once per
    episode). Null: single-turn rollouts. Needs ``rollout.engine=megatron`` and
    ``rollout.mode=sync``."""
    max_turns: int = EnvLimits.max_turns
    """Policy turns per episode (``EnvLimits.max_turns``)."""
    max_total_tokens: int = EnvLimits.max_total_tokens
    """Tokens per episode, prompt included (``EnvLimits.max_total_tokens``); at most the
    model's ``max_position_embeddings``."""
    max_tool_time_s: float = EnvLimits.max_tool_time_s
    """Seconds of ``env.step`` / tool time per episode (``EnvLimits.max_tool_time_s``)."""
    tool_call_format: str = "hermes"
    """How the policy writes tool calls: one of
    :data:`~nemo_rlhf.envs.parsing.TOOL_CALL_FORMATS` (``hermes``: ``<tool_call>{json}</tool_call>``,
    Hermes/Qwen; ``llama3``: Llama 3.1's JSON calls)."""
    observation_template: str = "{observation}"
    """How an observation's text becomes the text that is tokenised **alone** and appended
    after a policy turn: ``observation_template.format(observation=text)``. It must hold
    the chat template's end of the assistant turn, the tool/user message header and the
    next assistant header, e.g. for ChatML
    ``"<|im_end|>\\n<|im_start|>tool\\n{observation}<|im_end|>\\n<|im_start|>assistant\\n"``;
    the default (the bare text) fits a plain-text model such as the tiny demo's."""
    turn_rewards: str = "sum"
    """Where the environment's per-turn rewards go (:data:`TURN_REWARD_MODES`). ``sum``: their
    sum is the row's ``extras["env_reward"]``, which the ``env`` reward function returns as one
    weighted, normalised source of the sequence score (on the row's last policy token).
    ``per_turn``: each turn's reward, raw (no weight, no normalisation), is added to the token
    reward at the last policy token of that turn; the score of the reward sources stays on the
    last policy token. ``per_turn`` needs ``env.name``, a per-token advantage estimator
    (``gae``, ``reinforce_plus_plus``) and no ``env`` reward function (it would count the
    environment's reward twice)."""

    def __post_init__(self) -> None:
        self.limits()  # validates the three limits, naming env.<key>
        check_choice("env.tool_call_format", self.tool_call_format, TOOL_CALL_FORMATS)
        check_choice("env.turn_rewards", self.turn_rewards, TURN_REWARD_MODES)
        if "{observation}" not in str(self.observation_template):
            raise ValueError(f"env.observation_template={self.observation_template!r}: must contain "
                             f"'{{observation}}' (where the environment's text goes)")
        if self.name is not None and _path_of(self.name) is None:
            raise ValueError(f"env.name={self.name!r}: valid choices are null (single-turn), "
                             f"{sorted(BUILTIN_ENVIRONMENTS)} (built-in) or a "
                             f"'package.module:function' factory path")

    @property
    def enabled(self) -> bool:
        """Whether rollouts are multi-turn episodes."""
        return self.name is not None

    def limits(self) -> EnvLimits:
        """The per-episode :class:`EnvLimits`."""
        return EnvLimits(max_turns=self.max_turns, max_total_tokens=self.max_total_tokens,
                         max_tool_time_s=self.max_tool_time_s)

    def encode_observation_text(self, observation: str) -> str:
        """The text tokenised for ``observation`` (``observation_template`` filled)."""
        return self.observation_template.format(observation=observation)


def _path_of(spec: Any) -> Optional[str]:
    return callable_path(spec, BUILTIN_ENVIRONMENTS)


def get_env_factory(cfg: EnvConfig) -> EnvFactory:
    """The factory ``env.name`` names (imports its module).

    Raises:
        ValueError: ``env.name`` is null or not a valid name (naming the key and choices);
        ImportError / AttributeError / TypeError: the module, attribute or callable is
        missing (naming ``env.name`` and the path tried).
    """
    path = _path_of(cfg.name)
    if path is None:
        raise ValueError(f"env.name={cfg.name!r}: valid choices are {sorted(BUILTIN_ENVIRONMENTS)} "
                         f"or a 'package.module:function' factory path")
    return resolve_callable(cfg.name, path, "env.name")
