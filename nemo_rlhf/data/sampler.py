"""The data order of every job: a seeded permutation per epoch, consumed in global batches
that run across epoch boundaries (no example is dropped), resumable from one counter.

A run's position is ``consumed_samples`` (in every checkpoint's trainer state), so a
resumed run continues with exactly the examples the uninterrupted run would have seen.
"""

from __future__ import annotations

import torch


class ResumableSampler:
    """Seeded, resumable order over dataset indices (prompts for PPO, examples or pairs for
    SFT / RM); each DP rank takes its slice of the global batch.

    State: ``consumed_samples`` (global) and ``epoch``; the permutation of an epoch is a
    function of ``(seed, epoch)``, so a resume continues with exactly the next indices.

    Args:
        n: dataset size (>= 1).
        seed: ``trainer.seed``.
        shuffle: False: ``0 .. n-1`` in order every epoch.

    Raises:
        ValueError: an empty dataset.
    """

    def __init__(self, n: int, seed: int, shuffle: bool = True):
        if n < 1:
            raise ValueError("the dataset is empty")
        self.n, self.seed, self.shuffle = n, seed, shuffle
        self.consumed_samples = 0

    def _order(self, epoch: int) -> list[int]:
        if getattr(self, "_cached", (None,))[0] != epoch:
            if self.shuffle:
                g = torch.Generator(device="cpu").manual_seed(self.seed + epoch)  # host
                order = torch.randperm(self.n, generator=g, device="cpu").tolist()
            else:
                order = list(range(self.n))
            self._cached = (epoch, order)
        return self._cached[1]

    def next_global_batch(self, size: int) -> list[int]:
        """The next ``size`` indices (wrapping into the next epoch)."""
        out = []
        while len(out) < size:
            epoch, pos = divmod(self.consumed_samples, self.n)
            out.append(self._order(epoch)[pos])
            self.consumed_samples += 1
        return out

    @property
    def epoch(self) -> int:
        """Epochs started so far (0-based epoch of the next index)."""
        return self.consumed_samples // self.n

    def state_dict(self) -> dict:
        """``{"consumed_samples", "epoch"}`` (JSON-able)."""
        return {"consumed_samples": self.consumed_samples, "epoch": self.epoch}

    def load_state_dict(self, sd: dict) -> None:
        """Continue after ``sd["consumed_samples"]`` indices."""
        self.consumed_samples = int(sd["consumed_samples"])


__all__ = ["ResumableSampler"]
