"""The PPO main job with measurement hooks: the trainer that ``benchmarks/gpu_check.py`` runs.

    python benchmarks/gpu_check_trainer.py [--config-name ppo_tiny] [nemo_rlhf.train_ppo overrides]

This is ``python -m nemo_rlhf.train_ppo`` itself (its Hydra ``hydra_main``, ``build`` and ``fit``,
so the launcher, the served RM, checkpoints and ``metrics.jsonl`` are the real ones), with
one difference: the trainer that ``build`` returns gets thin wrappers around its phases
(:class:`PhaseProbe`), which change nothing in what the phases compute and record, for
every PPO step, one JSON line in ``<exp_dir>/gpu_check_probe.jsonl`` (reporting rank only):

* ``shapes``: rollouts ``batch`` (this replica's), ``prompt_len`` ``P`` (left-padded),
  ``response_len`` ``R`` (decoding steps run), ``generated_tokens`` (real response tokens),
  ``seq_len`` ``P + R`` of the forward/backward passes, ``ppo_epochs``;
* ``flops``: :func:`nemo_rlhf.metrics.flops.ppo_step_flops` of those shapes (model FLOPs
  per phase of this replica's step);
* ``phases``: per phase, wall seconds and, on CUDA, the peak allocated and reserved memory
  (GiB, ``torch.cuda.max_memory_allocated`` / ``max_memory_reserved`` since the phase
  began): ``rollout``, ``old_logprobs_values``, ``reference_swap_in`` (actor weights out to
  the host stash and reference weights in), ``reference_forward``, ``reference_swap_out``
  (actor weights back), ``train`` (``ppo_epochs`` of forward + backward + optimizer steps);
* ``reference_host_bytes``: the offloaded reference's host buffers (reference + stash),
  ``metrics_memory``: any ``memory/*`` keys of the step's own metrics.

Every phase boundary synchronises the device (``torch.cuda.synchronize``) so that a
phase's seconds hold its own GPU work; that adds a few synchronisations per step to the
trainer's own, and the peak-memory counters are reset at each boundary (a ``memory/*``
metric that the trainer computes over a span crossing such a boundary would see the reset).
Phases called outside a PPO step (held-out evaluation) are not recorded.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import sys
import time
from pathlib import Path

import torch

PROBE_FILE = "gpu_check_probe.jsonl"
"""File name, in the experiment folder, of the per-step records."""

GIB = 2.0 ** 30


class PhaseProbe:
    """Wraps a built ``PPOTrainer``'s phase methods (instance attributes) to time them.

    Args:
        trainer: the trainer from :func:`nemo_rlhf.train_ppo.build`.
        cfg: its :class:`~nemo_rlhf.trainers.ppo.config.PPOConfig` (``model.vocab_size``
            already filled from the tokenizer).
        path: the JSON-lines file to append the per-step records to (None: keep them in
            :attr:`records` only).
    """

    def __init__(self, trainer, cfg, path: Path | None):
        self.trainer, self.cfg, self.path = trainer, cfg, path
        self.device = trainer.dims.device
        self.cuda = self.device.type == "cuda"
        self.record: dict | None = None
        self.records: list[dict] = []
        self.unwrapped: list[str] = []
        self.in_reference = False

    # --- measuring ---------------------------------------------------------------------
    def _sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    @contextlib.contextmanager
    def measure(self, name: str):
        """Time the block (device synchronised at both ends) and take its memory peaks."""
        if self.record is None:  # outside a PPO step
            yield
            return
        self._sync()
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self._sync()
            entry = self.record["phases"].setdefault(name, {"s": 0.0})
            entry["s"] += time.perf_counter() - t0
            if self.cuda:
                for key, fn in (("peak_allocated_gib", torch.cuda.max_memory_allocated),
                                ("peak_reserved_gib", torch.cuda.max_memory_reserved)):
                    entry[key] = max(entry.get(key, 0.0), fn(self.device) / GIB)

    # --- wrappers ----------------------------------------------------------------------
    def install(self) -> "PhaseProbe":
        t = self.trainer
        step = t.train_step
        actor = getattr(t, "actor", None)
        rollout, update = getattr(t, "rollout", None), getattr(t, "update", None)
        forward = getattr(actor, "logprobs", None)

        def train_step():
            self.record = {"phases": {}, "shapes": {}}
            try:
                metrics = step()
            finally:
                record, self.record = self.record, None
            self._finish(record, metrics)
            return metrics

        def _rollout(idx):  # (the step's samples from its rollout source)
            with self.measure("rollout"):
                batch = rollout(idx)
            if self.record is not None:
                self.record["shapes"].update(
                    batch=int(batch.input_ids.shape[0]), prompt_len=int(batch.prompt_length),
                    response_len=int(batch.response_ids.shape[1]),
                    generated_tokens=int(batch.response_mask.sum()))
            return batch

        def _logprobs(batch, *args, **kwargs):
            # inside reference.swapped_in(): the reference forward; otherwise the actor's
            with self.measure("reference_forward" if self.in_reference else "old_logprobs_values"):
                return forward(batch, *args, **kwargs)

        def _update(batch, fwd, adv):
            if self.record is not None:
                self.record["shapes"].update(seq_len=int(batch.input_ids.shape[1]),
                                             ppo_epochs=self.cfg.ppo.ppo_epochs)
            with self.measure("train"):
                return update(batch, fwd, adv)

        t.train_step = train_step
        # a phase method the trainer no longer has is left out (and named in each record)
        # rather than failing the run
        self.unwrapped = [name for owner, name, fn in ((t, "rollout", _rollout),
                                                       (actor, "actor.logprobs", _logprobs),
                                                       (t, "update", _update))
                          if not self._replace(owner, name, fn)]
        if callable(getattr(getattr(t, "reference", None), "swapped_in", None)):
            self._wrap_reference(t.reference)
        else:
            self.unwrapped.append("reference.swapped_in")
        return self

    @staticmethod
    def _replace(owner, name: str, fn) -> bool:
        attr = name.rsplit(".", 1)[-1]
        if owner is None or not callable(getattr(owner, attr, None)):
            return False
        setattr(owner, attr, fn)
        return True

    def _wrap_reference(self, reference) -> None:
        original = reference.swapped_in

        @contextlib.contextmanager
        def swapped_in():
            cm = original()
            with self.measure("reference_swap_in"):
                model = cm.__enter__()
            done = False
            self.in_reference = True
            try:
                yield model
                done = True
            finally:
                self.in_reference = False
                if done:
                    with self.measure("reference_swap_out"):
                        cm.__exit__(None, None, None)
                else:  # restores the actor's weights; the error propagates
                    cm.__exit__(*sys.exc_info())

        reference.swapped_in = swapped_in

    # --- the record ----------------------------------------------------------------------
    def _finish(self, record: dict, metrics: dict) -> None:
        from nemo_rlhf.metrics.flops import ppo_step_flops

        shapes = record["shapes"]
        record["step"] = self.trainer.step + 1  # train_step runs before the loop's increment
        if {"batch", "prompt_len", "response_len", "ppo_epochs"} <= shapes.keys():
            record["flops"] = ppo_step_flops(
                self.cfg.model, batch=shapes["batch"], prompt_len=shapes["prompt_len"],
                response_len=shapes["response_len"],
                ppo_epochs=shapes["ppo_epochs"]).to_dict()
        reference = getattr(self.trainer, "reference", None)
        record["reference_mode"] = getattr(reference, "mode", None)
        record["reference_host_bytes"] = (reference.host_bytes()
                                          if hasattr(reference, "host_bytes") else None)
        record["probe_unwrapped"] = self.unwrapped
        record["metrics_memory"] = {k: v for k, v in (metrics or {}).items()
                                    if k.startswith("memory/")}
        self.records.append(record)
        if self.path is not None and self.trainer.dims.rank == 0:
            with open(self.path, "a") as f:
                f.write(json.dumps(record) + "\n")


def environment() -> dict:
    """What the run ran on: device name, torch / CUDA versions, layer spec."""
    info = {"torch": torch.__version__, "cuda": torch.version.cuda,
            "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"}
    info["layer_spec"] = "local"  # on every device (nemo_rlhf.models.actor_critic._layer_spec)
    return info


def main() -> None:
    import nemo_rlhf.train_ppo as train_ppo

    build = train_ppo.build

    def build_with_probe(cfg, signals=None):
        trainer = build(cfg, signals)
        path = Path(cfg.exp_manager.exp_dir) / PROBE_FILE
        if trainer.dims.rank == 0:
            with open(path, "a") as f:
                f.write(json.dumps({"environment": environment(),
                                    "model": dataclasses.asdict(cfg.model),
                                    "precision": cfg.trainer.precision}) + "\n")
        PhaseProbe(trainer, cfg, path).install()
        return trainer

    train_ppo.build = build_with_probe  # hydra_main() looks build up at call time
    # train_ppo.hydra_main's own body under a Hydra decorator with an absolute config folder (its
    # relative "../conf" is resolved against the module that calls it: this script)
    import hydra

    conf = Path(train_ppo.__file__).resolve().parents[1] / "conf"
    hydra.main(version_base=None, config_path=str(conf), config_name="ppo")(
        train_ppo.hydra_main.__wrapped__)()


if __name__ == "__main__":
    main()
