"""Reward-model ensembles: a conservative reward from several served RMs.

An RM is trained on a narrow distribution of responses; PPO finds the responses where its
score is high for the wrong reason (over-optimisation, Gao et al. 2022). Several RMs
trained on the same pairs with different seeds agree where the data pinned the score down
and disagree where it did not, so a reward that subtracts their disagreement resists the
policy's drift into the region no RM was trained on (Coste et al. 2023, "Reward Model
Ensembles Help Mitigate Overoptimization"; Eisenstein et al. 2023).

Members are put on one scale first. A Bradley-Terry RM's scores are defined up to an
offset (the loss sees only differences) and their spread depends on the training run, so
member ``m``'s raw score ``r_m`` is standardised with its own training-set statistics
(``reward_mean`` / ``reward_std``, stored with the RM checkpoint by
:meth:`nemo_rlhf.trainers.rm.RMTrainer.on_fit_end` and served on ``/metadata``):
``z_m = (r_m - mean_m) / std_m``. Then, per sample, over the ``M`` members:

=================== =====================================================================
``mean``            ``mean_m z_m`` (plain averaging)
``min``             ``min_m z_m`` (worst-case optimisation, Coste et al. sec. 3.2)
``mean_minus_std``  ``mean_m z_m - k * std_m z_m`` with ``std`` the population std over
                    the members (an uncertainty penalty; Coste et al.'s UWO subtracts the
                    variance, here the std keeps the penalty in score units)
=================== =====================================================================

The result is mapped back to the *first* member's units (``agg * std_1 + mean_1``), so a
run's ``reward/rm`` and ``eval/reward`` read like the single RM's and ``reward.normalization
=fixed`` uses the first member's statistics.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any, Sequence

import torch

from nemo_rlhf.config import check_choice
from nemo_rlhf.reward.functions import RM_INPUTS, score_with_client

ENSEMBLE_AGGREGATES = ("mean", "min", "mean_minus_std")

__all__ = ["ENSEMBLE_AGGREGATES", "RewardModelEnsemble", "aggregate_ensemble"]


def aggregate_ensemble(scores: torch.Tensor, means: torch.Tensor, stds: torch.Tensor,
                       aggregate: str = "mean_minus_std", std_coef: float = 1.0
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """The ensemble's reward per sample, in the first member's units.

    Args:
        scores: ``[members, batch]`` raw scores (float; any finite values).
        means / stds: ``[members]`` each member's training-set score mean and std (std > 0).
        aggregate: one of :data:`ENSEMBLE_AGGREGATES` (see the module docstring).
        std_coef: ``k`` of ``mean_minus_std`` (>= 0); unused by the others.

    Returns:
        ``(reward, spread)``: ``[batch]`` float32 each; ``reward`` the aggregate mapped to
        member 0's units, ``spread`` the members' population std of the standardised
        scores times ``stds[0]`` (their disagreement, in member 0's units).

    Raises:
        ValueError: a bad ``aggregate`` (naming the choices), ``std_coef < 0``, a
            non-positive std, or mismatched shapes.
    """
    check_choice("reward.ensemble.aggregate", aggregate, ENSEMBLE_AGGREGATES)
    if not std_coef >= 0:
        raise ValueError(f"reward.ensemble.std_coef={std_coef}: must be >= 0")
    if scores.dim() != 2 or means.shape != (scores.shape[0],) or stds.shape != (scores.shape[0],):
        raise ValueError(f"aggregate_ensemble: scores {tuple(scores.shape)} must be [members, batch] "
                         f"with means {tuple(means.shape)} and stds {tuple(stds.shape)} of [members]")
    if not bool((stds > 0).all()):
        raise ValueError(f"aggregate_ensemble: every member's reward_std must be > 0, got {stds.tolist()}")
    s, mu, sd = scores.double(), means.double()[:, None], stds.double()[:, None]
    z = (s - mu) / sd
    spread = z.std(dim=0, unbiased=False)
    if aggregate == "mean":
        agg = z.mean(0)
    elif aggregate == "min":
        agg = z.min(0).values
    else:
        agg = z.mean(0) - std_coef * spread
    return (agg * sd[0] + mu[0]).float(), (spread * sd[0]).float()


class RewardModelEnsemble:
    """Several served RMs as one :class:`~nemo_rlhf.reward.functions.RewardSource`.

    Args:
        clients: ``M >= 2`` :class:`~nemo_rlhf.reward.client.RewardModelClient` s, the first
            one the primary RM (``reward.rm_url`` / ``rm_address_file``).
        stats: ``M`` dicts with the members' ``reward_mean`` and ``reward_std`` (their
            ``/metadata`` ``scorer`` part).
        names: ``M`` labels for errors (URLs or address files).
        aggregate / std_coef: see :func:`aggregate_ensemble`.
        rm_input / send_ids: what each member reads of a multi-turn episode
            (:class:`~nemo_rlhf.reward.functions.RemoteRewardModel`); ``send_ids`` one
            flag per member (each RM's own tokenizer decides), None: False for every one.

    The members are asked concurrently (one thread each: separate servers score in
    parallel); any member's ``RewardServiceError`` propagates, nothing is filled in.
    :meth:`score` also leaves :attr:`last_spread` (``[batch]``, member 0's units), which
    :meth:`~nemo_rlhf.reward.functions.CombinedReward.fetch` reports as
    ``reward/rm_ensemble_std``: the mean of the per-sample spread over the valid samples of
    every DP rank (sums and counts reduced over the scoring ranks, as the other ``reward/*``
    means; not a std pooled over samples).

    Raises:
        ValueError: fewer than 2 members, or a member without ``reward_mean`` /
            ``reward_std > 0`` (naming it: an RM checkpoint written by
            ``nemo_rlhf.train_rm`` has them).
    """

    def __init__(self, clients: Sequence[Any], stats: Sequence[dict], names: Sequence[str],
                 aggregate: str = "mean_minus_std", std_coef: float = 1.0, rm_input: str = "final_answer",
                 send_ids: Sequence[bool] | None = None) -> None:
        check_choice("reward.rm_input", rm_input, RM_INPUTS)
        if len(clients) < 2 or not len(clients) == len(stats) == len(names):
            raise ValueError(f"RewardModelEnsemble: needs >= 2 members with one stats dict and name each "
                             f"(got {len(clients)} clients, {len(stats)} stats, {len(names)} names)")
        means, stds = [], []
        for name, st in zip(names, stats):
            mean, std = st.get("reward_mean"), st.get("reward_std")
            if mean is None or std is None or not float(std) > 0:
                raise ValueError(
                    f"reward.ensemble: the RM at {name} serves no reward_mean / reward_std > 0 on "
                    f"/metadata (got {mean!r} / {std!r}); the members are standardised with them -- "
                    f"serve RM checkpoints written by nemo_rlhf.train_rm")
            means.append(float(mean))
            stds.append(float(std))
        aggregate_ensemble(torch.zeros(len(clients), 1), torch.tensor(means), torch.tensor(stds),  # host
                           aggregate, std_coef)  # validates aggregate and std_coef now
        self.clients = list(clients)
        self.rm_input = rm_input
        self.send_ids = [False] * len(self.clients) if send_ids is None else [bool(x) for x in send_ids]
        if len(self.send_ids) != len(self.clients):
            raise ValueError(f"RewardModelEnsemble: {len(self.send_ids)} send_ids flags for {len(self.clients)} members")
        self.names = list(names)
        self.means = torch.tensor(means, dtype=torch.float64)  # host: scores arrive as JSON floats
        self.stds = torch.tensor(stds, dtype=torch.float64)  # host
        self.aggregate = aggregate
        self.std_coef = std_coef
        self.last_spread: torch.Tensor | None = None
        self._pool = ThreadPoolExecutor(max_workers=len(self.clients), thread_name_prefix="rm-ensemble")

    @property
    def allow_nonfinite(self) -> bool:
        return all(getattr(c, "allow_nonfinite", False) for c in self.clients)

    @allow_nonfinite.setter
    def allow_nonfinite(self, value: bool) -> None:
        for c in self.clients:
            c.allow_nonfinite = value

    def score(self, prompts: list[str], responses: list[str], extras: list[dict]) -> list[float]:
        """``[batch]`` ensemble rewards (member 0's units) for the (prompt, response) texts,
        or the episodes' conversations (each member's request as
        :func:`~nemo_rlhf.reward.functions.score_with_client` builds it). A non-finite
        member score gives a non-finite reward (judged by the caller)."""
        futures = [self._pool.submit(score_with_client, c, prompts, responses, extras, self.rm_input, ids)
                   for c, ids in zip(self.clients, self.send_ids)]
        per_member = [f.result() for f in futures]  # the first failure propagates
        scores = torch.tensor(per_member, dtype=torch.float64)  # host, [members, batch]
        reward, spread = aggregate_ensemble(scores, self.means, self.stds, self.aggregate, self.std_coef)
        self.last_spread = spread
        return reward.tolist()

    def diagnostics(self) -> dict[str, torch.Tensor]:
        """``{"ensemble_std": [batch]}`` of the last :meth:`score` (empty before one)."""
        return {} if self.last_spread is None else {"ensemble_std": self.last_spread}
