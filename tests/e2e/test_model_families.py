"""PPO from an imported Hugging Face model, and its kill-and-resume, per architecture.

For each of Llama with Llama 3.1's ``llama3`` RoPE scaling, Mistral, Qwen3 (dense) and
Qwen3-MoE (4 experts, top-2; TP=1, as MoE training must be) (:data:`ARCHS`), the module
fixture (:func:`runs`) runs, as separate processes (forked by :mod:`tests.fork_server`):

1. ``nemo-rlhf-ckpt import-hf`` of a tiny random model written by transformers' own classes
   (:mod:`tests.hf_tiny`: 2 layers, its family's tokenizer special tokens and chat template);
2. a 2-step PPO run from the import (``conf/ppo.yaml``, ``exp_manager.init_from=<import>``,
   the shared critic, a checkpoint every step), uninterrupted;
3. the same run killed with SIGKILL in step 2 (``NEMO_RLHF_CRASH_AT``: a different point per
   architecture, :data:`CRASH`), then the same command again: it resumes from step 1.

The reward is the e2e tests' reward function (``tests.ppo_helpers:length_reward``), not a
served RM: what differs between families is the model, and the walkthrough
(``tests/e2e/test_walkthrough.py``) already trains and serves an RM from an import. The
resumed run's final weights and optimizer state must be bit-identical to the uninterrupted
run's (CPU, fp32), its per-step metrics equal, and every step's prompts the same.

Cost: the 16 processes run two at a time, each single-threaded, in the order their
dependencies allow (:func:`_run_jobs`): the suite runs serially on 2 cores, so the second one
is otherwise idle. Each is forked from a server that has imported torch, megatron and the
entry points once (:mod:`tests.fork_server`; its own session, environment and log, as a
fresh ``python -m`` process would have), not a fresh interpreter that imports them again
(about 4-5 s of CPU each).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from tests.fork_server import ForkServer
from tests.hf_tiny import write_data, write_hf_folder

pytest.importorskip("transformers")

REPO = Path(__file__).resolve().parents[2]
ARCHS = ("llama31", "mistral", "qwen3", "qwen3_moe")
CRASH = {"llama31": "rollout:2", "mistral": "update:2", "qwen3": "save_written:2", "qwen3_moe": "update:2"}
"""Where each architecture's run is killed: before step 2's rollout, in its update (Mistral
and the mixture of experts), after its checkpoint's shards are written (before
publication). Each resumes from step 1."""
STEPS = 2
LR = 1e-3
EPOCHS = 2  # optimizer steps per PPO step: 4 samples, one minibatch of 4, 2 epochs
VOLATILE = ("timing/", "_per_s")
PPO_TINY = ["reward.functions=[{name: 'tests.ppo_helpers:length_reward'}]", "reward.normalization=none",
            "critic.mode=shared", "trainer.precision=32", f"trainer.max_steps={STEPS}",
            "ppo.num_rollout_samples=4", "ppo.global_batch_size=4", "ppo.micro_batch_size=2",
            f"ppo.ppo_epochs={EPOCHS}", "ppo.forward_micro_batch_size=4", "rollout.max_new_tokens=6",
            "data.max_seq_length=48", "optim.warmup_steps=0", f"optim.lr={LR}",
            "trainer.sample_table_every=0", "trainer.val_check_interval=0", "exp_manager.save_interval=1",
            "exp_manager.keep_last=5"]
PARALLEL = 2
TIMEOUT_S = 300.0


def _env(crash: str | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("NEMO_RLHF_")}
    env["OMP_NUM_THREADS"] = "1"
    if crash:
        env["NEMO_RLHF_CRASH_AT"] = crash
    return env


def _run_jobs(jobs: dict[str, dict], outdir: Path) -> dict[str, tuple[int | None, str]]:
    """Runs ``jobs`` (name -> ``cmd``, ``log``, optional ``crash``, ``after``: (name, exit code)
    of a job that must have exited so first, and ``on_exit``: called with the exit code before
    any dependent starts), :data:`PARALLEL` at a time, each forked by a
    :class:`~tests.fork_server.ForkServer` as its ``python -m`` command in its own session
    (killed once it exits: a SIGKILLed trainer may leave forked checkpoint writers), in the
    dict's order as dependencies allow. Returns name -> (exit code, output); a job whose
    dependency did not exit as required gets (None, the reason), one past :data:`TIMEOUT_S`
    is killed (None)."""
    done: dict[str, tuple[int | None, str]] = {}
    running: dict[str, tuple[int, float]] = {}
    exited: dict[int, int] = {}
    pending = list(jobs)

    def finish(name: str, code: int | None, note: str = "") -> None:
        pid, _ = running.pop(name)
        try:
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        done[name] = (code, note + Path(jobs[name]["log"]).read_text())
        if "on_exit" in jobs[name]:
            jobs[name]["on_exit"](code)

    with ForkServer(_env(None), outdir) as server:
        try:
            while pending or running:
                for name in list(pending):
                    after, code = jobs[name].get("after", (None, 0))
                    if after in done and done[after][0] != code:
                        pending.remove(name)
                        done[name] = (None, f"not run: {after} exited {done[after][0]}, not {code}")
                    elif len(running) < PARALLEL and (after is None or after in done):
                        pending.remove(name)
                        python, dash_m, module, *argv = jobs[name]["cmd"]
                        assert (python, dash_m) == (sys.executable, "-m"), jobs[name]["cmd"]
                        running[name] = (server.start(module, argv, _env(jobs[name].get("crash")),
                                                      Path(jobs[name]["log"]), cwd=REPO), time.monotonic())
                exited.update(server.poll())
                for name, (pid, start) in list(running.items()):
                    if pid in exited:
                        finish(name, exited.pop(pid))
                    elif time.monotonic() - start > TIMEOUT_S:
                        finish(name, None, f"killed after {TIMEOUT_S:.0f} s\n")
                time.sleep(0.05)
        finally:
            for name in list(running):
                finish(name, None, "killed: the fixture stopped\n")
    return done


def _ppo(ckpt: Path, data: Path, exp: Path) -> list[str]:
    return [sys.executable, "-m", "nemo_rlhf.train_ppo", f"exp_manager.init_from={ckpt}",
            f"exp_manager.exp_dir={exp}", f"data.train_file={data}/prompts.jsonl",
            f"data.val_file={data}/prompts_val.jsonl", *PPO_TINY]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every architecture's import, uninterrupted run, killed run and resumed run; returns,
    per architecture, its folders, each job's (exit code, output) and the checkpoints the
    killed run left."""
    tmp = tmp_path_factory.mktemp("families")
    data = tmp / "data"
    write_data(data)
    got: dict[str, dict] = {}
    for arch in ARCHS:
        folder = tmp / arch
        write_hf_folder(folder / "hf", arch)
        got[arch] = {"arch": arch, "hf": folder / "hf", "ckpt": folder / "ckpt", "logs": folder,
                     "baseline": folder / "ppo", "resumed": folder / "ppo_killed", "jobs": {}}

    def after_kill(arch: str):
        def look(code: int | None) -> None:
            ckpts = got[arch]["resumed"] / "checkpoints"
            got[arch]["after_kill"] = (sorted(p.name for p in ckpts.iterdir() if not p.name.startswith(".")),
                                       (ckpts / "latest").read_text().strip()) if ckpts.is_dir() else None
        return look

    jobs: dict[str, dict] = {}
    order = (("import", None), ("killed", "import"), ("resumed", "killed"), ("baseline", "import"))
    for kind, after in order:  # the critical path first, the baselines last
        for arch in ARCHS:
            g = got[arch]
            job = {"log": g["logs"] / f"{kind}.log"}
            if kind == "import":
                job["cmd"] = [sys.executable, "-m", "nemo_rlhf.tools.ckpt", "import-hf", str(g["hf"]),
                              "--out", str(g["ckpt"])]
            else:
                job["cmd"] = _ppo(g["ckpt"], data, g["baseline" if kind == "baseline" else "resumed"])
                job["after"] = (f"{arch}/{after}", -signal.SIGKILL if after == "killed" else 0)
            if kind == "killed":
                job["crash"], job["on_exit"] = CRASH[arch], after_kill(arch)
            jobs[f"{arch}/{kind}"] = job
    for name, result in _run_jobs(jobs, tmp).items():
        arch, kind = name.split("/")
        got[arch]["jobs"][kind] = result
    return got


@pytest.fixture(params=ARCHS)
def family(request, runs):
    """One architecture's results from :func:`runs`."""
    return runs[request.param]


def _ok(family: dict, kind: str) -> str:
    code, text = family["jobs"][kind]
    assert code == 0, f"{family['arch']} {kind} exited {code}:\n{text[-4000:]}"
    return text


def _metrics(exp: Path) -> dict[int, dict]:
    out = {}
    for line in (exp / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        out.setdefault(row["step"], {}).update({k: v for k, v in row.items() if not any(s in k for s in VOLATILE)})
    return out


def _prompt_ids(exp: Path) -> dict[int, list[int]]:
    out = {}
    for line in (exp / "prompt_log.jsonl").read_text().splitlines():
        row = json.loads(line)
        out[row["step"]] = row["prompt_ids"]  # a killed attempt's line is superseded
    return out


def _model(step: Path) -> dict:
    return yaml.safe_load((step / "config.yaml").read_text())["model"]


def test_the_import_carries_the_architecture(family):
    _ok(family, "import")
    model = _model(family["ckpt"] / "step_0")
    hf = json.loads((family["hf"] / "config.json").read_text())
    assert model["num_layers"] == 2 and model["num_query_groups"] == 2 and model["vocab_size"] == hf["vocab_size"]
    assert model["share_embeddings_and_output_weights"] == hf["tie_word_embeddings"]
    arch = family["arch"]
    if arch == "llama31":
        assert model["rope_scaling"] == "llama3" and model["rope_original_max_position_embeddings"] == 32
        assert model["rope_scaling_factor"] == 8.0 and model["rotary_base"] == 500000
    elif arch == "mistral":
        assert model["rope_scaling"] is None and model["rotary_base"] == 1000000
        assert not model["add_bias_linear"] and not model["add_qkv_bias"]
    else:
        assert model["qk_layernorm"] and model["kv_channels"] == 24 and not model["add_qkv_bias"]
    moe = (4, 2, 48, False) if arch == "qwen3_moe" else (None,)
    assert (model["num_moe_experts"], *([model["moe_router_topk"], model["moe_ffn_hidden_size"],
                                        model["moe_router_pre_softmax"]] if moe[0] else [])) == moe


def test_ppo_trains_from_the_imported_weights(family):
    from nemo_rlhf.checkpoint.io import load_full_tensors

    _ok(family, "baseline")
    base, imported = family["baseline"] / "checkpoints", family["ckpt"] / "step_0"
    assert (base / f"step_{STEPS}" / "COMPLETE").is_file()
    assert _model(base / f"step_{STEPS}") == _model(imported)  # the model taken from the import
    start, step1 = load_full_tensors(imported), load_full_tensors(base / "step_1")
    weights = [k for k in start if isinstance(start[k], torch.Tensor)]
    assert weights and set(weights) <= set(step1)
    for k in weights:  # Adam moves each element by at most lr per optimizer step: from the import
        moved = (step1[k] - start[k]).abs().max().item()
        assert 0 < moved <= EPOCHS * LR * 1.01, f"{family['arch']}: {k} moved {moved} in step 1"
    metrics = _metrics(family["baseline"])
    assert sorted(metrics) == [1, 2]
    for row in metrics.values():  # the reward function scored, the shared critic trained
        assert row["reward/length_reward"] > 0 and row["value_loss"] > 0 and row["grad_norm"] > 0
        assert row["rollout_train_logprob_diff_max"] < 1e-5  # the rollout's model is the trained one
        routed = {k for k in row if k.startswith("moe/")}  # the router's load, of a MoE actor only
        assert routed == ({"moe/tokens_per_expert_max_over_mean", "moe/tokens_per_expert_min_over_mean"}
                          if family["arch"] == "qwen3_moe" else set())
        if routed:
            assert row["moe/tokens_per_expert_max_over_mean"] >= 1 >= row["moe/tokens_per_expert_min_over_mean"]


def test_killed_in_step_2_and_resumed_is_bit_identical_to_the_uninterrupted_run(family):
    from nemo_rlhf.checkpoint.io import load_full_tensors

    arch, exp, base = family["arch"], family["resumed"], family["baseline"]
    code, text = family["jobs"]["killed"]
    assert code == -signal.SIGKILL, f"{arch}: the killed run exited {code}:\n{text[-3000:]}"
    assert family["after_kill"] == (["latest", "step_1"], "step_1")  # step 2 never published
    assert f"resumed from {exp / 'checkpoints' / 'step_1'}" in _ok(family, "resumed")
    _ok(family, "baseline")
    a = load_full_tensors(exp / "checkpoints" / f"step_{STEPS}")
    b = load_full_tensors(base / "checkpoints" / f"step_{STEPS}")
    assert a.keys() == b.keys() and any(k.startswith("optimizer.") for k in a)
    assert any("value_head" in k for k in a)  # the shared critic's head is in the checkpoint
    step1 = load_full_tensors(base / "checkpoints" / "step_1")
    moved = [k for k in a if isinstance(a[k], torch.Tensor) and not k.startswith("optimizer.")
             and not torch.equal(a[k], step1[k])]
    assert any("value_head" in k for k in moved) and len(moved) > 2  # step 2 (redone) trained both
    for k in a:
        if isinstance(a[k], torch.Tensor):
            assert torch.equal(a[k], b[k]), f"{arch}: {k} differs from the uninterrupted run"
        else:
            assert a[k] == b[k], f"{arch}: {k} differs from the uninterrupted run"
    assert _metrics(exp) == _metrics(base)
    ids = _prompt_ids(exp)
    assert ids == _prompt_ids(base) and sorted(ids) == [1, 2]
