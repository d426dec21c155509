"""Agent shards: K whole trajectories per agent, sampled without replacement, seeded.

A heterogeneous federation draws different agents from different files (e.g. 4 agents from
an expert file and 1 from a medium file): one :class:`ShardSource` per file.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fedrl.data.d4rl import Transitions
from fedrl.data.errors import DatasetError


@dataclass(frozen=True)
class Shard:
    """One agent's private data: its transitions and which episodes of which file they are."""

    agent: int
    source: str
    episodes: tuple[int, ...]
    transitions: Transitions

    def record(self) -> dict:
        """What a run's record keeps of it: which episodes of which file, how many rows, and
        their digest (the file is made again on each machine; the digest says it came out the
        same)."""
        return {"agent": self.agent, "source": self.source, "episodes": list(self.episodes),
                "transitions": len(self.transitions), "sha256": self.transitions.digest()}


@dataclass(frozen=True)
class ShardSource:
    """``agents`` agents each take ``trajectories`` episodes of ``transitions`` (from ``source``)."""

    source: str
    transitions: Transitions
    agents: int


def partition(sources: list[ShardSource], trajectories: int, seed: int,
              min_transitions: int = 1, transitions: int = 0) -> list[Shard]:
    """Deal whole episodes to agents: disjoint within each file, seeded, in agent order.

    Each agent gets ``trajectories`` episodes; with ``transitions`` > 0, it keeps taking whole
    episodes (in a seeded random order) until it also holds at least that many transitions: the
    paper's agents hold 5 trajectories of ~1,000 steps, about 5,000 transitions, which 5 episodes
    of a file with short episodes (hopper-medium: ~255 steps) do not give.
    Only episodes that contribute at least ``min_transitions`` transitions are eligible (an
    episode cut by a timeout after one step contributes none under d4rl's semantics).
    """
    if trajectories < 1:
        raise ValueError(f"trajectories per agent must be >= 1, got {trajectories}")
    if transitions < 0:
        raise ValueError(f"transitions per agent must be >= 0, got {transitions}")
    rng = np.random.default_rng(seed)
    shards: list[Shard] = []
    for src in sources:
        if src.agents < 1:
            raise ValueError(f"{src.source}: agents must be >= 1, got {src.agents}")
        ids, counts = np.unique(src.transitions.episode, return_counts=True)
        eligible = ids[counts >= min_transitions]
        if transitions > 0:
            shards += _deal_by_size(src, ids, counts, eligible, trajectories, transitions, rng, len(shards))
            continue
        need = src.agents * trajectories
        if need > len(eligible):
            raise DatasetError(
                src.source,
                f"{src.agents} agents x {trajectories} trajectories need {need} episodes, "
                f"the file has {len(eligible)}",
            )
        picked = rng.choice(eligible, size=need, replace=False)
        for a in range(src.agents):
            eps = np.sort(picked[a * trajectories:(a + 1) * trajectories])
            shards.append(Shard(len(shards), src.source, tuple(int(e) for e in eps),
                                src.transitions.of_episodes(eps)))
    return shards


def _deal_by_size(src: ShardSource, ids: np.ndarray, counts: np.ndarray, eligible: np.ndarray,
                  trajectories: int, transitions: int, rng: np.random.Generator, first: int) -> list[Shard]:
    """Whole episodes in one seeded order, dealt to each agent in turn until it holds at least
    ``trajectories`` episodes and ``transitions`` transitions."""
    size = dict(zip(ids.tolist(), counts.tolist()))
    order = rng.permutation(eligible).tolist()
    pos, out = 0, []
    for a in range(src.agents):
        take, n = [], 0
        while len(take) < trajectories or n < transitions:
            if pos == len(order):
                raise DatasetError(
                    src.source,
                    f"{src.agents} agents x at least {trajectories} trajectories and {transitions} transitions "
                    f"need more than the file's {len(eligible)} episodes ({sum(size[e] for e in eligible)} "
                    f"transitions); agent {a} ran out")
            take.append(order[pos])
            n += size[order[pos]]
            pos += 1
        eps = np.sort(np.array(take, dtype=np.int64))
        out.append(Shard(first + a, src.source, tuple(int(e) for e in eps), src.transitions.of_episodes(eps)))
    return out
