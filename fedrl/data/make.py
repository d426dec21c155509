"""Make D4RL-format datasets locally by rolling a behaviour policy out in gymnasium MuJoCo.

This session ships the ``random`` quality (uniform actions, as D4RL's ``*-random`` files);
the SAC-trained behaviour policies for ``medium``/``expert`` are future work.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import gymnasium as gym
import numpy as np

from fedrl.data.d4rl import RawDataset, write_d4rl
from fedrl.envs import env_info

Policy = Callable[[np.ndarray, np.random.Generator], np.ndarray]


def uniform_policy(act_dim: int) -> Policy:
    return lambda obs, rng: rng.uniform(-1.0, 1.0, size=act_dim).astype(np.float32)


def rollout_dataset(env_name: str, policy: Policy, transitions: int, seed: int,
                    max_episode_steps: int = 1000) -> RawDataset:
    """Roll ``policy`` out until ``transitions`` rows are recorded (the last episode may be cut,
    and is then flagged as a timeout, as D4RL does)."""
    info = env_info(env_name)
    env = gym.make(info.gym_id, max_episode_steps=max_episode_steps, **info.gym_kwargs())
    rng = np.random.default_rng(seed)
    cols: dict[str, list] = {k: [] for k in ("obs", "act", "rew", "term", "trunc", "next")}
    obs, _ = env.reset(seed=seed)
    for i in range(transitions):
        a = policy(obs, rng)
        nxt, r, term, trunc, _ = env.step(a)
        trunc = trunc or (i == transitions - 1 and not term)
        for k, v in zip(cols, (obs, a, r, term, trunc, nxt)):
            cols[k].append(v)
        obs = env.reset()[0] if term or trunc else nxt
    env.close()
    return RawDataset(
        observations=np.asarray(cols["obs"], np.float32),
        actions=np.asarray(cols["act"], np.float32),
        rewards=np.asarray(cols["rew"], np.float32),
        terminals=np.asarray(cols["term"], bool),
        timeouts=np.asarray(cols["trunc"], bool),
        next_observations=np.asarray(cols["next"], np.float32),
        source="<rollout>",
    )


def make_random_dataset(env_name: str, transitions: int, seed: int, out: str | Path) -> Path:
    """A ``random``-quality dataset (uniform actions) written to ``out`` in D4RL format."""
    info = env_info(env_name)
    raw = rollout_dataset(env_name, uniform_policy(info.act_dim), transitions, seed)
    rets = raw.episode_returns()
    return write_d4rl(out, raw, {
        "env_id": info.gym_id, "quality": "random", "behavior": "uniform", "seed": seed,
        "maker": "fedrl.data.make", "return_mean": float(rets.mean()),
        "return_min": float(rets.min()), "return_max": float(rets.max()),
    })
