"""Roll a policy out in gymnasium MuJoCo: vectorised envs, one batched forward per step."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import gymnasium as gym
import numpy as np
import torch

from fedrl.algos.nets import TanhGaussianPolicy
from fedrl.envs import env_info, route_mujoco_warnings
from fedrl.envs.rollout import NumpyPolicy, one_blas_thread
from fedrl.envs.scores import normalized_score


@dataclass(frozen=True)
class EvalResult:
    """Returns of ``episodes`` deterministic rollouts and their D4RL normalised scores."""

    env_id: str
    returns: tuple[float, ...]
    lengths: tuple[int, ...]
    return_mean: float
    return_std: float
    score_mean: float  # D4RL normalised, 0 = random, 100 = expert
    score_std: float
    env_steps: int
    seconds: float

    def as_dict(self) -> dict:
        d = asdict(self)
        d["returns"], d["lengths"] = list(self.returns), list(self.lengths)
        return d


def make_vec_env(env_name: str, num_envs: int, obs_dim: int | None = None,
                 max_episode_steps: int = 1000) -> gym.vector.VectorEnv:
    """``num_envs`` synchronous copies whose observation layout has ``obs_dim`` entries."""
    info = env_info(env_name)
    route_mujoco_warnings()
    return gym.make_vec(
        info.gym_id, num_envs=num_envs, vectorization_mode="sync",
        vector_kwargs={"autoreset_mode": gym.vector.AutoresetMode.SAME_STEP},
        max_episode_steps=max_episode_steps, **info.gym_kwargs(obs_dim),
    )


@torch.no_grad()
def evaluate(policy: TanhGaussianPolicy, env_name: str, episodes: int, seed: int,
             num_envs: int = 10, max_episode_steps: int = 1000) -> EvalResult:
    """Exactly ``episodes`` episodes of the deterministic policy ``tanh(mu(s))``.

    Episodes are dealt to ``min(num_envs, episodes)`` envs in fixed quotas so that short episodes
    are not over-represented; every env keeps stepping (its extra episodes are ignored) until all
    quotas are met. Seeded: the same policy and seed give the same returns.

    Raises ``ValueError`` when an action is not finite: finite weights can still overflow to NaN
    (weights near float32's limit), and MuJoCo given NaN controls returns NaN rewards, not a
    return.
    """
    if episodes < 1:
        raise ValueError(f"episodes must be >= 1, got {episodes}")
    info = env_info(env_name)
    n = min(num_envs, episodes)
    quota = np.array([episodes // n + (i < episodes % n) for i in range(n)])
    envs = make_vec_env(env_name, n, policy.obs_dim, max_episode_steps)
    # One small batched forward per step: numpy (float32) is several times cheaper than torch's
    # per-call overhead at these sizes, which matters next to MuJoCo's ~0.1 ms per env step.
    act_fn = NumpyPolicy(policy, stochastic=False, dtype=np.float32)
    returns: list[float] = []
    lengths: list[int] = []
    ep_ret, ep_len, done = np.zeros(n), np.zeros(n, dtype=np.int64), np.zeros(n, dtype=np.int64)
    steps, t0 = 0, time.perf_counter()
    with one_blas_thread():
        try:
            obs, _ = envs.reset(seed=seed)
            while (done < quota).any():
                with np.errstate(over="ignore", invalid="ignore"):  # an overflow is one error below, not warnings
                    act = act_fn(obs)
                if not np.isfinite(act).all():
                    raise ValueError(f"the policy's actions are not finite at step {int(ep_len.max())} of an "
                                     f"episode in {info.gym_id} (its weights overflow float32): no return to report")
                obs, rew, term, trunc, _ = envs.step(act)
                steps += n
                ep_ret += rew
                ep_len += 1
                for i in np.flatnonzero(term | trunc):
                    if done[i] < quota[i]:
                        returns.append(float(ep_ret[i]))
                        lengths.append(int(ep_len[i]))
                        done[i] += 1
                    ep_ret[i], ep_len[i] = 0.0, 0
        finally:
            envs.close()
    r = np.asarray(returns)
    scores = np.array([normalized_score(info.key, x) for x in r])
    return EvalResult(info.gym_id, tuple(returns), tuple(lengths), float(r.mean()), float(r.std()),
                      float(scores.mean()), float(scores.std()), steps, time.perf_counter() - t0)


class StackedPolicies:
    """Several policies' deterministic actions ``tanh(mu(s))`` in one batched call per step:
    ``(P, n, O)`` raw observations -> ``(P, n, A)`` actions, in float32 numpy as
    :class:`NumpyPolicy` (each layer one ``np.matmul`` over the stacked weights)."""

    def __init__(self, states: list[dict[str, torch.Tensor]]) -> None:
        def stack(key: str) -> np.ndarray:
            return np.stack([st[key].detach().cpu().numpy().astype(np.float32) for st in states])

        n = len([k for k in states[0] if k.startswith("trunk.") and k.endswith(".weight")])
        self.act_dim = states[0]["head.bias"].shape[0] // 2
        self.layers = [(stack(f"trunk.{2 * i}.weight").transpose(0, 2, 1).copy(), stack(f"trunk.{2 * i}.bias")[:, None])
                       for i in range(n)]
        head_w, head_b = stack("head.weight"), stack("head.bias")
        self.head = (head_w[:, : self.act_dim].transpose(0, 2, 1).copy(), head_b[:, None, : self.act_dim])
        self.mean, self.std = stack("obs_mean")[:, None], stack("obs_std")[:, None]

    def __call__(self, obs: np.ndarray) -> np.ndarray:
        x = (np.asarray(obs, np.float32) - self.mean) / self.std
        for w, b in self.layers:
            x = np.maximum(np.matmul(x, w) + b, 0.0)
        return np.tanh(np.matmul(x, self.head[0]) + self.head[1])


@torch.no_grad()
def evaluate_many(states: list[dict[str, torch.Tensor]], env_name: str, episodes: int, seeds: list[int],
                  num_envs: int = 10, max_episode_steps: int = 1000) -> list[EvalResult]:
    """:func:`evaluate` of several policies (``TanhGaussianPolicy`` state dicts) in one pass:
    policy p gets ``min(num_envs, episodes)`` envs seeded as :func:`evaluate` seeds them with
    ``seeds[p]`` (env i: ``seeds[p] + i``) and the same episode quotas, all stepped as one vector
    env with one batched policy call per step. The episodes are :func:`evaluate`'s; returns agree
    up to the float rounding of a batched product (MuJoCo amplifies a last-bit difference over a
    long episode, so single returns can move; scores stay comparable)."""
    if episodes < 1:
        raise ValueError(f"episodes must be >= 1, got {episodes}")
    if len(seeds) != len(states):
        raise ValueError(f"{len(seeds)} seeds for {len(states)} policies")
    info = env_info(env_name)
    P, n = len(states), min(num_envs, episodes)
    quota = np.tile(np.array([episodes // n + (i < episodes % n) for i in range(n)]), P)
    obs_dim = states[0]["obs_mean"].shape[0]
    envs = make_vec_env(env_name, P * n, obs_dim, max_episode_steps)
    act_fn = StackedPolicies(states)
    returns: list[list[float]] = [[] for _ in range(P)]
    lengths: list[list[int]] = [[] for _ in range(P)]
    ep_ret, ep_len, done = np.zeros(P * n), np.zeros(P * n, dtype=np.int64), np.zeros(P * n, dtype=np.int64)
    steps, t0 = 0, time.perf_counter()
    with one_blas_thread():
        try:
            obs, _ = envs.reset(seed=[int(s) + i for s in seeds for i in range(n)])
            while (done < quota).any():
                act = act_fn(obs.reshape(P, n, -1)).reshape(P * n, -1)
                obs, rew, term, trunc, _ = envs.step(act)
                steps += P * n
                ep_ret += rew
                ep_len += 1
                for i in np.flatnonzero(term | trunc):
                    if done[i] < quota[i]:
                        returns[i // n].append(float(ep_ret[i]))
                        lengths[i // n].append(int(ep_len[i]))
                        done[i] += 1
                    ep_ret[i], ep_len[i] = 0.0, 0
        finally:
            envs.close()
    secs = time.perf_counter() - t0
    out = []
    for p in range(P):
        r = np.asarray(returns[p])
        scores = np.array([normalized_score(info.key, x) for x in r])
        out.append(EvalResult(info.gym_id, tuple(returns[p]), tuple(lengths[p]), float(r.mean()), float(r.std()),
                              float(scores.mean()), float(scores.std()), steps // P, secs))
    return out
