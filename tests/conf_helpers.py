"""The job configs under ``conf/`` composed with Hydra and converted to their typed schemas
(what the entry points do), for the config tests."""

from __future__ import annotations

import importlib

from nemo_rlhf.config import to_typed
from nemo_rlhf.models.config import CONF_DIR

USER_DATA = ["data.train_file=train.jsonl", "data.tokenizer_dir=tok"]
"""What the real-model job configs leave to the user (``???``)."""

JOBS = {  # conf/<name>.yaml -> (entry module registering the schema, schema, required overrides)
    "ppo": ("nemo_rlhf.train_ppo", "nemo_rlhf.trainers.ppo.config:PPOConfig", USER_DATA),
    "ppo_tiny": ("nemo_rlhf.train_ppo", "nemo_rlhf.trainers.ppo.config:PPOConfig", []),
    "ppo_smollm2": ("nemo_rlhf.train_ppo", "nemo_rlhf.trainers.ppo.config:PPOConfig", []),
    "sft": ("nemo_rlhf.train_sft", "nemo_rlhf.trainers.sft:SFTRunConfig", USER_DATA),
    "sft_tiny": ("nemo_rlhf.train_sft", "nemo_rlhf.trainers.sft:SFTRunConfig", []),
    "rm": ("nemo_rlhf.train_rm", "nemo_rlhf.trainers.rm:RMRunConfig", USER_DATA),
    "rm_tiny": ("nemo_rlhf.train_rm", "nemo_rlhf.trainers.rm:RMRunConfig", []),
    "rm_server": ("nemo_rlhf.serve_rm", "nemo_rlhf.serve_rm:ServeRMConfig", ["checkpoint=ck"]),
    "eval": ("nemo_rlhf.evaluate", "nemo_rlhf.evaluate:EvalConfig",
             ["checkpoint=ck", "data=d.jsonl", "out=o.json"]),
}


def schema(name: str):
    """The dataclass schema of ``conf/<name>.yaml`` (its entry module imported: registered)."""
    module, target, _ = JOBS[name]
    importlib.import_module(module)
    mod, _, cls = target.partition(":")
    return getattr(importlib.import_module(mod), cls)


def compose_job(name: str, overrides=()):
    """``conf/<name>.yaml`` + its required overrides + ``overrides``, composed (a DictConfig)."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    schema(name)
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        return compose(name, overrides=[*JOBS[name][2], *overrides])


def typed_job(name: str, overrides=()):
    """:func:`compose_job` converted by :func:`nemo_rlhf.config.to_typed` to its schema."""
    return to_typed(compose_job(name, overrides), schema(name))
