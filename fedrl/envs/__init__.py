"""The MuJoCo tasks the project knows (gymnasium ids, dimensions, D4RL reference returns); the
package also holds D4RL scores (``scores``), policy rollouts (``rollout``) and evaluation.

Layer 2: may import ``fedrl.common`` and ``fedrl.algos``."""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class EnvInfo:
    """One locomotion task: how to build it and how D4RL normalises its returns."""

    key: str  # d4rl's prefix: hopper, halfcheetah, walker2d, ant
    gym_id: str  # gymnasium id of the v5 env used for evaluation and data making
    obs_dim: int
    act_dim: int
    ref_min_score: float  # D4RL REF_MIN_SCORE (random policy)
    ref_max_score: float  # D4RL REF_MAX_SCORE (expert policy)
    # Observation layouts the v5 env can produce, by width -> make() kwargs.
    layouts: dict[int, dict[str, Any]] = field(default_factory=dict)

    def gym_kwargs(self, obs_dim: int | None = None) -> dict[str, Any]:
        """make() kwargs whose observation layout has ``obs_dim`` entries (default: the env's)."""
        d = self.obs_dim if obs_dim is None else obs_dim
        if d == self.obs_dim and d not in self.layouts:
            return {}
        if d in self.layouts:
            return dict(self.layouts[d])
        hint = ""
        if self.key == "ant" and d == 111:
            hint = (" (D4RL's ant-*-v2 files have mujoco-py's 111-dim layout with contact forces of"
                    " every body; gymnasium's Ant-v5 gives 27 or 105 dims and cannot reproduce it)")
        raise ValueError(
            f"{self.gym_id}: no observation layout with {d} dims; known: "
            f"{sorted({self.obs_dim, *self.layouts})}{hint}"
        )


# Reference returns: D4RL infos.py (REF_MIN_SCORE / REF_MAX_SCORE), identical for v0-v2.
ENVS: dict[str, EnvInfo] = {
    "hopper": EnvInfo("hopper", "Hopper-v5", 11, 3, -20.272305, 3234.3),
    "halfcheetah": EnvInfo("halfcheetah", "HalfCheetah-v5", 17, 6, -280.178953, 12135.0),
    "walker2d": EnvInfo("walker2d", "Walker2d-v5", 17, 6, 1.629008, 4592.3),
    # Ant: what this project trains and makes is the 27-dim layout (positions and velocities). D4RL's
    # 111-dim files carried 84 contact-force entries that mujoco-py >= 2.0 left at zero, so the 27
    # are what its data informed a learner with; v5's default 105 (with 78 real contact forces) is
    # accepted for files made elsewhere (Minari's).
    "ant": EnvInfo("ant", "Ant-v5", 27, 8, -325.6, 3879.7,
                   layouts={27: {"include_cfrc_ext_in_observation": False}, 105: {}}),
}


def env_info(name: str) -> EnvInfo:
    """Find a task by gymnasium id (``Hopper-v5``), d4rl prefix (``hopper``), dataset name
    (``hopper-medium-v2``) or Minari dataset id (``mujoco/walker2d/medium-v0``); unknown names
    list the valid choices."""
    low = name.lower()
    if "/" in low:  # a Minari id (namespace/env/quality-vN) or a path: the env is one of its parts
        for part in low.split("/"):
            try:
                return env_info(part)
            except ValueError:
                continue
    m = re.match(r"^([a-z0-9]+?)(?:-v\d+)?$", low)
    if m and m.group(1) in ENVS:
        return ENVS[m.group(1)]
    head = low.split("-")[0]
    if head in ENVS:
        return ENVS[head]
    raise ValueError(  # the name cut short: a caller's error must fit a status message
        f"unknown environment {name[:80]!r}{'...' if len(name) > 80 else ''}; known: "
        + ", ".join(f"{e.gym_id} ({e.key})" for e in ENVS.values())
    )


# -- MuJoCo's own warnings ---------------------------------------------------------------------
# Left alone, MuJoCo prints each warning to stderr and appends it to MUJOCO_LOG.TXT in the working
# directory: gymnasium's HalfCheetah model alone triggers one per environment built (a deprecated
# compiler attribute in its own XML), so every run left that file behind in the user's folder.
_MUJOCO_LOG = logging.getLogger("fedrl.mujoco")
# Warnings about gymnasium's shipped models that a user cannot act on: logged at DEBUG only.
_MUJOCO_MODEL_NOISE = ("compiler attribute 'settotalmass' is deprecated",)


def _mujoco_warning(message: str) -> None:
    noise = message.startswith(_MUJOCO_MODEL_NOISE)
    _MUJOCO_LOG.log(logging.DEBUG if noise else logging.WARNING, "MuJoCo: %s", message)


def route_mujoco_warnings() -> None:
    """Send MuJoCo's warnings to Python logging (``fedrl.mujoco``) instead of stderr and a
    MUJOCO_LOG.TXT in the working directory. Called before every environment this project
    builds; a handler the user installed first is kept."""
    import mujoco

    if mujoco.get_mju_user_warning() is None:
        mujoco.set_mju_user_warning(_mujoco_warning)
