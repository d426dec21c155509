"""Behaviour policies: online SAC training and the checkpoints datasets are made from.

Layer 3: may import ``fedrl.common``, ``fedrl.algos`` and ``fedrl.envs``."""
