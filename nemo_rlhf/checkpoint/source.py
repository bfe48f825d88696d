"""The checkpoint a job starts from carries its model: shape, tokenizer and chat template.

A job started from a checkpoint (``exp_manager.init_from`` for PPO, ``sft.init_from``,
``rm.init_from``) takes the model section of the checkpoint's ``config.yaml`` (written by
every save and by ``nemo-rlhf-ckpt import-hf``) unless ``model=<preset>`` is on the command
line, so a user of an imported Llama-3-8B does not restate its shape:

    python -m nemo_rlhf.train_rm rm.init_from=/ckpt/llama3_8b data.train_file=...

Rules, applied to the composed config before it is typed (:func:`adopt_checkpoint_model`):

* the ``init_from`` path may be a checkpoint, a checkpoint root (``step_<N>`` folders and
  ``latest``) or an experiment folder (its ``checkpoints/``); a root resolves to its newest
  complete step, as auto-resume does, and the resolved path is written back;
* without ``model=`` on the command line, the checkpoint's architecture and
  ``max_position_embeddings`` replace the config's model section; ``data.tokenizer_dir``,
  ``data.chat_template`` and ``data.system_prompt`` come from the checkpoint's config too
  (the tokenizer also from ``<root>/tokenizer``, where ``import-hf`` puts it). A
  ``model.<key>=`` or ``data.<key>=`` on the command line still wins. The job's own run
  settings of the model (dropouts, init stds) are kept.
* with ``model=<preset>`` (or a ``model.<architecture key>=`` override), an architecture
  that disagrees with the checkpoint's is refused, naming the key and both values: the
  weights would not load, or worse, load into another shape.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Sequence

from omegaconf import DictConfig, OmegaConf, open_dict

from nemo_rlhf.checkpoint.layout import checkpoint_tokenizer_dir, resolve_checkpoint

RUN_SETTINGS = ("hidden_dropout", "attention_dropout", "init_method_std", "value_head_init_std", "lora")
"""Model keys that are the job's own settings, never taken from the checkpoint (``lora``:
whether this job trains adapters on the checkpoint as its base)."""

NOT_ARCHITECTURE = ("name", "max_position_embeddings", *RUN_SETTINGS)
"""Model keys that may differ from the checkpoint's (the rest must match for the weights to
load: :meth:`~nemo_rlhf.models.config.ModelConfig.fingerprint`)."""

DATA_KEYS = ("tokenizer_dir", "chat_template", "system_prompt")
"""``data.*`` keys taken from the checkpoint's config when ``model=`` is not given."""

INIT_FROM_KEYS = {"ppo": "exp_manager.init_from", "sft": "sft.init_from", "rm": "rm.init_from"}
"""The key naming the starting checkpoint, by job."""


class CheckpointModelError(ValueError):
    """The starting checkpoint cannot be found, or the config's model disagrees with it."""


def resolve_init_from(key: str, value: str) -> Path:
    """The complete checkpoint ``value`` names: itself, the newest complete step under it,
    or under its ``checkpoints/`` folder (an experiment folder).

    Raises:
        CheckpointModelError: naming ``key`` and what was looked for.
    """
    path = Path(value)
    try:
        return resolve_checkpoint(path)
    except FileNotFoundError:
        pass
    what = "does not exist" if not path.exists() else "holds no complete checkpoint (step_<N> with COMPLETE)"
    raise CheckpointModelError(f"{key}={value}: {what}; give a checkpoint, a checkpoint root or an "
                               f"experiment folder")


def _override_keys(overrides: Sequence[str]) -> set[str]:
    """Keys of Hydra command-line overrides (``+key=v``, ``++key=v``, ``~key`` -> ``key``)."""
    return {o.partition("=")[0].lstrip("+~") for o in overrides}


def _effective(model: dict) -> dict:
    """Architecture values with the ``None`` shorthands spelled out (so ``ffn_hidden_size:
    null`` and ``4 * hidden_size`` compare equal)."""
    m = dict(model)
    hidden, heads = m.get("hidden_size"), m.get("num_attention_heads")
    if m.get("ffn_hidden_size") is None and hidden:
        m["ffn_hidden_size"] = 4 * hidden
    if m.get("kv_channels") is None and hidden and heads:
        m["kv_channels"] = hidden // heads
    if m.get("num_query_groups") is None:
        m["num_query_groups"] = heads
    return m


def architecture_mismatches(config_model: dict, saved_model: dict) -> list[tuple[str, object, object]]:
    """``(key, config value, checkpoint value)`` for each architecture key that differs
    (``vocab_size`` 0 on either side means "from the tokenizer" and is not compared).

    Args:
        config_model: the job's ``model`` section (plain dict).
        saved_model: the checkpoint config's ``model`` section.
    """
    mine, theirs = _effective(config_model), _effective(saved_model)
    out = []
    for key in saved_model:
        if key in NOT_ARCHITECTURE or key not in config_model:
            continue
        a, b = mine.get(key), theirs.get(key)
        if key == "vocab_size" and (not a or not b):
            continue
        if isinstance(a, float) or isinstance(b, float):
            same = a is not None and b is not None and abs(float(a) - float(b)) <= 1e-9 * max(1.0, abs(float(b)))
        else:
            same = a == b
        if not same:
            out.append((key, a, b))
    return out


def adopt_checkpoint_model(dcfg: DictConfig, init_key: str, overrides: Sequence[str],
                           model_choice: Optional[str] = None, missing_ok: bool = False) -> list[str]:
    """Resolve ``init_key``'s checkpoint and take its model (and tokenizer, chat template)
    into ``dcfg``, in place, by the rules of this module's docstring.

    Args:
        dcfg: the composed job config (before :func:`~nemo_rlhf.config.to_typed`).
        init_key: ``exp_manager.init_from``, ``sft.init_from`` or ``rm.init_from``.
        overrides: the command-line overrides (``HydraConfig.get().overrides.task``).
        model_choice: the ``model`` preset the config chose (for the error message).
        missing_ok: a path that does not exist here leaves ``dcfg`` as it is, with a note
            (a submit host that does not mount the cluster's file system).

    Returns:
        lines saying what was resolved and taken (for the job's log); empty when
        ``init_key`` is unset.

    Raises:
        CheckpointModelError: no checkpoint at the path, or an architecture given by
            ``model=`` / ``model.<key>=`` that differs from the checkpoint's (naming the
            key, both values and the checkpoint).
    """
    value = OmegaConf.select(dcfg, init_key)
    if not value:
        return []
    notes = []
    if missing_ok and not Path(str(value)).exists():
        return [f"{init_key}={value} is not on this host: the model is not checked against it "
                f"here (the job takes it when it starts)"]
    path = resolve_init_from(init_key, str(value))
    if Path(str(value)) != path:
        OmegaConf.update(dcfg, init_key, str(path))
        notes.append(f"{init_key}={value} -> {path} (its newest complete checkpoint)")
    cfg_file = path / "config.yaml"
    if not cfg_file.is_file():
        return notes  # written by every save since the first release; nothing to take
    saved = OmegaConf.to_container(OmegaConf.load(cfg_file), resolve=False)
    saved_model = saved.get("model") or {}
    given = _override_keys(overrides)
    model_given = "model" in given
    if not model_given and saved_model:
        taken = []
        with open_dict(dcfg):
            for key, v in saved_model.items():
                if key in RUN_SETTINGS or f"model.{key}" in given or key not in dcfg.model.keys():
                    continue
                if OmegaConf.is_missing(dcfg.model, key) or dcfg.model[key] != v:
                    taken.append(key)
                dcfg.model[key] = v
            data = saved.get("data") or {}
            adopted = {}
            if "data" in dcfg:
                for key in DATA_KEYS:
                    if key not in dcfg.data.keys() or f"data.{key}" in given:  # `in`: False if ???
                        continue
                    v = _tokenizer_dir(data.get(key), path) if key == "tokenizer_dir" else data.get(key)
                    now = None if OmegaConf.is_missing(dcfg.data, key) else dcfg.data[key]
                    if v is not None and now != v:
                        dcfg.data[key] = v
                        adopted[key] = v
        shape = ", ".join(f"{k}={saved_model.get(k)}" for k in (
            "num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "vocab_size"))
        notes.append(f"model from {path}: {saved_model.get('name')} ({shape}; "
                     f"{len(taken)} keys differed from model={model_choice})"
                     + "".join(f"; data.{k}={v}" for k, v in adopted.items())
                     + " -- pass model=<preset> or model.<key>=/data.<key>= to override")
    config_model = OmegaConf.to_container(dcfg.model, resolve=True)
    bad = architecture_mismatches(config_model, saved_model)
    if bad:
        by = f"model={model_choice}" if model_given and model_choice else "the command line"
        listed = "; ".join(f"model.{k}={a} here but {b} in the checkpoint" for k, a, b in bad)
        raise CheckpointModelError(
            f"{init_key}={path} was trained with another model shape: {listed} (set by {by}). "
            f"Drop model= to take the checkpoint's shape, or start from a checkpoint of this model")
    return notes


def adopt_for_hydra_job(dcfg: DictConfig, job: str) -> list[str]:
    """:func:`adopt_checkpoint_model` inside a running Hydra job ``job`` (``ppo``, ``sft``,
    ``rm``): the overrides and the ``model`` preset from ``HydraConfig``."""
    from hydra.core.hydra_config import HydraConfig

    hc = HydraConfig.get()
    return adopt_checkpoint_model(dcfg, INIT_FROM_KEYS[job], list(hc.overrides.task),
                                  hc.runtime.choices.get("model"))


def _tokenizer_dir(saved: Optional[str], path: Path) -> Optional[str]:
    """The checkpoint's tokenizer folder (:func:`~nemo_rlhf.checkpoint.layout.checkpoint_tokenizer_dir`:
    its own copy first, so a moved checkpoint keeps its tokenizer)."""
    return checkpoint_tokenizer_dir(path, saved)


__all__ = ["CheckpointModelError", "INIT_FROM_KEYS", "adopt_checkpoint_model", "adopt_for_hydra_job",
           "architecture_mismatches", "resolve_init_from"]
