"""Config plumbing shared by the Hydra entry points.

* :func:`to_typed`: a composed Hydra config -> its dataclass schema, once, at the entry point;
* :func:`check_choice`: the one check of a closed choice (``__post_init__`` of every schema);
* :data:`RENAMED_KEYS` / :func:`check_renamed_keys`: keys that moved, refused on a command
  line with the new key's name.
"""

from __future__ import annotations

from typing import Iterable, Sequence, TypeVar

from omegaconf import DictConfig, OmegaConf

T = TypeVar("T")

RENAMED_KEYS: dict[str, str] = {
    "trainer.save_interval": "exp_manager.save_interval",
}
"""Training-job keys that moved, old -> new (one ``trainer`` / ``exp_manager`` vocabulary
for PPO, SFT and RM: SFT/RM had ``trainer.save_interval``)."""


def to_typed(dcfg: DictConfig, schema: type[T]) -> T:
    """Convert a composed Hydra config to its dataclass schema, once, at the entry point.

    The composed config is resolved and merged into a fresh structured config of
    ``schema``, so a key added on the command line with ``+`` that the schema does not
    have fails too (plain conversion would drop it silently).

    Raises:
        omegaconf.errors.ConfigKeyError: naming the full key, e.g. ``Key 'foo' not in
            'PPOTrainerConfig'`` with ``full_key: trainer.foo``.
        ValueError: from a schema's ``__post_init__`` (naming the key and valid values).
    """
    plain = OmegaConf.to_container(dcfg, resolve=True)
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(schema), plain))


def check_choice(key: str, value, valid: Iterable) -> None:
    """Refuse ``value`` of the closed choice ``key`` unless it is one of ``valid``.

    Raises:
        ValueError: ``"<key>=<value!r>: valid choices are [...]"``.
    """
    valid = list(valid)
    if value not in valid:
        raise ValueError(f"{key}={value!r}: valid choices are {valid}")


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


def run_console_entry(hydra_main) -> None:
    """A training job's console entry: refuse a renamed key (:data:`RENAMED_KEYS`) naming
    the new one, then run the Hydra job ``hydra_main``.

    Raises:
        SystemExit: with the one-line error for a renamed key.
    """
    import sys

    try:
        check_renamed_keys(sys.argv[1:])
    except ValueError as exc:
        raise SystemExit(f"error: {exc}") from None
    hydra_main()


def configure_job_logging() -> None:
    """INFO lines with a time stamp; megatron's own at WARNING (every training job's)."""
    import logging

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    logging.getLogger("megatron").setLevel(logging.WARNING)
