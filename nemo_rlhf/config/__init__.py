"""Config plumbing shared by the Hydra entry points.

* :func:`to_typed`: a composed Hydra config -> its dataclass schema, once, at the entry point;
* :func:`check_choice`: the one check of a closed choice (``__post_init__`` of every schema).
"""

from __future__ import annotations

from typing import Iterable, TypeVar

from omegaconf import DictConfig, OmegaConf

T = TypeVar("T")

def to_typed(dcfg: DictConfig, schema: type[T]) -> T:
    """Convert a composed Hydra config to its dataclass schema, once, at the entry point.

    The composed config is resolved and merged into a fresh structured config of
    ``schema``, so a key added on the command line with ``+`` that the schema does not
    have fails too (plain conversion would drop it silently).

    Raises:
        omegaconf.errors.ConfigKeyError: naming the full key, e.g. ``Key 'foo' not in
            'TrainerConfig'`` with ``full_key: trainer.foo``.
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
