"""Offline data: D4RL/Minari files, agent shards, observation statistics, device buffers, and
making D4RL-style datasets from the behaviour policies.

Layer 4: may import ``fedrl.common``, ``fedrl.algos``, ``fedrl.envs`` and ``fedrl.behavior``."""

# The qualities of a dataset (D4RL's), as names: a made dataset's and a registered one's
QUALITIES = ("random", "medium", "medium-replay", "medium-expert", "expert")
