"""Observation normalisation in a federation, an explicit choice (``--obs-norm``).

- ``none``: raw observations.
- ``pooled`` (default): every agent shares (count, sum, sum of squares) of its observations
  once, before training; everyone normalises with the pooled mean/std. The averaged policy then
  sees one consistent input scale. It reveals each agent's first two moments, which is a small
  leak (no rows, no actions, no rewards); with secure aggregation only the pooled sums would be
  seen. This is what an evaluator needs anyway: the global policy carries these statistics.
- ``local``: each agent normalises with its own statistics and shares nothing. The averaged
  policy is then trained on inconsistent inputs; the global policy's normaliser buffers are the
  (FedAvg) average of the agents' statistics.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

NORM_CHOICES = ("pooled", "local", "none")
STD_FLOOR = 1e-3


@dataclass(frozen=True)
class ObsStats:
    """Sufficient statistics of observations: count, sum and sum of squares (float64)."""

    count: int
    total: np.ndarray
    total_sq: np.ndarray

    @staticmethod
    def of(obs: np.ndarray) -> "ObsStats":
        x = obs.astype(np.float64)
        return ObsStats(len(x), x.sum(0), (x * x).sum(0))

    @staticmethod
    def pool(stats: list["ObsStats"]) -> "ObsStats":
        return ObsStats(sum(s.count for s in stats), sum(s.total for s in stats),
                        sum(s.total_sq for s in stats))

    def mean_std(self) -> tuple[np.ndarray, np.ndarray]:
        mean = self.total / max(self.count, 1)
        var = np.maximum(self.total_sq / max(self.count, 1) - mean * mean, 0.0)
        return mean.astype(np.float32), np.maximum(np.sqrt(var), STD_FLOOR).astype(np.float32)


def agent_normalizers(mode: str, agent_obs: list[np.ndarray]) -> list[tuple[np.ndarray, np.ndarray]]:
    """The (mean, std) each agent applies under ``mode``."""
    if mode not in NORM_CHOICES:
        raise ValueError(f"obs normalisation must be one of {', '.join(NORM_CHOICES)}, got {mode!r}")
    dim = agent_obs[0].shape[1]
    if mode == "none":
        ident = (np.zeros(dim, np.float32), np.ones(dim, np.float32))
        return [ident for _ in agent_obs]
    stats = [ObsStats.of(o) for o in agent_obs]
    if mode == "local":
        return [s.mean_std() for s in stats]
    pooled = ObsStats.pool(stats).mean_std()
    return [pooled for _ in agent_obs]
