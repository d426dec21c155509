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


# How far (in the agents' median std, per dimension) an agent's mean may lie from the agents'
# median mean, and by what factor its std may differ from their median std, before its moments
# are left out of the pool. Agents with data of one task differ by a few stds at most; a poisoner
# declaring mean 10^6 and std 0 is at millions. Honest pools are the exact pooled moments.
OUTLIER_FACTOR = 100.0


def consistent(stats: list[ObsStats]) -> list[bool]:
    """Which agents' moments enter the pool: with three or more agents, those that do not sit
    :data:`OUTLIER_FACTOR` median stds or more from the others' median (one agent's moments
    cannot then make every other agent's data degenerate: a mean of 10^6 and a std of 0 used to
    leave the honest agents' normalised data at -2,700 with a spread of 10^-3); with one or two
    agents there is no majority to judge by, and all enter."""
    if len(stats) < 3:
        return [True] * len(stats)
    per = [s.mean_std() for s in stats]
    means = np.array([m for m, _ in per], dtype=np.float64)
    stds = np.array([sd for _, sd in per], dtype=np.float64)
    med_mean, med_std = np.median(means, axis=0), np.median(stds, axis=0)
    far = (np.abs(means - med_mean) > OUTLIER_FACTOR * med_std).any(axis=1)
    odd = ((stds > OUTLIER_FACTOR * med_std) | (stds * OUTLIER_FACTOR < med_std)).any(axis=1)
    ok = ~(far | odd)
    return ok.tolist() if ok.sum() * 2 > len(stats) else [True] * len(stats)  # no majority: judge nothing


# One agent's weight in the pool is at most COUNT_CAP times the agents' median count (a count is
# the agent's own word), and its mean enters clipped to MEAN_CLIP median stds of the agents'
# median mean (its std to [1/MEAN_CLIP, MEAN_CLIP] median stds). Honest agents of one task sit well
# inside both, and their pool is then the exact pooled moments, bit for bit.
COUNT_CAP, MEAN_CLIP = 2.0, 10.0


def bounded_pool(stats: list[ObsStats]) -> ObsStats:
    """The pooled moments of ``stats``, one agent's influence bounded (with three or more agents).

    Each agent weighs min(count, COUNT_CAP x median count), and its mean and std enter clipped to
    the agents' median mean +- MEAN_CLIP median stds and to [median std / MEAN_CLIP, MEAN_CLIP x
    median std], per dimension. So one agent moves the pooled mean, in each dimension, by at most
    its capped share of the pool times (MEAN_CLIP median stds + the other agents' own distance from
    the median mean): with n - 1 honest agents of equal counts whose means agree, by at most
    2 MEAN_CLIP / (n + 1) median stds (5.0 among 3 agents, 3.3 among 5, 2.0 among 9), where plain
    pooling let one agent under the outlier rule, declaring a large count, move it ~100. When no
    agent needs capping or clipping, this is :meth:`ObsStats.pool` exactly."""
    if len(stats) < 3:
        return ObsStats.pool(stats)
    counts = np.array([s.count for s in stats], dtype=np.float64)
    means = np.array([s.total / max(s.count, 1) for s in stats], dtype=np.float64)
    sq = np.array([s.total_sq / max(s.count, 1) for s in stats], dtype=np.float64)
    stds = np.sqrt(np.maximum(sq - means * means, 0.0))
    med_mean, med_std = np.median(means, axis=0), np.maximum(np.median(stds, axis=0), STD_FLOOR)
    weights = np.minimum(counts, COUNT_CAP * np.median(counts))
    m = np.clip(means, med_mean - MEAN_CLIP * med_std, med_mean + MEAN_CLIP * med_std)
    sd = np.clip(stds, med_std / MEAN_CLIP, MEAN_CLIP * med_std)
    if np.array_equal(weights, counts) and np.array_equal(m, means) and np.array_equal(sd, stds):
        return ObsStats.pool(stats)
    w = (weights / weights.sum())[:, None]  # each agent's share of the pool
    return ObsStats(1, (w * m).sum(axis=0), (w * (sd * sd + m * m)).sum(axis=0))  # moments of one unit of weight


def identity(dim: int) -> tuple[np.ndarray, np.ndarray]:
    return np.zeros(dim, np.float32), np.ones(dim, np.float32)


def global_normalizer(mode: str, stats: list[ObsStats]) -> tuple[np.ndarray, np.ndarray]:
    """The (mean, std) the initial global policy carries: pooled statistics, the mean of the
    agents' own (``local``), or the identity (``none``). ``stats`` in agent order."""
    if mode not in NORM_CHOICES:
        raise ValueError(f"obs normalisation must be one of {', '.join(NORM_CHOICES)}, got {mode!r}")
    if mode == "none":
        return identity(len(stats[0].total))
    if mode == "pooled":
        return bounded_pool([s for s, ok in zip(stats, consistent(stats)) if ok]).mean_std()
    per = [s.mean_std() for s in stats]
    return (np.mean([m for m, _ in per], axis=0, dtype=np.float64).astype(np.float32),
            np.mean([sd for _, sd in per], axis=0, dtype=np.float64).astype(np.float32))


def agent_normalizer(mode: str, own: ObsStats, global_norm: tuple[np.ndarray, np.ndarray]
                     ) -> tuple[np.ndarray, np.ndarray]:
    """The (mean, std) one agent applies to its shard: its own under ``local``, else the global."""
    return own.mean_std() if mode == "local" else global_norm


def agent_normalizers(mode: str, agent_obs: list[np.ndarray]) -> list[tuple[np.ndarray, np.ndarray]]:
    """The (mean, std) each agent applies under ``mode``."""
    stats = [ObsStats.of(o) for o in agent_obs]
    g = global_normalizer(mode, stats)
    return [agent_normalizer(mode, s, g) for s in stats]
