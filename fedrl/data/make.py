"""Make D4RL-format datasets locally by rolling behaviour policies out in gymnasium MuJoCo.

Qualities follow D4RL's recipe (Fu et al. 2020, section "Gym-MuJoCo"):

- ``random``: a uniformly random policy.
- ``medium``: the sampling (stochastic) SAC policy checkpoint whose return is about a third of
  the expert's.
- ``expert``: the sampling SAC policy at the end of training.
- ``medium-replay``: D4RL stores SAC's replay buffer up to the medium checkpoint. That buffer is
  too large to ship, so it is *re-generated*: the uniform-random warm-up, then a rollout of each
  shipped checkpoint up to ``medium``, each taking the share of transitions its training interval
  had in the buffer (see :mod:`fedrl.behavior.shipped`).
- ``medium-expert``: ``medium`` followed by ``expert`` (as D4RL concatenates them).

Rollouts are recorded one environment at a time, so files have D4RL's layout: contiguous
episodes, ``timeouts`` at the time limit and where a segment or the file cuts an episode.
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import Sequence
from pathlib import Path

import gymnasium as gym
import numpy as np

from fedrl.common.progress import Progress
from fedrl.data import QUALITIES
from fedrl.data.d4rl import RawDataset, write_d4rl
from fedrl.envs import env_info, route_mujoco_warnings
from fedrl.envs.rollout import Policy, Segment, uniform_policy

D4RL_TRANSITIONS = 1_000_000


def record(env_name: str, segments: Sequence[Segment], seed: int, max_episode_steps: int = 1000,
           obs_dim: int | None = None, progress: str | None = None) -> RawDataset:
    """Roll each segment's policy out in turn in one environment and record every step.

    A transitions-limited segment cuts its last episode and flags the cut as a timeout, as D4RL's
    files do at their end; the environment is reset between segments. ``progress``: a description
    to show progress with an ETA under (steps, or episodes when a segment is counted in episodes).
    """
    info = env_info(env_name)
    route_mujoco_warnings()
    env = gym.make(info.gym_id, max_episode_steps=max_episode_steps, **info.gym_kwargs(obs_dim))
    rng = np.random.default_rng(seed)
    cols: dict[str, list] = {k: [] for k in ("obs", "act", "rew", "term", "trunc", "next")}
    obs, _ = env.reset(seed=seed)
    episodic = any(s.episodes for s in segments)
    bar = Progress(sum(max(0, s.amount) for s in segments), progress or "", "episodes" if episodic else "steps",
                   enabled=progress is not None)
    try:
        for seg in segments:
            if seg.amount <= 0:
                continue
            done_eps = rows = 0
            while (done_eps < seg.amount) if seg.episodes else (rows < seg.amount):
                a = seg.policy(obs, rng)
                nxt, r, term, trunc, _ = env.step(a)
                rows += 1
                if not seg.episodes:
                    bar.update(1)
                cut = not seg.episodes and rows == seg.amount
                trunc = bool(trunc or (cut and not term))
                for k, v in zip(cols, (obs, a, r, term, trunc, nxt)):
                    cols[k].append(v)
                if term or trunc:
                    done_eps += 1
                    if seg.episodes:
                        bar.update(1)
                    obs, _ = env.reset()
                else:
                    obs = nxt
    finally:
        bar.close()
        env.close()
    return RawDataset(
        observations=np.asarray(cols["obs"], np.float32).reshape(-1, env.observation_space.shape[0]),
        actions=np.asarray(cols["act"], np.float32).reshape(-1, info.act_dim),
        rewards=np.asarray(cols["rew"], np.float32),
        terminals=np.asarray(cols["term"], bool),
        timeouts=np.asarray(cols["trunc"], bool),
        next_observations=np.asarray(cols["next"], np.float32).reshape(-1, env.observation_space.shape[0]),
        source="<rollout>",
    )


def rollout_dataset(env_name: str, policy: Policy, transitions: int, seed: int,
                    max_episode_steps: int = 1000) -> RawDataset:
    """``transitions`` rows of one policy (the last episode may be cut, flagged as a timeout)."""
    return record(env_name, [Segment(policy, transitions)], seed, max_episode_steps)


def return_stats(raw: RawDataset) -> dict[str, float | int]:
    """Return statistics over *complete* episodes (a cut final episode would bias the mean)."""
    ids = raw.episode_ids()
    rets = raw.episode_returns()
    ends = raw.terminals | raw.timeouts
    complete = np.zeros(len(rets), bool)
    complete[ids[ends]] = True
    last_cut = len(raw) and not ends[-1]
    if last_cut:
        complete[ids[-1]] = False
    use = rets[complete] if complete.any() else rets
    return {"episodes": int(len(rets)), "return_mean": float(use.mean()),
            "return_std": float(use.std()), "return_min": float(use.min()),
            "return_max": float(use.max())}


def provenance(info, quality: str, seed: int, **extra) -> dict:
    """Metadata stored with every made dataset."""
    def ver(pkg: str) -> str:
        try:
            return importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            return "unknown"

    return {"env_id": info.gym_id, "env_version": info.gym_id.rsplit("-", 1)[-1],
            "quality": quality, "seed": seed, "maker": "fedrl data make",
            "fedrl_version": ver("fedrl"), "gymnasium_version": ver("gymnasium"),
            "mujoco_version": ver("mujoco"), **extra}


def make_dataset(env_name: str, quality: str, seed: int, out: str | Path, *,
                 transitions: int | None = None, episodes: int | None = None,
                 behavior_dir: str | Path | None = None, progress: bool = True) -> Path:
    """Make a ``quality`` dataset for ``env_name`` and write it to ``out`` (atomically).

    Give at most one of ``transitions`` / ``episodes``; the default is D4RL's size (1M
    transitions; for ``medium-replay`` the replay buffer's size up to the medium checkpoint).
    ``behavior_dir`` overrides the shipped checkpoints (a folder written by
    ``fedrl data ship-behavior``).
    """
    if quality not in QUALITIES:
        raise ValueError(f"unknown quality {quality!r}; choose one of {', '.join(QUALITIES)}")
    if transitions is not None and episodes is not None:
        raise ValueError("give --transitions or --episodes, not both")
    for name, v in (("transitions", transitions), ("episodes", episodes)):
        if v is not None and v <= 0:
            raise ValueError(f"--{name} must be > 0, got {v}")
    info = env_info(env_name)
    show = f"making {quality} {info.gym_id}" if progress else None
    by_episodes = episodes is not None
    amount = episodes if by_episodes else transitions
    if quality == "random":
        n = amount or D4RL_TRANSITIONS
        raw = record(info.gym_id, [Segment(uniform_policy(info.act_dim), n, by_episodes)], seed, progress=show)
        meta = provenance(info, quality, seed, behavior="uniform random actions")
    else:
        from fedrl.behavior.shipped import behavior_set

        bs = behavior_set(info.key, behavior_dir)
        if quality == "medium-replay":
            segs, desc = bs.replay_segments(amount, by_episodes)
            raw = record(info.gym_id, segs, seed, progress=show)
            meta = provenance(info, quality, seed, behavior=desc)
        elif quality == "medium-expert":
            n = amount or D4RL_TRANSITIONS
            half = [Segment(bs.policy("medium"), n // 2 + n % 2, by_episodes),
                    Segment(bs.policy("expert"), n // 2, by_episodes)]
            raw = record(info.gym_id, half, seed, progress=show)
            meta = provenance(info, quality, seed, behavior=[bs.describe("medium"), bs.describe("expert")])
        else:
            n = amount or D4RL_TRANSITIONS
            raw = record(info.gym_id, [Segment(bs.policy(quality), n, by_episodes)], seed, progress=show)
            meta = provenance(info, quality, seed, behavior=bs.describe(quality))
    meta.update(return_stats(raw), transitions=len(raw))
    raw.metadata.clear()
    return write_d4rl(out, raw, meta)

