"""Offline data: D4RL/Minari files, agent shards, observation statistics, device buffers, and
making D4RL-style datasets from the behaviour policies.

Layer 4: may import ``fedrl.common``, ``fedrl.algos``, ``fedrl.envs`` and ``fedrl.behavior``."""
