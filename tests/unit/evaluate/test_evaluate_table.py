"""``nemo_rlhf.evaluate`` over several checkpoints: RM score, KL to a reference, repetition,
the per-step table and plot, and repeatability.

Fixtures (built once, no training): a printable-ASCII character tokenizer (the RM scorer
test's), two tiny actor checkpoints ``step_1`` / ``step_2`` under one ``checkpoints`` root
with different random weights (``init_method_std`` large enough that greedy decoding is
peaked, so a different model gives the responses a clearly lower log-prob), and a tiny RM
checkpoint whose own data section uses ChatML with a system prompt while the actors use
the raw prompt: an RM score computed with the actor's layout would differ from the
scorer's.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import pytest

from tests.single_rank import single_rank
from tests.unit.reward.test_rm_scorer import _make_tokenizer

RM_SYSTEM = "Be brief."
PROMPTS = [("3+4=", "7"), ("9-2=", "7"), ("2*3=", "6"), ("8+1=", "9"), ("5-5=", "0"), ("7*1=", "7")]
MAX_NEW = 4
try:
    import matplotlib  # noqa: F401
    HAVE_MPL = True
except ImportError:
    HAVE_MPL = False
NEEDS_MPL = pytest.mark.skipif(
    not HAVE_MPL, reason="matplotlib is not installed (nor listed in pyproject.toml): pip install matplotlib")

CHECKER = "arithmetic_exact_match"  # a built-in short name (nemo_rlhf.reward.functions)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """``{"root", "step1", "step2", "rm", "data", "tmp"}``."""
    from nemo_rlhf.checkpoint import save_checkpoint
    from nemo_rlhf.data.tokenizer import Tokenizer
    from nemo_rlhf.models.actor_critic import build_model
    from nemo_rlhf.models.config import load_model_preset

    tmp = tmp_path_factory.mktemp("eval_table")
    tok_dir = tmp / "tokenizer"
    _make_tokenizer(tok_dir)
    tok = Tokenizer(tok_dir)
    data = tmp / "eval.jsonl"
    data.write_text("".join(json.dumps({"prompt": p, "answer": a}) + "\n" for p, a in PROMPTS))
    actor_cfg = load_model_preset("tiny", vocab_size=tok.vocab_size, init_method_std=0.3)
    rm_cfg = load_model_preset("tiny", vocab_size=tok.vocab_size, value_head_init_std=0.5)
    actor_config = {"model": asdict(actor_cfg), "trainer": {"precision": "32"},
                    "data": {"tokenizer_dir": str(tok_dir)}}
    rm_config = {"model": asdict(rm_cfg), "trainer": {"precision": "32"},
                 "data": {"tokenizer_dir": str(tok_dir), "chat_template": "chatml",
                          "system_prompt": RM_SYSTEM}}
    root = tmp / "ppo" / "checkpoints"
    with single_rank(seed=3) as dims:
        for step, seed in ((1, 11), (2, 22)):
            model = build_model(actor_cfg, dims, "32", seed=seed)
            save_checkpoint(root, step, model, None, {"step": step}, actor_config, dims)
        rm = build_model(rm_cfg, dims, "32", kind="reward", seed=5)
        save_checkpoint(tmp / "rm" / "checkpoints", 4, rm, None, {"step": 4}, rm_config, dims)
    return {"root": root, "step1": root / "step_1", "step2": root / "step_2",
            "rm": tmp / "rm" / "checkpoints", "data": data, "tmp": tmp}


def _evaluate(ck, out: Path, **kw) -> dict:
    from nemo_rlhf.distributed import destroy_distributed
    from nemo_rlhf.evaluate import EvalConfig, evaluate

    kw.setdefault("checkpoint", str(ck["step2"]))
    cfg = EvalConfig(data=str(ck["data"]), out=str(out), max_new_tokens=MAX_NEW, batch_size=4, checker=CHECKER,
                     forward_micro_batch_size=4, **kw)
    try:
        return evaluate(cfg)
    finally:
        destroy_distributed()


def _numbers(result: dict) -> dict:
    """Every numeric field but ``time_s`` (examples included)."""
    out = {k: v for k, v in result.items() if isinstance(v, (int, float)) and k != "time_s"}
    out["examples"] = result["examples"]
    return out


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def step2_vs_step1(ckpts):
    """step_2 evaluated with the RM and reference step_1, with samples_out."""
    out = ckpts["tmp"] / "single" / "eval.json"
    res = _evaluate(ckpts, out, reference=str(ckpts["step1"]), rm_checkpoint=str(ckpts["rm"]),
                    samples_out=str(out.parent / "samples.jsonl"))
    return {"result": res, "out": out, "samples": _rows(out.parent / "samples.jsonl")}


def test_single_checkpoint_json_keeps_its_layout_and_adds_the_new_metrics(step2_vs_step1):
    res, out = step2_vs_step1["result"], step2_vs_step1["out"]
    assert json.loads(out.read_text()) == res and "rows" not in res
    for key in ("checkpoint", "step", "accuracy", "mean_response_length", "ended_fraction",
                "truncated_fraction", "num_responses", "examples", "time_s", "load_report"):
        assert key in res, key
    assert res["step"] == 2 and res["num_responses"] == len(PROMPTS)
    assert isinstance(res["rm_reward"], float) and isinstance(res["kl_to_reference"], float)
    assert 0.0 <= res["repetition"] < 1.0


def test_evaluating_one_checkpoint_twice_gives_identical_numbers(ckpts, step2_vs_step1):
    out = ckpts["tmp"] / "again" / "eval.json"
    again = _evaluate(ckpts, out, reference=str(ckpts["step1"]), rm_checkpoint=str(ckpts["rm"]),
                      samples_out=str(out.parent / "samples.jsonl"))
    assert _numbers(again) == _numbers(step2_vs_step1["result"])
    assert _rows(out.parent / "samples.jsonl") == step2_vs_step1["samples"]


def test_rm_reward_is_the_mean_of_the_rows_and_what_the_scorer_gives(ckpts, step2_vs_step1):
    from nemo_rlhf.reward.batching import ScoreItem
    from nemo_rlhf.reward.rm_scorer import RMScorerConfig, RewardModelScorer

    rows, res = step2_vs_step1["samples"], step2_vs_step1["result"]
    assert len(rows) == len(PROMPTS) and all(isinstance(r["rm_score"], float) for r in rows)
    assert res["rm_reward"] == pytest.approx(sum(r["rm_score"] for r in rows) / len(rows), abs=1e-9)
    with single_rank(seed=0) as dims:
        scorer = RewardModelScorer(RMScorerConfig(checkpoint=str(ckpts["rm"])), dims)
        direct = scorer.score_batch([ScoreItem(prompt=r["prompt"], response=r["response"]) for r in rows])
    assert [r["rm_score"] for r in rows] == pytest.approx(direct, abs=1e-5)
    assert len(set(round(s, 4) for s in direct)) > 1  # the scores differ: a real comparison


def test_kl_to_reference_is_zero_against_itself_and_positive_against_another(ckpts, step2_vs_step1):
    same = _evaluate(ckpts, ckpts["tmp"] / "self" / "eval.json", reference=str(ckpts["step2"]))
    assert abs(same["kl_to_reference"]) < 1e-6
    other = step2_vs_step1["result"]["kl_to_reference"]
    assert other > 0.1  # nats per sequence: a different random model
    rows = step2_vs_step1["samples"]
    assert other == pytest.approx(sum(r["kl_to_reference"] for r in rows) / len(rows), abs=1e-6)


def test_checkpoints_are_listed_once_in_step_order(ckpts):
    from nemo_rlhf.evaluate import EvalConfig, checkpoint_paths

    cfg = EvalConfig(checkpoints=[str(ckpts["step2"]), str(ckpts["step1"]), str(ckpts["root"])],
                     data="d.jsonl", out="o.json", checker=CHECKER)
    assert checkpoint_paths(cfg) == [ckpts["step1"], ckpts["step2"]]  # the root is its newest: step_2
    cfg = EvalConfig(checkpoint=str(ckpts["root"]), all_steps=True, data="d.jsonl", out="o.json", checker=CHECKER)
    assert checkpoint_paths(cfg) == [ckpts["step1"], ckpts["step2"]]


@NEEDS_MPL
def test_all_steps_writes_rows_in_step_order_a_markdown_table_and_a_png(ckpts, step2_vs_step1):
    out = ckpts["tmp"] / "steps" / "eval_steps.json"
    res = _evaluate(ckpts, out, checkpoint=str(ckpts["root"]), all_steps=True,
                    reference=str(ckpts["step1"]), rm_checkpoint=str(ckpts["rm"]),
                    extra_checkers=["just_the_number"])
    assert json.loads(out.read_text()) == res and list(res) == ["rows"]
    assert [r["step"] for r in res["rows"]] == [1, 2]
    assert abs(res["rows"][0]["kl_to_reference"]) < 1e-6  # step_1 against itself
    single = step2_vs_step1["result"]  # step_2 alone: the reference built once gives the same
    for key in ("accuracy", "rm_reward", "kl_to_reference", "repetition", "mean_response_length"):
        assert res["rows"][1][key] == single[key], key
    md = (out.parent / "eval_steps.md").read_text().splitlines()
    assert md[0] == ("| step | accuracy | rm_reward | mean_response_length | repetition | "
                     "kl_to_reference | just_the_number |")
    assert [line.split("|")[1].strip() for line in md[2:]] == ["1", "2"]
    png = (out.parent / "eval_steps.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 1000


def test_the_table_marks_missing_metrics_with_a_dash():
    from nemo_rlhf.metrics.steps_table import markdown_table, table_columns

    table = markdown_table([{"step": 3, "accuracy": 0.5, "repetition": float("nan")}],
                           table_columns(["just_the_number"]))
    assert table.splitlines()[2] == "| 3 | 0.5000 | - | - | - | - | - |"


def test_several_checkpoints_without_matplotlib_fail_naming_pip_install(ckpts, monkeypatch, tmp_path):
    import sys

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    with pytest.raises(ImportError, match="pip install matplotlib"):
        _evaluate(ckpts, tmp_path / "e.json", checkpoint=str(ckpts["root"]), all_steps=True)
    assert not (tmp_path / "e.json").exists()


def test_bad_checkpoint_keys_fail_naming_the_key(ckpts, tmp_path):
    from nemo_rlhf.evaluate import EvalConfig

    with pytest.raises(ValueError, match="all_steps=true needs checkpoint"):
        EvalConfig(checkpoints=[str(ckpts["step1"])], all_steps=True, data="d", out="o", checker=CHECKER)
    with pytest.raises(ValueError, match="checkpoint is missing"):
        EvalConfig(data="d", out="o", checker=CHECKER)
    with pytest.raises(ValueError, match=r"all_steps=true: checkpoint=.*one checkpoint folder"):
        _evaluate(ckpts, tmp_path / "e.json", checkpoint=str(ckpts["step1"]), all_steps=True)
    with pytest.raises(FileNotFoundError, match=r"checkpoints\[1\]="):
        _evaluate(ckpts, tmp_path / "e.json", checkpoints=[str(ckpts["step1"]), str(tmp_path / "nope")])
    with pytest.raises(FileNotFoundError, match="reference="):
        _evaluate(ckpts, tmp_path / "e.json", reference=str(tmp_path / "nope"))
    with pytest.raises(FileNotFoundError, match="rm_checkpoint="):
        _evaluate(ckpts, tmp_path / "e.json", rm_checkpoint=str(tmp_path / "nope"))
    assert not (tmp_path / "e.json").exists()


def test_repetition_is_the_trainers_3gram_rate_over_the_generated_tokens_only():
    from nemo_rlhf.evaluate import repetition_rates

    # tokens 5 6 7 5 6 7 2 (+ a pad): 3-grams 567 675 756 567 672, one repeat in five
    ids = [[5, 6, 7, 5, 6, 7, 2, 0], [1, 2, 3, 0, 0, 0, 0, 0]]
    mask = [[True] * 7 + [False], [True, True, True] + [False] * 5]
    assert repetition_rates(ids, mask) == pytest.approx([0.2, 0.0])


def test_sequence_kl_is_the_ppo_trainers_kl_mean_estimator():
    import torch

    from nemo_rlhf.algorithms.ppo.token_rewards import compute_token_rewards
    from nemo_rlhf.evaluate import sequence_kl

    g = torch.Generator().manual_seed(0)
    lp, ref = -torch.rand(3, 5, generator=g) * 3, -torch.rand(3, 5, generator=g) * 3
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [1, 0, 0, 0, 0]], dtype=torch.bool)
    lp_padded = torch.where(mask, lp, torch.full_like(lp, -50.0))  # pads must not count
    # the trainer: compute_token_rewards' per-token KL (kl.estimator=k1), masked, summed per row
    _, kl = compute_token_rewards(lp, ref, torch.zeros(3), mask, 0.0, kl_estimator="k1")
    expected = torch.where(mask, kl, 0.0).sum(-1)
    got = sequence_kl(lp_padded, ref, mask)
    assert got.dtype == torch.float32 and torch.allclose(got, expected, atol=1e-6)
    assert torch.allclose(got, ((lp - ref) * mask).sum(-1), atol=1e-6)


def test_samples_out_has_the_schema_of_the_trainers_eval_samples(step2_vs_step1, tmp_path):
    """One schema for both per-response files (nemo_rlhf/data/sample_rows.py): the same five
    fields first, the prompt row's fields under ``extras`` in both, the same types."""
    import types

    from nemo_rlhf.data.sample_rows import SAMPLE_ROW_KEYS
    from nemo_rlhf.trainers.ppo.evaluation import write_eval_samples

    rows = step2_vs_step1["samples"]
    answers = dict(PROMPTS)
    for r in rows:
        assert list(r)[:5] == list(SAMPLE_ROW_KEYS), list(r)
        assert r["extras"] == {"answer": answers[r["prompt"]]}
        assert "answer" not in r and "response_length" not in r
    path = write_eval_samples(tmp_path, 3, [types.SimpleNamespace(prompt="3+4=", extras={"answer": "7"})],
                              [{"text": "7", "score": 0.5, "correct": 1.0, "len": 2, "rep": 0.0,
                                "extra": {}, "src": {"rm": 0.5}}])
    trained = json.loads(path.read_text())
    assert list(trained)[:5] == list(SAMPLE_ROW_KEYS)
    assert trained["extras"] == {"answer": "7"}
    for key in SAMPLE_ROW_KEYS:
        assert type(trained[key]) is type(rows[0][key]), key


def test_episodes_are_scored_whole_by_the_rm_as_ppos_served_rm_reads_them(ckpts, tmp_path):
    """``env.name`` with ``rm_checkpoint`` (#51): each two-turn episode's ``rm_score`` is the
    RM's score of its whole conversation (the prompt's user message, the first turn, the
    environment's observation, the final turn; the RM's ChatML and system prompt render it),
    as PPO's served RM reads it (``reward.rm_input=conversation``), not of the final answer
    alone; ``rm_input=final_answer`` gives the final answer's score; the rows carry the
    messages."""
    from nemo_rlhf.reward.batching import ScoreItem
    from nemo_rlhf.reward.rm_scorer import RMScorerConfig, RewardModelScorer
    from nemo_rlhf.envs.config import EnvConfig
    from tests.ppo_helpers import TwoTurnEnv

    env = EnvConfig(name="tests.ppo_helpers:two_turn_env", max_turns=2, max_total_tokens=64)
    rm = _long_rm(ckpts, tmp_path / "rm")  # the fixture's RM, 512 positions: ChatML conversations in characters
    got = {}
    for rm_input in ("conversation", "final_answer"):
        out = tmp_path / rm_input / "eval.json"
        res = _evaluate(ckpts, out, rm_checkpoint=str(rm), rm_input=rm_input, env=env,
                        samples_out=str(out.parent / "samples.jsonl"))
        got[rm_input] = (res, _rows(out.parent / "samples.jsonl"))
    res, rows = got["conversation"]
    assert len(rows) == len(PROMPTS) and res["episode"]["turns_mean"] == 2.0
    for r in rows:
        (user, first, obs, final) = r["messages"]
        assert user == {"role": "user", "content": r["prompt"]} and obs["content"] == TwoTurnEnv.OBSERVATION
        assert first["role"] == final["role"] == "assistant" and final["content"] == r["response"]
    assert res["examples"][0]["messages"] == rows[0]["messages"]
    with single_rank(seed=0) as dims:
        scorer = RewardModelScorer(RMScorerConfig(checkpoint=str(rm)), dims)
        whole = scorer.score_batch([ScoreItem(messages=r["messages"]) for r in rows])
        final = scorer.score_batch([ScoreItem(prompt=r["prompt"], response=r["response"]) for r in rows])
    assert [r["rm_score"] for r in rows] == pytest.approx(whole, abs=1e-5)
    assert res["rm_reward"] == pytest.approx(sum(whole) / len(whole), abs=1e-6)
    assert max(abs(a - b) for a, b in zip(whole, final)) > 1e-3  # the first turn and the observation count
    res_final, rows_final = got["final_answer"]
    assert [r["response"] for r in rows_final] == [r["response"] for r in rows]  # the same episodes
    assert [r["rm_score"] for r in rows_final] == pytest.approx(final, abs=1e-5)


def _long_rm(ck, root: Path) -> Path:
    """A tiny RM checkpoint like the fixture's (ChatML, :data:`RM_SYSTEM`) with 512 positions:
    a character tokenizer spells a two-turn conversation's ChatML out in over 128 tokens."""
    from nemo_rlhf.checkpoint import save_checkpoint
    from nemo_rlhf.data.tokenizer import Tokenizer
    from nemo_rlhf.models.actor_critic import build_model
    from nemo_rlhf.models.config import load_model_preset

    tok_dir = ck["tmp"] / "tokenizer"
    cfg = load_model_preset("tiny", vocab_size=Tokenizer(tok_dir).vocab_size, value_head_init_std=0.5,
                            max_position_embeddings=512)
    config = {"model": asdict(cfg), "trainer": {"precision": "32"},
              "data": {"tokenizer_dir": str(tok_dir), "chat_template": "chatml", "system_prompt": RM_SYSTEM}}
    with single_rank(seed=3) as dims:
        save_checkpoint(root / "checkpoints", 4, build_model(cfg, dims, "32", kind="reward", seed=5), None,
                        {"step": 4}, config, dims)
    return root / "checkpoints"
