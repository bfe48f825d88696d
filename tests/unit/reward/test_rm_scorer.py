"""The served reward model scores exactly as the RM does in process.

A tiny RM (``tiny`` preset, a printable-ASCII character tokenizer made here, ChatML with a
system prompt) is saved with :func:`save_checkpoint` as the RM trainer saves it; its
in-process scores (one unpadded row at a time, token layout written out in the test) are
the reference for

* :class:`RewardModelScorer` in this process (batched, right-padded, micro-batched);
* ``python -m nemo_rlhf.serve_rm`` in a subprocess, through :class:`RewardModelClient`;
* ``launchers.local.run_ppo_with_rm`` with a 2-rank pipeline-parallel RM server (torchrun)
  and a fake trainer script that scores through the address file and exits with the
  requeue code.

Every subprocess runs in its own process group and is killed in a ``finally``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import httpx
import pytest
import torch

REPO = Path(__file__).resolve().parents[3]
SYSTEM = "Be brief."
PROMPTS = [("3+3*6=", "21"), ("What is 2+2?", "4"), ("Say hi", "hi there, friend"), ("x", ""),
           ("Two words or three", "ok")]


# --------------------------------------------------------------------------- fixtures
def _make_tokenizer(directory: Path) -> None:
    """Character-level WordLevel tokenizer over printable ASCII and newline."""
    import string

    from tokenizers import Regex, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as HFTokenizer

    specials = {"pad_token": "<pad>", "bos_token": "<bos>", "eos_token": "<eos>"}
    vocab = {tok: i for i, tok in enumerate(specials.values())}
    for ch in string.printable:
        vocab.setdefault(ch, len(vocab))
    tok = HFTokenizer(models.WordLevel(vocab))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(list(specials.values()))
    directory.mkdir(parents=True)
    tok.save(str(directory / "tokenizer.json"))
    (directory / "special_tokens.json").write_text(json.dumps(specials))


def _reference_ids(tok, prompt: str, response: str) -> list[int]:
    """The RM trainer's layout, written out: BOS, ChatML prompt, response, EOS."""
    from nemo_rlhf.data.templates import format_prompt

    return [tok.bos_id] + tok.encode(format_prompt(prompt, "chatml", SYSTEM)) + tok.encode(response) + [tok.eos_id]


def _save_rm(tmp: Path, tok, tok_dir: Path, dims, seed: int, stats: dict, name: str = "checkpoints"):
    """A tiny RM of init ``seed`` saved as the RM trainer saves it (its training-set
    ``stats``); returns (checkpoint root, its in-process scores of PROMPTS)."""
    from nemo_rlhf.checkpoint import save_checkpoint
    from nemo_rlhf.data.datasets import DataConfig
    from nemo_rlhf.models.actor_critic import build_model
    from nemo_rlhf.models.config import load_model_preset
    from nemo_rlhf.models.engine import model_forward
    from nemo_rlhf.trainers.common import to_plain
    from nemo_rlhf.trainers.rm import RMRunConfig
    from nemo_rlhf.trainers.supervised import SupervisedExpManagerConfig

    model_cfg = load_model_preset("tiny", vocab_size=tok.vocab_size, value_head_init_std=0.5)
    model = build_model(model_cfg, dims, "32", kind="reward", seed=seed)
    model.eval()
    with torch.no_grad():
        ref = []
        for prompt, response in PROMPTS:
            ids = torch.tensor([_reference_ids(tok, prompt, response)])
            ref.append(model_forward(model, ids, torch.ones_like(ids))[0, -1].item())
    run_cfg = RMRunConfig(
        model=model_cfg,
        data=DataConfig(train_file="unused.jsonl", tokenizer_dir=str(tok_dir), chat_template="chatml",
                        system_prompt=SYSTEM),
        exp_manager=SupervisedExpManagerConfig(exp_dir=str(tmp)))
    root = tmp / name
    save_checkpoint(root, 5, model, None, {"step": 5, **stats}, to_plain(run_cfg), dims)
    return root, ref


@pytest.fixture(scope="module")
def rm(tmp_path_factory):
    """Single-rank distributed state, a saved RM checkpoint and its in-process scores."""
    from nemo_rlhf.data.tokenizer import Tokenizer
    from nemo_rlhf.distributed import LaunchEnv, ParallelConfig, destroy_distributed, initialize_distributed

    tmp = tmp_path_factory.mktemp("rm")
    tok_dir = tmp / "tokenizer"
    _make_tokenizer(tok_dir)
    tok = Tokenizer(tok_dir)
    dims = initialize_distributed(ParallelConfig(), seed=7,
                                  launch_env=LaunchEnv(0, 1, 0, "127.0.0.1", 0, "single"))
    try:
        root, ref = _save_rm(tmp, tok, tok_dir, dims, 7, {"reward_mean": 0.25, "reward_std": 1.5,
                                                           "reward_stats_count": 8})
        yield {"root": root, "tok": tok, "tok_dir": tok_dir, "ref": ref, "dims": dims, "tmp": tmp}
    finally:
        destroy_distributed()


def _text_items():
    from nemo_rlhf.reward.batching import ScoreItem

    return [ScoreItem(prompt=p, response=r) for p, r in PROMPTS]


def _token_items(tok):
    from nemo_rlhf.data.datasets import encode_prompt
    from nemo_rlhf.reward.batching import ScoreItem

    out = []
    for p, r in PROMPTS:
        prompt_ids = encode_prompt(tok, p, "chatml", SYSTEM)
        out.append(ScoreItem(prompt_ids=prompt_ids, response_ids=tok.encode(r) + [tok.eos_id]))
    return out


# --------------------------------------------------------------------------- in process
def test_scorer_matches_in_process_model_for_text_and_token_items(rm):
    from nemo_rlhf.reward.rm_scorer import RMScorerConfig, RewardModelScorer

    scorer = RewardModelScorer(RMScorerConfig(checkpoint=str(rm["root"]), micro_batch_size=3), rm["dims"])
    assert scorer.score_batch(_text_items()) == pytest.approx(rm["ref"], abs=1e-5)
    assert scorer.score_batch(_token_items(rm["tok"])) == pytest.approx(rm["ref"], abs=1e-5)
    # batch composition does not matter (padding, micro-batch filler rows)
    assert scorer.score_batch(_text_items()[2:3]) == pytest.approx(rm["ref"][2:3], abs=1e-5)
    assert len(set(round(s, 4) for s in rm["ref"])) == len(PROMPTS)  # scores are not trivial

    meta = scorer.metadata()
    assert meta["checkpoint_step"] == 5 and meta["checkpoint_path"].endswith("step_5")
    assert meta["reward_mean"] == 0.25 and meta["reward_std"] == 1.5 and meta["reward_stats_count"] == 8
    assert meta["vocab_size"] == rm["tok"].vocab_size == scorer.vocab_size
    assert meta["model_name"] == "tiny" and meta["chat_template"] == "chatml"
    # the checkpoint's own copy of the run's tokenizer (a moved checkpoint keeps it)
    assert meta["tokenizer_dir"] == str((Path(meta["checkpoint_path"]) / "tokenizer").resolve())
    assert (Path(meta["tokenizer_dir"]) / "tokenizer.json").read_bytes() == (
        rm["tok_dir"] / "tokenizer.json").read_bytes()
    json.dumps(meta)
    scorer.close()


def test_scorer_rejects_bad_items_naming_them_and_truncates_on_request(rm):
    from nemo_rlhf.reward.batching import ItemRejected, ItemTooLong, ScoreItem
    from nemo_rlhf.reward.rm_scorer import RMScorerConfig, RewardModelScorer

    from nemo_rlhf.data.datasets import encode_prompt

    limit = len(encode_prompt(rm["tok"], "q", "chatml", SYSTEM)) + 5  # room for 5 response tokens
    cfg = RMScorerConfig(checkpoint=str(rm["root"] / "step_5"), max_seq_length=limit)
    scorer = RewardModelScorer(cfg, rm["dims"])
    ok = ScoreItem(prompt="hi", response="yo")
    with pytest.raises(ValueError, match=r"items\[1\]: .*cannot tokenize"):
        scorer.score_batch([ok, ScoreItem(prompt="caf\u00e9", response="x")])
    with pytest.raises(ValueError, match=r"items\[0\]\.response_ids\[1\]: token id 100000 out of range"):
        scorer.score_batch([ScoreItem(prompt_ids=[1], response_ids=[5, 100000])])
    long = ScoreItem(prompt="q", response="a" * 60)
    with pytest.raises(ValueError, match=rf"items\[0\]: \d+ tokens .* exceed max_seq_length={limit}; set overlong_policy=truncate"):
        scorer.score_batch([long])
    with pytest.raises(ValueError, match=r"items\[0\]: .* exceed max_seq_length=\d+$"):  # the prompt alone is too long
        scorer.score_batch([ScoreItem(prompt="q" * 6, response="")])
    # check_items (run by the server before batching) refuses the same items, naming them
    scorer.check_items([ok, ScoreItem(prompt_ids=[1], response_ids=[5])])
    with pytest.raises(ItemTooLong, match=rf"items\[1\]: \d+ tokens .* exceed max_seq_length={limit}") as info:
        scorer.check_items([ok, long])
    assert info.value.status == 413 and info.value.field == "items[1]"
    with pytest.raises(ItemTooLong, match=rf"items\[0\]: \d+ tokens .* exceed max_seq_length={limit}"):
        scorer.check_items([ScoreItem(prompt_ids=[1] * limit, response_ids=[5])])
    with pytest.raises(ItemRejected, match=r"items\[1\]: .*cannot tokenize") as info:
        scorer.check_items([ok, ScoreItem(prompt="caf\u00e9", response="x")])
    assert info.value.status == 422
    cut = RewardModelScorer(replace(cfg, overlong_policy="truncate"), rm["dims"])
    cut.check_items([long])  # the truncate policy applies: accepted
    with pytest.raises(ItemTooLong):
        cut.check_items([ScoreItem(prompt="q" * 6, response="")])
    ids = cut.encode(long)
    assert len(ids) == limit and ids[-1] != rm["tok"].eos_id  # response cut, EOS lost, as in RM training
    assert cut.score_batch([long]) == pytest.approx(
        cut.score_batch([ScoreItem(prompt_ids=ids, response_ids=[])]), abs=1e-6)


def test_rm_server_config_composes_and_misspelt_keys_fail_naming_them():
    from hydra import compose, initialize_config_dir
    from hydra.errors import ConfigCompositionException
    from omegaconf import OmegaConf

    from nemo_rlhf.models.config import CONF_DIR
    from nemo_rlhf.serve_rm import ServeRMConfig

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        cfg = OmegaConf.to_object(compose("rm_server", overrides=[
            "checkpoint=/x", "server.port=0", "server.address_file=/tmp/a",
            "parallel.tensor_model_parallel_size=2"]))
        assert isinstance(cfg, ServeRMConfig)
        assert cfg.server.host == "127.0.0.1" and cfg.parallel.tensor_model_parallel_size == 2
        with pytest.raises(ConfigCompositionException, match="server.prot"):
            compose("rm_server", overrides=["checkpoint=/x", "server.prot=1"])
        with pytest.raises(ValueError, match="overlong_policy='cut'"):
            OmegaConf.to_object(compose("rm_server", overrides=["checkpoint=/x", "overlong_policy=cut"]))


# --------------------------------------------------------------------------- subprocesses
def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def _wait_address(proc: subprocess.Popen, path: Path, log: Path, timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"server exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        if path.is_file() and path.read_text().startswith("http"):
            return path.read_text().strip()
        time.sleep(0.1)
    pytest.fail(f"no address in {timeout_s} s:\n{log.read_text()[-3000:]}")


def test_served_scores_equal_in_process_scores(rm):
    from nemo_rlhf.reward.client import RewardModelClient

    addr, log = rm["tmp"] / "addr_single", rm["tmp"] / "server.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "nemo_rlhf.serve_rm", f"checkpoint={rm['root']}", "server.port=0",
             f"server.address_file={addr}", "micro_batch_size=2", "server.max_wait_ms=20"],
            cwd=REPO, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        url = _wait_address(proc, addr, log, 50)
        assert url.startswith("http://127.0.0.1:")
        with RewardModelClient(url, timeout_s=30) as client:
            assert client.score(_text_items()) == pytest.approx(rm["ref"], abs=1e-5)
            assert client.score(_token_items(rm["tok"])) == pytest.approx(rm["ref"], abs=1e-5)
            meta = client.metadata()["scorer"]
            assert meta["reward_mean"] == 0.25 and meta["checkpoint_step"] == 5
        limit = meta["max_seq_length"]  # the tiny model's max_position_embeddings
        over = {"items": [{"prompt": "x", "response": "a"}, {"prompt": "x", "response": "a" * (limit + 10)}]}
        resp = httpx.post(f"{url}/score", json=over, timeout=30)
        assert resp.status_code == 413, resp.text
        assert resp.json()["field"] == "items[1]" and f"exceed max_seq_length={limit}" in resp.json()["error"]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(20) == 0, log.read_text()[-3000:]
        assert not addr.exists()  # removed on a clean stop
    finally:
        _kill_group(proc)


FAKE_TRAINER = """
import json, sys
from nemo_rlhf.reward.client import RewardModelClient
args = dict(a.split("=", 1) for a in sys.argv[1:])
client = RewardModelClient.from_address_file(args["reward.rm_address_file"], timeout_s=30)
items = json.load(open(args["+items"]))
json.dump({"scores": client.score(items), "exp_dir": args["exp_manager.exp_dir"]}, open(args["+out"], "w"))
sys.exit(int(args["+exit_code"]))
"""


def _processes_mentioning(text: str) -> list:
    import psutil

    found = []
    for p in psutil.process_iter(["cmdline"]):
        try:
            if p.pid != os.getpid() and any(text in part for part in (p.info["cmdline"] or [])):
                found.append(p)
        except psutil.Error:
            pass
    return found


def test_local_launcher_serves_a_pipeline_parallel_rm_and_propagates_the_requeue_code(rm):
    from launchers.local import run_ppo_with_rm
    from nemo_rlhf.train_ppo import REQUEUE_EXIT_CODE

    tmp = rm["tmp"]
    script, items, out, exp = tmp / "fake_trainer.py", tmp / "items.json", tmp / "out.json", tmp / "exp"
    script.write_text(FAKE_TRAINER)
    items.write_text(json.dumps([it.to_json() for it in _text_items()]))
    try:
        code = run_ppo_with_rm(
            [f"+items={items}", f"+out={out}", f"+exit_code={REQUEUE_EXIT_CODE}"], rm_checkpoint=str(rm["root"]), nproc=1, rm_nproc=2,
            rm_overrides=["parallel.pipeline_model_parallel_size=2", "micro_batch_size=2"],
            exp_dir=str(exp), trainer_module=str(script), rm_start_timeout_s=50, stop_grace_s=15)
        assert code == REQUEUE_EXIT_CODE
        result = json.loads(out.read_text())
        assert result["scores"] == pytest.approx(rm["ref"], abs=1e-5)
        assert result["exp_dir"] == str(exp)
        assert not (exp / "rm_address").exists()  # the server stopped cleanly
        assert "rank 1: stop received" in (exp / "rm_server.log").read_text()
        assert _processes_mentioning(str(rm["root"])) == []
    finally:
        for p in _processes_mentioning(str(rm["root"])):
            p.kill()


def test_local_launcher_serves_an_rm_ensemble_and_the_trainer_scores_with_its_rule(rm):
    """--rm-ensemble-checkpoint: a second server, passed as reward.ensemble.rm_address_files;
    the trainer's reward (build_reward) is the rule over both RMs' served scores."""
    from launchers.local import main
    from nemo_rlhf.reward.ensemble import aggregate_ensemble

    tmp = rm["tmp"] / "ensemble"
    tmp.mkdir()
    other, other_ref = _save_rm(tmp, rm["tok"], rm["tok_dir"], rm["dims"], 8,
                                {"reward_mean": -1.0, "reward_std": 3.0, "reward_stats_count": 8},
                                name="rm2")
    script, out, exp = tmp / "fake_trainer.py", tmp / "out.json", tmp / "exp"
    script.write_text(
        "import json, sys\n"
        "from nemo_rlhf.reward.config import RMEnsembleConfig, RewardConfig\n"
        "from nemo_rlhf.trainers.ppo.scoring import build_reward\n"
        "args = dict(a.split('=', 1) for a in sys.argv[1:])\n"
        "files = args['reward.ensemble.rm_address_files'].strip('[]').split(',')\n"
        "cfg = RewardConfig(rm_address_file=args['reward.rm_address_file'], normalization='none',\n"
        "                   ensemble=RMEnsembleConfig(rm_address_files=files, aggregate=args['reward.ensemble.aggregate']))\n"
        f"prompts, responses = zip(*{PROMPTS!r})\n"
        "out = build_reward(cfg).score(list(prompts), list(responses))\n"
        "json.dump({'scores': out.scores.tolist(), 'files': files, 'metrics': out.metrics()}, open(args['+out'], 'w'))\n")
    try:
        code = main(["--rm-checkpoint", str(rm["root"]), "--rm-ensemble-checkpoint", str(other),
                     "--exp-dir", str(exp), "--trainer-module", str(script), "--rm-start-timeout-s", "50",
                     "--", "reward.ensemble.aggregate=min", f"+out={out}"])
        assert code == 0
        result = json.loads(out.read_text())
        expected, spread = aggregate_ensemble(torch.tensor([rm["ref"], other_ref]), torch.tensor([0.25, -1.0]),
                                              torch.tensor([1.5, 3.0]), "min")
        assert result["files"] == [str(exp / "rm_address_1")]
        assert result["scores"] == pytest.approx(expected.tolist(), abs=1e-5)
        assert result["metrics"]["reward/rm_ensemble_std"] == pytest.approx(spread.mean().item(), abs=1e-5)
        assert spread.mean().item() > 0.01  # two different RMs: the test sees a real spread
        assert (exp / "rm_server_1.log").is_file() and not (exp / "rm_address_1").exists()
        assert _processes_mentioning(str(other)) == []
    finally:
        for p in _processes_mentioning(str(rm["root"])) + _processes_mentioning(str(other)):
            p.kill()


def test_local_launcher_fails_fast_when_the_rm_server_dies(tmp_path):
    from launchers.local import LaunchError, run_ppo_with_rm

    not_a_checkpoint = tmp_path / "empty"
    not_a_checkpoint.mkdir()
    with pytest.raises(LaunchError, match=r"(?s)exited with code 1 before it was ready.*neither a complete checkpoint"):
        run_ppo_with_rm([], rm_checkpoint=str(not_a_checkpoint), exp_dir=str(tmp_path / "exp"),
                        trainer_module=str(tmp_path / "never_started.py"), rm_start_timeout_s=50)
    assert _processes_mentioning(str(not_a_checkpoint)) == []
