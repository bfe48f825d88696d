"""Reward functions, their registry, and CombinedReward."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from nemo_rlhf.reward.client import RewardServiceError
from nemo_rlhf.reward.functions import (
    CombinedReward,
    RemoteRewardModel,
    RewardFunctionScorer,
    WeightedSource,
    BUILTIN_REWARD_FUNCTIONS,
    check_reward_function_spec,
    get_reward_function,
)
from nemo_rlhf.reward.normalization import RewardNormalizer


def length_reward(prompts, responses, extras):
    """A module-level function reachable by dotted path."""
    return [float(len(r)) for r in responses]


def exact_match(prompts, responses, extras):
    """1.0 when the response is the row's ``answer``."""
    return [float(r.strip() == str(e["answer"])) for r, e in zip(responses, extras)]


EXACT_MATCH = f"{__name__}:exact_match"


def test_reward_functions_resolve_by_path_and_short_name_and_errors_name_the_key():
    assert get_reward_function(EXACT_MATCH) is exact_match
    assert get_reward_function(f"{__name__}:length_reward") is length_reward
    with pytest.raises(ValueError, match=r"reward.functions\[0\].name='exact_match': valid choices are "
                                         r"\['arithmetic_exact_match', 'env', 'just_the_number', 'two_digit_addition'\] "
                                         r"\(the built-in short names\) or a 'package.module:function' path"):
        get_reward_function("exact_match", "reward.functions[0].name")
    for bad in ("", ":fn", "mod:", None, 3):
        with pytest.raises(ValueError, match="trainer.eval_checker=.*: valid choices are .* or a 'package.module:function' path"):
            check_reward_function_spec("trainer.eval_checker", bad)
    with pytest.raises(ImportError, match=r"^checker='no_such_pkg.mod:fn': cannot import module 'no_such_pkg.mod'"):
        get_reward_function("no_such_pkg.mod:fn", "checker")
    with pytest.raises(AttributeError, match="reward function='nemo_rlhf.reward.functions:nope': module "
                                             "'nemo_rlhf.reward.functions' has no attribute 'nope'"):
        get_reward_function("nemo_rlhf.reward.functions:nope")
    with pytest.raises(TypeError, match="BUILTIN_REWARD_FUNCTIONS is a dict, not a callable"):
        get_reward_function("nemo_rlhf.reward.functions:BUILTIN_REWARD_FUNCTIONS")
    # a short name is resolved through the table, and its errors say what was tried
    BUILTIN_REWARD_FUNCTIONS["test_functions_gone"] = "nemo_rlhf.reward.functions:gone"
    try:
        with pytest.raises(AttributeError, match=r"^x='test_functions_gone' \(built-in: "
                                                 r"'nemo_rlhf.reward.functions:gone'\): module"):
            get_reward_function("test_functions_gone", "x")
    finally:
        del BUILTIN_REWARD_FUNCTIONS["test_functions_gone"]


class FakeClient:
    def __init__(self, fail: bool = False):
        self.fail = fail

    def score_texts(self, prompts, responses):
        if self.fail:
            raise RewardServiceError("reward service http://127.0.0.1:1/score: connection failed")
        return [2.0 + len(r) for r in responses]


def test_combined_reward_sums_weighted_normalised_sources_and_reports_each():
    reward = CombinedReward([
        WeightedSource("rm", RemoteRewardModel(FakeClient()), weight=0.5,
                       normalizer=RewardNormalizer("fixed", mean=2.0, std=2.0)),
        WeightedSource("exact_match", RewardFunctionScorer(EXACT_MATCH), weight=1.0),
    ])
    out = reward.score(["1+1=", "2+2="], ["2", "five"], [{"answer": "2"}, {"answer": "4"}])
    # rm raw: [3, 6] -> normalised [0.5, 2.0] -> weighted [0.25, 1.0]; exact match [1, 0]
    assert out.scores.tolist() == [1.25, 1.0] and out.scores.dtype == torch.float32
    assert out.per_source["rm"].tolist() == [3.0, 6.0]
    assert out.per_source_normalized["rm"].tolist() == [0.5, 2.0]
    assert out.per_source["exact_match"].tolist() == [1.0, 0.0]
    assert out.metrics() == {"reward/total": 1.125, "reward/rm": 4.5, "reward/rm_normalized": 1.25,
                             "reward/exact_match": 0.5, "reward/exact_match_normalized": 0.5}


def test_combined_reward_propagates_rm_failure_and_rejects_bad_source_output():
    failing = CombinedReward([WeightedSource("rm", RemoteRewardModel(FakeClient(fail=True)))])
    with pytest.raises(RewardServiceError, match="connection failed"):
        failing.score(["p"], ["r"])
    short = CombinedReward([WeightedSource("f", RewardFunctionScorer(lambda p, r, e: [1.0] * (len(p) - 1)))])
    with pytest.raises(ValueError, match="returned 1 rewards for 2 samples"):
        short.score(["a", "b"], ["c", "d"])
    nan = CombinedReward([WeightedSource("f", RewardFunctionScorer(lambda p, r, e: [float("nan")] * len(p)))])
    with pytest.raises(ValueError, match="expected a finite float"):
        nan.score(["a"], ["b"])
    with pytest.raises(ValueError, match="duplicate source names"):
        CombinedReward([WeightedSource("a", FakeClient()), WeightedSource("a", FakeClient())])


def test_an_absurd_finite_score_is_refused_naming_source_value_position_and_key():
    absurd = RewardFunctionScorer(lambda p, r, e: [1.0, 1e30][:len(p)])
    with pytest.raises(ValueError, match=r"'rm' returned 1e\+30 at position 1: past reward.max_abs_score=1e\+06"):
        CombinedReward([WeightedSource("rm", absurd)], max_abs_score=1e6).score(["a", "b"], ["c", "d"])
    # off (null): taken as it is
    assert CombinedReward([WeightedSource("rm", absurd)]).score(["a", "b"], ["c", "d"]).raw_scores[1] == 1e30
    with pytest.raises(ValueError, match="reward.max_abs_score=0"):
        CombinedReward([WeightedSource("rm", absurd)], max_abs_score=0)


def test_combined_reward_state_dict_carries_running_stats():
    def make():
        return CombinedReward([WeightedSource("len", RewardFunctionScorer(length_reward), normalizer=RewardNormalizer("running"))])

    a = make()
    a.score(["p"] * 3, ["a", "bbb", "cccccc"])
    b = make()
    b.load_state_dict(a.state_dict())
    assert torch.equal(a.score(["p"], ["dd"]).scores, b.score(["p"], ["dd"]).scores)
    with pytest.raises(KeyError, match="no state for source 'len'"):
        make().load_state_dict({})


def test_combined_reward_normalize_false_returns_raw_weighted_sum():
    from nemo_rlhf.reward.functions import CombinedReward, RewardFunctionScorer, WeightedSource
    from nemo_rlhf.reward.normalization import RewardNormalizer

    src = RewardFunctionScorer(lambda p, r, e: [float(len(x)) for x in r])
    combined = CombinedReward([WeightedSource("len", src, 2.0, RewardNormalizer("fixed", mean=1.0, std=2.0))])
    normed = combined.score(["a", "b"], ["xyz", "x"], [{}, {}])
    raw = combined.score(["a", "b"], ["xyz", "x"], [{}, {}], normalize=False)
    assert normed.scores.tolist() == [2.0, 0.0]  # 2 * (len - 1) / 2
    assert raw.scores.tolist() == [6.0, 2.0]  # 2 * len, no normalisation


def test_changed_sources_compares_identities_and_reset_restarts_only_those():
    def make(path):
        return CombinedReward([
            WeightedSource("rm", RewardFunctionScorer(length_reward), normalizer=RewardNormalizer("running"),
                           identity={"checkpoint_path": path, "checkpoint_step": 3}),
            WeightedSource("len", RewardFunctionScorer(length_reward), normalizer=RewardNormalizer("running"))])

    a = make("/rm/a")
    a.score(["p"] * 3, ["a", "bbb", "cccccc"])
    saved, ids = a.state_dict(), a.identities()
    assert ids == {"rm": {"checkpoint_path": "/rm/a", "checkpoint_step": 3}}
    assert make("/rm/a").changed_sources(ids) == {}
    b = make("/rm/b")
    assert b.changed_sources(ids) == {"rm": (ids["rm"], {"checkpoint_path": "/rm/b", "checkpoint_step": 3})}
    assert b.changed_sources({}) == {}  # a checkpoint from before identities were recorded
    b.load_state_dict(saved, reset=["rm"])
    rm, length = b.sources
    assert rm.normalizer.count == 0 and length.normalizer.count == 3
    with pytest.raises(KeyError, match=r"reset names unknown sources \['critic'\]"):
        b.load_state_dict(saved, reset=["critic"])


def test_configs_naming_the_task_checkers_validate_in_a_fresh_process():
    """Which short names a config may use does not depend on what the process imported:
    in a fresh interpreter that imported only the config schemas, the built-in names
    validate (before, they were registered by importing ``nemo_rlhf.tasks`` and were
    refused without it), and validating imports no task module."""
    code = ("import sys; from nemo_rlhf.reward.config import RewardConfig, RewardFunctionSpec; "
            "from nemo_rlhf.trainers.ppo.config import PPOTrainerConfig; "
            "t = PPOTrainerConfig(eval_checker='two_digit_addition', eval_extra_checkers=['just_the_number'], "
            "eval_judge='arithmetic_exact_match'); "
            "RewardConfig(functions=[RewardFunctionSpec(name='arithmetic_exact_match')]); "
            "print(sorted(m for m in sys.modules if m.startswith('nemo_rlhf.tasks')), "
            "PPOTrainerConfig().eval_checker, repr(RewardFunctionSpec().name))")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.split() == ["[]", "None", "''"], run.stdout
    # and resolving a short name imports its module, in any process
    code = ("from nemo_rlhf.reward.functions import get_reward_function as g; "
            "print(g('two_digit_addition').__module__, g('arithmetic_exact_match')(['1+1='], ['2'], [{'answer': 2}]))")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.split() == ["nemo_rlhf.tasks.addition", "[1.0]"], run.stdout
