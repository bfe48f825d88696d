"""Per-phase wall-clock timers (and per-phase peak accelerator memory on CUDA), one kind
for every job: ``timing/<phase>_s`` (seconds summed over the phase's calls since the last
:meth:`Timers.pop`) and ``memory/<phase>_peak_{allocated,reserved}_gib``."""

from __future__ import annotations

import time
from contextlib import contextmanager

import torch


class Timers:
    """Wall-clock seconds per named phase of the current step, and on CUDA the phase's
    peak accelerator memory (GiB, ``memory/<phase>_peak_allocated_gib`` and
    ``memory/<phase>_peak_reserved_gib``; the peak counters are reset at the phase's
    start, so each figure is that phase's own high-water mark)."""

    def __init__(self):
        self.times: dict[str, float] = {}
        self.memory: dict[str, float] = {}

    @contextmanager
    def __call__(self, name: str):
        cuda = torch.cuda.is_available()
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.times[name] = self.times.get(name, 0.0) + time.perf_counter() - t0
            if cuda:
                gib = 2.0 ** 30
                for kind, value in (("allocated", torch.cuda.max_memory_allocated()),
                                    ("reserved", torch.cuda.max_memory_reserved())):
                    key = f"memory/{name}_peak_{kind}_gib"
                    self.memory[key] = max(self.memory.get(key, 0.0), value / gib)

    def pop(self) -> dict[str, float]:
        out = {**{f"timing/{k}_s": v for k, v in self.times.items()}, **self.memory}
        self.times, self.memory = {}, {}
        return out


__all__ = ["Timers"]
