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


@dataclass(frozen=True)
class ShardSource:
    """``agents`` agents each take ``trajectories`` episodes of ``transitions`` (from ``source``)."""

    source: str
    transitions: Transitions
    agents: int


def partition(sources: list[ShardSource], trajectories: int, seed: int,
              min_transitions: int = 1) -> list[Shard]:
    """Deal whole episodes to agents: disjoint within each file, seeded, in agent order.

    Only episodes that contribute at least ``min_transitions`` transitions are eligible (an
    episode cut by a timeout after one step contributes none under d4rl's semantics).
    """
    if trajectories < 1:
        raise ValueError(f"trajectories per agent must be >= 1, got {trajectories}")
    rng = np.random.default_rng(seed)
    shards: list[Shard] = []
    for src in sources:
        if src.agents < 1:
            raise ValueError(f"{src.source}: agents must be >= 1, got {src.agents}")
        ids, counts = np.unique(src.transitions.episode, return_counts=True)
        eligible = ids[counts >= min_transitions]
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
