"""One agent's data, as the single-agent studies (``q_scale``, ``td_weight``) set it up."""

from __future__ import annotations

import numpy as np

from fedrl.data.d4rl import RawDataset, Transitions, to_transitions
from fedrl.data.normalize import agent_normalizers
from fedrl.data.partition import ShardSource, partition
from fedrl.data.registry import load


def one_shard(dataset: str, trajectories: int, seed: int) -> tuple[RawDataset, Transitions, np.ndarray, np.ndarray]:
    """``trajectories`` whole trajectories of ``dataset`` for one agent (seeded), with the
    observation statistics of that shard: (dataset, transitions, obs mean, obs std)."""
    raw = load(dataset)
    shard = partition([ShardSource(raw.source, to_transitions(raw), 1)], trajectories, seed)[0]
    mean, std = agent_normalizers("pooled", [shard.transitions.obs])[0]
    return raw, shard.transitions, mean, std
