"""Config plumbing shared by the Hydra entry points.

* :func:`to_typed`: a composed Hydra config -> its dataclass schema, once, at the entry point;
* :func:`check_choice`: the one check of a closed choice (``__post_init__`` of every schema);
* :data:`RENAMED_KEYS` / :func:`check_renamed_keys`: keys that moved, refused on a command
  line with the new key's name;
* :func:`callable_path` / :func:`resolve_callable`: a config value that names a Python callable
  by a built-in short name or a ``"package.module:function"`` path (reward functions,
  checkers, environment factories).
"""

from __future__ import annotations

import importlib
from typing import Any, Callable, Iterable, Mapping, Optional, Sequence, TypeVar

from omegaconf import DictConfig, OmegaConf

T = TypeVar("T")

RENAMED_KEYS: dict[str, str] = {
    "trainer.save_interval": "exp_manager.save_interval",
    "ppo.ratio_eps": "ppo.clip_eps",
    "ppo.ratio_eps_low": "ppo.clip_eps_low",
    "ppo.ratio_eps_high": "ppo.clip_eps_high",
    "ppo.discount_factor": "ppo.gamma",
    "ppo.gae_lambda": "ppo.lam",
    "ppo.entropy_bonus": "ppo.entropy_coef",
    "kl.initial_policy_kl_penalty": "kl.init_kl_coef",
    "ppo.grpo_norm_by_std": "ppo.norm_by_std",
}
"""Training-job keys that moved, old -> new: one ``trainer`` / ``exp_manager`` vocabulary
for PPO, SFT and RM (SFT/RM had ``trainer.save_interval``), and the PPO knobs under the
field's names, the same in the config, the math (``PPOObjective``, ``AdvantageConfig``,
the KL controllers) and the metrics (``kl_coef``: the current beta)."""


def to_typed(dcfg: DictConfig, schema: type[T]) -> T:
    """Convert a composed Hydra config to its dataclass schema, once, at the entry point.

    The composed config is resolved and merged into a fresh structured config of
    ``schema``, so a key added on the command line with ``+`` that the schema does not
    have fails too (plain conversion would drop it silently).

    Raises:
        omegaconf.errors.ConfigKeyError: naming the full key, e.g. ``Key 'foo' not in
            'PPOTrainerConfig'`` with ``full_key: trainer.foo``.
        ValueError: from a schema's ``__post_init__`` (naming the key and valid values);
            a renamed key (:data:`RENAMED_KEYS`) set in a config file, naming the new key.
    """
    plain = OmegaConf.to_container(dcfg, resolve=True)
    check_renamed_config(plain)
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(schema), plain))


def check_choice(key: str, value, valid: Iterable, note: str = "") -> None:
    """Refuse ``value`` of the closed choice ``key`` unless it is one of ``valid``: the one
    check of every closed choice of the config schemas, so their messages have one shape.

    Args:
        key: the full config key (``"rollout.mode"``).
        value: the value given.
        valid: the valid values, listed in this order.
        note: appended to the message (e.g. ``" or null (the checkpoint's)"``).

    Raises:
        ValueError: ``"<key>=<value!r>: valid choices are [...]<note>"``.
    """
    valid = list(valid)
    if value not in valid:
        raise ValueError(f"{key}={value!r}: valid choices are {valid}{note}")


def callable_path(spec: Any, builtins: Mapping[str, str]) -> Optional[str]:
    """``spec``'s ``"package.module:function"`` path: a built-in short name's from
    ``builtins`` (short name -> path), ``spec`` itself when it has that form, else None.
    Nothing is imported, so the answer does not depend on what the process imported."""
    if not isinstance(spec, str):
        return None
    spec = builtins.get(spec, spec)
    module_name, colon, attr = spec.partition(":")
    return spec if colon and module_name and attr else None


def resolve_callable(spec: str, path: str, key: str) -> Callable:
    """Import the callable ``path`` (``"package.module:function"``, the function part may be
    dotted, e.g. ``module:TASK.score``) that the config value ``spec`` of ``key`` named.

    Args:
        spec: the value as written (a short name or the path), named in the errors.
        path: its path, from :func:`callable_path`.
        key: the config key (e.g. ``env.name``, ``trainer.eval_checker``).
    Raises:
        ImportError / AttributeError: the module cannot be imported / has no such attribute
        (naming ``key``, the value, and the module or attribute tried);
        TypeError: the target is not callable.
    """
    tried = f"{key}={spec!r}" + (f" (built-in: {path!r})" if path != spec else "")
    module_name, _, attr = path.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ImportError(f"{tried}: cannot import module {module_name!r}: {exc}") from exc
    fn: Any = module
    for part in attr.split("."):
        if not hasattr(fn, part):
            raise AttributeError(f"{tried}: module {module_name!r} has no attribute {attr!r}")
        fn = getattr(fn, part)
    if not callable(fn):
        raise TypeError(f"{tried}: {path} is a {type(fn).__name__}, not a callable")
    return fn


def check_renamed_keys(overrides: Sequence[str]) -> None:
    """Refuse Hydra overrides (``key=value``, ``+key=...``, ``~key``) of a renamed key.

    Called by the training entry points and launchers before Hydra composes (whose own
    error would name the old key only).

    Raises:
        ValueError: naming the old key, the new one and the override to give instead.
    """
    for override in overrides:
        key, sep, value = override.partition("=")
        key = key.lstrip("+~")
        if key in RENAMED_KEYS:
            new = RENAMED_KEYS[key]
            raise ValueError(f"{key} was renamed {new} (the same setting): pass "
                             f"{new}={value if sep else '<value>'} instead of {override!r}")


def check_renamed_config(plain: dict) -> None:
    """Refuse a composed config (a plain dict) that sets a renamed key, e.g. from a user's
    YAML file, which the command-line check does not see.

    Raises:
        ValueError: naming the old key and the new one.
    """
    for old, new in RENAMED_KEYS.items():
        node = plain
        *parents, leaf = old.split(".")
        for part in parents:
            node = node.get(part) if isinstance(node, dict) else None
        if isinstance(node, dict) and leaf in node:
            raise ValueError(f"{old} was renamed {new} (the same setting): the config sets "
                             f"{old}={node[leaf]!r}; write {new} instead")


def _flag(argv: Sequence[str], *names: str):
    for i, arg in enumerate(argv):
        for name in names:
            if arg == name and i + 1 < len(argv):
                return argv[i + 1]
            if arg.startswith(name + "="):
                return arg.split("=", 1)[1]
    return None


def check_renamed_config_file(argv: Sequence[str]) -> None:
    """Refuse a renamed key in the config file a command line names (``--config-dir`` /
    ``--config-name``): Hydra's own error while composing would name the old key only.

    Raises:
        ValueError: naming the file, the old key and the new one.
    """
    from pathlib import Path

    import yaml

    cdir, name = _flag(argv, "--config-dir", "-cd"), _flag(argv, "--config-name", "-cn")
    if cdir is None or name is None:
        return
    path = Path(cdir) / (name if name.endswith(".yaml") else f"{name}.yaml")
    if not path.is_file():
        return
    try:
        check_renamed_config(yaml.safe_load(path.read_text()) or {})
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from None


def run_console_entry(hydra_main) -> None:
    """A training job's console entry: refuse a renamed key (:data:`RENAMED_KEYS`) naming
    the new one, then run the Hydra job ``hydra_main``.

    Raises:
        SystemExit: with the one-line error for a renamed key.
    """
    import sys

    try:
        check_renamed_keys(sys.argv[1:])
        check_renamed_config_file(sys.argv[1:])
    except ValueError as exc:
        raise SystemExit(f"error: {exc}") from None
    hydra_main()


def configure_job_logging() -> None:
    """INFO lines with a time stamp; megatron's own at WARNING (every training job's)."""
    import logging

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    logging.getLogger("megatron").setLevel(logging.WARNING)
