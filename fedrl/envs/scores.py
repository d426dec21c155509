"""D4RL normalised scores: ``100 * (R - R_random) / (R_expert - R_random)``."""

from __future__ import annotations

from fedrl.envs import env_info


def normalized_score(env: str, raw_return: float) -> float:
    """D4RL normalised score of a raw episode return, with D4RL's reference constants."""
    e = env_info(env)
    return 100.0 * (raw_return - e.ref_min_score) / (e.ref_max_score - e.ref_min_score)
