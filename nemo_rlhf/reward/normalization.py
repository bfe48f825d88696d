"""Reward normalisation and clipping on the PPO side.

Modes:
- ``none``: scores pass through (clipping still applies when set).
- ``fixed``: ``(r - reward_mean) / reward_std`` with the statistics stored with the RM
  checkpoint (served in ``/metadata`` under ``scorer``).
- ``running``: ``(r - mean) / std`` with the running mean and variance of every reward
  seen so far (Welford, merged in parallel form across batches and, through ``gather``,
  across data-parallel ranks). The batch is added to the statistics before it is
  normalised. ``state_dict`` / ``load_state_dict`` carry the statistics across a resume.

Then, in every mode, optional clipping to ``[-clip, clip]``.

Simplified on purpose: no decay / windowing of the running statistics; the variance is
the population variance (``m2 / count``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import torch

from nemo_rlhf.config import check_choice

__all__ = ["NORMALIZATION_MODES", "RewardNormalizationConfig", "RewardNormalizer"]

NORMALIZATION_MODES = ("none", "fixed", "running")


@dataclass
class RewardNormalizationConfig:
    """How one reward source is normalised before weighting (see :class:`RewardNormalizer`)."""

    mode: str = "none"
    """none | fixed (reward_mean/reward_std from the RM checkpoint metadata) | running (statistics over training)."""
    clip: float | None = None
    """Clip normalised rewards to [-clip, clip]; None: no clipping."""

    def __post_init__(self) -> None:
        check_choice("RewardNormalizationConfig.mode", self.mode, NORMALIZATION_MODES)
        clip = self.clip
        if clip is not None and (isinstance(clip, bool) or not isinstance(clip, (int, float)) or not clip > 0):
            raise ValueError(f"RewardNormalizationConfig.clip={self.clip!r} is invalid; valid: None or a number > 0")


class RewardNormalizer:
    """Normalises then clips a batch of rewards.

    Args:
        mode: ``none``, ``fixed`` or ``running``.
        mean, std: the ``fixed`` statistics (``reward_mean``, ``reward_std`` of the RM
            checkpoint); required for ``fixed``, must be None otherwise.
        clip: clip bound (> 0) or None.
        eps: lower bound on the std divided by, for ``running``.

    Raises ``ValueError`` naming the key (mode, mean, std, clip) when arguments are invalid.
    """

    def __init__(
        self,
        mode: str = "none",
        mean: float | None = None,
        std: float | None = None,
        clip: float | None = None,
        eps: float = 1e-6,
    ) -> None:
        RewardNormalizationConfig(mode=mode, clip=clip)  # validates mode and clip
        if mode == "fixed":
            if mean is None or not math.isfinite(mean):
                raise ValueError(f"RewardNormalizer(mode='fixed') needs a finite mean (reward_mean); got {mean!r}")
            if std is None or not math.isfinite(std) or std <= 0:
                raise ValueError(f"RewardNormalizer(mode='fixed') needs std (reward_std) > 0; got {std!r}")
        elif mean is not None or std is not None:
            raise ValueError(f"RewardNormalizer(mode={mode!r}) takes no mean/std (got mean={mean!r}, std={std!r}); "
                             f"they are only for mode='fixed'")
        self.mode = mode
        self.clip = None if clip is None else float(clip)
        self.eps = float(eps)
        self._fixed = (float(mean), float(std)) if mode == "fixed" else None
        self.count = 0
        self._mean = 0.0
        self._m2 = 0.0

    @classmethod
    def from_metadata(
        cls, metadata: Mapping[str, Any], mode: str = "fixed", clip: float | None = None
    ) -> "RewardNormalizer":
        """A normaliser whose ``fixed`` statistics come from RM metadata: the scorer's
        ``metadata()`` dict, or the whole ``/metadata`` reply (its ``scorer`` part is used).
        Only ``mode='fixed'`` reads the statistics. Raises ``KeyError`` naming
        ``reward_mean`` / ``reward_std`` and the keys present when they are missing."""
        if mode != "fixed":
            return cls(mode=mode, clip=clip)
        meta = metadata["scorer"] if isinstance(metadata.get("scorer"), Mapping) else metadata
        missing = [k for k in ("reward_mean", "reward_std") if meta.get(k) is None]
        if missing:
            raise KeyError(
                f"fixed reward normalisation needs {' and '.join(missing)} in the reward model metadata; "
                f"keys present: {sorted(meta)}"
            )
        return cls(mode="fixed", mean=float(meta["reward_mean"]), std=float(meta["reward_std"]), clip=clip)

    @classmethod
    def from_config(
        cls, cfg: RewardNormalizationConfig, metadata: Mapping[str, Any] | None = None
    ) -> "RewardNormalizer":
        """Builds from a config; ``metadata`` (RM metadata) is required for ``fixed``."""
        if cfg.mode == "fixed" and metadata is None:
            raise ValueError("RewardNormalizationConfig.mode='fixed' needs the reward model metadata (reward_mean, reward_std)")
        return cls.from_metadata(metadata or {}, mode=cfg.mode, clip=cfg.clip)

    # ------------------------------------------------------------------ statistics
    @property
    def mean(self) -> float:
        """The mean subtracted: the fixed one, the running one, or 0.0 for ``none``."""
        if self._fixed is not None:
            return self._fixed[0]
        return self._mean if self.mode == "running" else 0.0

    @property
    def std(self) -> float:
        """The std divided by: the fixed one, the running one (>= eps), or 1.0 for ``none``."""
        if self._fixed is not None:
            return self._fixed[1]
        if self.mode == "running":
            return max(math.sqrt(self._m2 / self.count) if self.count else 0.0, self.eps)
        return 1.0

    def merge(self, count: int, mean: float, m2: float) -> None:
        """Adds a group's moments (count, mean, sum of squared deviations) to the running
        statistics (Chan et al. parallel merge)."""
        if count <= 0:
            return
        total = self.count + count
        delta = mean - self._mean
        self._mean += delta * count / total
        self._m2 += m2 + delta * delta * self.count * count / total
        self.count = total

    def update(self, scores: torch.Tensor | Sequence[float],
               gather: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        """Adds ``scores`` ``[batch]`` to the running statistics (``running`` mode only).

        ``gather``: for data parallelism, maps this rank's moments ``[3] float64``
        (count, mean, m2) to every rank's ``[world, 3]`` (an all-gather); they are merged
        in rank order, so every rank ends with the same statistics.
        """
        if self.mode != "running":
            raise RuntimeError(f"RewardNormalizer.update: only mode='running' keeps statistics (mode={self.mode!r})")
        x = _as_tensor(scores).to(torch.float64).flatten()
        n = x.numel()
        mean = x.mean().item() if n else 0.0
        m2 = ((x - mean) ** 2).sum().item() if n else 0.0
        local = torch.tensor([float(n), mean, m2], dtype=torch.float64, device="cpu")  # host
        rows = gather(local).reshape(-1, 3) if gather is not None else local.reshape(1, 3)
        for c, m, s in rows.tolist():
            self.merge(int(round(c)), m, s)

    # ------------------------------------------------------------------ apply
    def __call__(self, scores: torch.Tensor | Sequence[float], update: bool = True,
                 gather: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
        """Normalised and clipped rewards: float32 tensor of the input's shape (``[batch]``).

        In ``running`` mode ``update=True`` first adds the batch to the statistics (see
        :meth:`update`). Raises ``ValueError`` on non-finite scores and ``RuntimeError``
        when ``running`` has no statistics yet and ``update=False``.
        """
        x = _as_tensor(scores)
        if not torch.isfinite(x).all():
            where = (~torch.isfinite(x)).nonzero().flatten().tolist()[:10]
            raise ValueError(f"RewardNormalizer: non-finite reward(s) at positions {where}")
        if self.mode == "running":
            if update:
                self.update(x, gather=gather)
            if self.count == 0:
                raise RuntimeError("RewardNormalizer(mode='running') has no statistics yet; call with update=True first")
        out = x.to(torch.float64)
        if self.mode != "none":
            out = (out - self.mean) / self.std
        if self.clip is not None:
            out = out.clamp(-self.clip, self.clip)
        return out.to(torch.float32)

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """JSON-able state: mode, and count/mean/m2 of the running statistics."""
        return {"mode": self.mode, "count": self.count, "mean": self._mean, "m2": self._m2}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restores :meth:`state_dict` output. Raises ``ValueError`` when the stored mode
        differs from this normaliser's and ``KeyError`` naming a missing key."""
        for key in ("mode", "count", "mean", "m2"):
            if key not in state:
                raise KeyError(f"RewardNormalizer.load_state_dict: missing key {key!r}; keys present: {sorted(state)}")
        if state["mode"] != self.mode:
            raise ValueError(f"RewardNormalizer.load_state_dict: state has mode={state['mode']!r} "
                             f"but this normaliser has mode={self.mode!r}")
        self.count, self._mean, self._m2 = int(state["count"]), float(state["mean"]), float(state["m2"])


def _as_tensor(scores: torch.Tensor | Sequence[float]) -> torch.Tensor:
    if isinstance(scores, torch.Tensor):
        return scores.detach().cpu()
    return torch.as_tensor(list(scores), dtype=torch.float64, device="cpu")  # host
