"""PPO, SFT and RM share one ``trainer`` / ``exp_manager`` vocabulary: the same keys with the
same meanings; a renamed key is refused naming the new one, and ``exp_manager.resume`` is
``auto`` | ``none`` | a path in every job (SFT/RM's former booleans are refused, naming
what they became)."""

from __future__ import annotations

import subprocess

import pytest
from hydra.core.global_hydra import GlobalHydra

from nemo_rlhf.config import RENAMED_KEYS, check_renamed_keys
from nemo_rlhf.models.config import CONF_DIR
from tests.conf_helpers import typed_job


@pytest.mark.parametrize("job,value", [("ppo", "true"), ("sft", "false"), ("rm", "True")])
def test_a_boolean_resume_is_refused_naming_what_it_became(job, value):
    with pytest.raises(ValueError) as err:
        typed_job(job, [f"exp_manager.resume={value}"])
    assert str(err.value) == (f"exp_manager.resume='{value.capitalize()}': valid choices are ['auto', "
                              f"'none'] or a checkpoint path (a former true is 'auto', false is 'none')")


def test_keep_last_is_all_or_at_least_two():
    assert typed_job("sft").exp_manager.keep_last == 0  # SFT/RM: every checkpoint kept, as before
    assert typed_job("ppo").exp_manager.keep_last == 2
    with pytest.raises(ValueError, match=r"exp_manager.keep_last=1: must be 0 \(keep all\) or >= 2"):
        typed_job("rm", ["exp_manager.keep_last=1"])


def test_the_shared_vocabulary_has_the_same_keys_in_every_training_job():
    sections = {}
    for job in ("ppo", "sft", "rm"):
        cfg = typed_job(job)
        for section in ("trainer", "exp_manager"):
            sections.setdefault(section, []).append(set(vars(getattr(cfg, section))))
    assert set.intersection(*sections["trainer"]) >= {"precision", "max_steps", "seed", "val_check_interval"}
    assert set.intersection(*sections["exp_manager"]) >= {"exp_dir", "save_interval", "keep_last", "resume"}
    for old in RENAMED_KEYS:
        if old.split(".")[0] not in sections:
            continue  # a PPO section: test_a_renamed_ppo_knob_...
        assert all(old.split(".")[1] not in keys for keys in sections[old.split(".")[0]])


@pytest.mark.parametrize("override", ["trainer.save_interval=5", "+trainer.save_interval=5"])
def test_a_renamed_key_is_refused_naming_the_new_one(override):
    with pytest.raises(ValueError, match=r"trainer.save_interval was renamed exp_manager.save_interval "
                                         r"\(the same setting\): pass exp_manager.save_interval=5"):
        check_renamed_keys([override])
    check_renamed_keys(["exp_manager.save_interval=5", "trainer.max_steps=3"])


def test_the_slurm_launcher_refuses_a_renamed_key_naming_the_new_one():
    from launchers.slurm import LaunchError, compose_job

    GlobalHydra.instance().clear()
    with pytest.raises(LaunchError, match="rm overrides: trainer.save_interval was renamed exp_manager.save_interval"):
        compose_job("rm", ["trainer.save_interval=100"])


def test_the_sft_entry_point_refuses_a_renamed_key_naming_the_new_one(tmp_path, entry_point_python):
    res = subprocess.run([entry_point_python, "-m", "nemo_rlhf.train_sft", "trainer.save_interval=100",
                          f"exp_manager.exp_dir={tmp_path}"], cwd=CONF_DIR.parent, capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 1
    assert "pass exp_manager.save_interval=100" in res.stderr


PPO_RENAMES = {k: v for k, v in RENAMED_KEYS.items() if k.startswith(("ppo.", "kl."))}
VALUES = {"ppo.norm_by_std": ("false", False)}
"""A value of the key's type, as typed and as held, for the keys that are not floats."""


@pytest.mark.parametrize("old,new", sorted(PPO_RENAMES.items()))
def test_a_renamed_ppo_knob_is_refused_on_the_command_line_and_in_a_config(old, new):
    """The PPO knobs carry the math's names (clip_eps, gamma, lam, entropy_coef,
    init_kl_coef, norm_by_std): the old spelling is refused naming the new one, the new one is what the
    typed config holds."""
    text, value = VALUES.get(new, ("0.3", 0.3))
    with pytest.raises(ValueError, match=rf"{old} was renamed {new} \(the same setting\): pass {new}={text}"):
        check_renamed_keys([f"{old}={text}"])
    from nemo_rlhf.config import check_renamed_config

    section, leaf = old.split(".")
    with pytest.raises(ValueError, match=rf"{old} was renamed {new}.*sets {old}={value}; write {new} instead"):
        check_renamed_config({section: {leaf: value, "other": 1}})
    cfg = typed_job("ppo", [f"{new}={text}"])
    assert getattr(getattr(cfg, new.split(".")[0]), new.split(".")[1]) == value
    assert value != getattr(type(getattr(cfg, section))(), new.split(".")[1])  # not the default
    assert not hasattr(getattr(cfg, section), leaf)


def test_the_ppo_entry_point_refuses_a_renamed_knob_set_in_a_yaml_file(tmp_path, entry_point_python):
    """A user's own config file (``--config-dir``) with an old key: refused naming the new
    one, not a bare "key not in struct"."""
    (tmp_path / "mine.yaml").write_text("defaults:\n  - ppo_tiny\n  - _self_\nppo:\n  gae_lambda: 0.9\n")
    res = subprocess.run([entry_point_python, "-m", "nemo_rlhf.train_ppo", "--config-dir", str(tmp_path),
                          "--config-name", "mine", f"exp_manager.exp_dir={tmp_path}/exp"],
                         cwd=CONF_DIR.parent, capture_output=True, text=True, timeout=120)
    assert res.returncode != 0
    assert "ppo.gae_lambda was renamed ppo.lam" in res.stderr, res.stderr[-2000:]
