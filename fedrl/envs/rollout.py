"""Policies rolled out in the environments: a numpy forward for fast rollouts, the random policy,
segments of a recording, and episode returns."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import gymnasium as gym
import numpy as np
from threadpoolctl import threadpool_limits

from fedrl.algos.nets import TanhGaussianPolicy
from fedrl.envs import env_info, route_mujoco_warnings

Policy = Callable[[np.ndarray, np.random.Generator], np.ndarray]


def uniform_policy(act_dim: int) -> Policy:
    return lambda obs, rng: rng.uniform(-1.0, 1.0, size=act_dim).astype(np.float32)


@dataclass(frozen=True)
class Segment:
    """``policy`` recorded for ``amount`` transitions (or whole episodes when ``episodes``)."""

    policy: Policy
    amount: int
    episodes: bool = False


class NumpyPolicy:
    """``tanh(N(mu(s), sigma(s)))`` evaluated in numpy: ~10x cheaper than torch for one state.

    ``stochastic=True`` samples (how D4RL recorded its SAC datasets); ``False`` takes the mean.
    Called as ``policy(obs, rng)``, the :data:`Policy` signature.
    """

    def __init__(self, policy: TanhGaussianPolicy, stochastic: bool = True,
                 dtype: type = np.float64) -> None:
        sd = {k: v.detach().cpu().double().numpy().astype(dtype) for k, v in policy.state_dict().items()}
        n = len([k for k in sd if k.startswith("trunk.") and k.endswith(".weight")])
        self.layers = [(sd[f"trunk.{2 * i}.weight"].T.copy(), sd[f"trunk.{2 * i}.bias"])
                       for i in range(n)]
        self.head = (sd["head.weight"].T.copy(), sd["head.bias"])
        self.mean, self.std = sd["obs_mean"], sd["obs_std"]
        self.lo, self.hi = policy.log_std_min, policy.log_std_max
        self.act_dim, self.stochastic, self.dtype = policy.act_dim, stochastic, dtype
        self.head_mean = (self.head[0][:, : self.act_dim].copy(), self.head[1][: self.act_dim].copy())

    def __call__(self, obs: np.ndarray, rng: np.random.Generator | None = None) -> np.ndarray:
        """Actions for ``obs`` of shape ``(O,)`` or a batch ``(N, O)``."""
        x = (np.asarray(obs, self.dtype) - self.mean) / self.std
        for w, b in self.layers:
            x = np.maximum(x @ w + b, 0.0)
        if not self.stochastic:
            return np.tanh(x @ self.head_mean[0] + self.head_mean[1]).astype(np.float32)
        out = x @ self.head[0] + self.head[1]
        mu = out[..., : self.act_dim]
        log_std = np.clip(out[..., self.act_dim:], self.lo, self.hi)
        mu = mu + np.exp(log_std) * rng.standard_normal(mu.shape)
        return np.tanh(mu).astype(np.float32)


def one_blas_thread():
    """A context in which numpy's BLAS uses one thread. A rollout's products are tiny (a layer
    of ten states: 10 x 256 x 256); OpenBLAS still splits them over its worker threads, which
    then spin between calls: on this project's 2-core machine its worker burned as much CPU as
    the rollout itself (evaluating Hopper-v5 with 10 envs: 1,266-1,787 env steps per CPU second
    against 2,295-3,754 on one thread, at the same wall rate), a core taken from the agents
    training beside the evaluator."""
    return threadpool_limits(limits=1, user_api="blas")


@dataclass(frozen=True)
class Returns:
    returns: tuple[float, ...]

    @property
    def mean(self) -> float:
        return float(np.mean(self.returns))

    @property
    def std(self) -> float:
        return float(np.std(self.returns))


def episode_returns(policy, env_name: str, episodes: int, seed: int,
                    max_episode_steps: int = 1000) -> Returns:
    """Returns of ``episodes`` sequential episodes of ``policy(obs, rng)``."""
    info = env_info(env_name)
    route_mujoco_warnings()
    env = gym.make(info.gym_id, max_episode_steps=max_episode_steps,
                   **info.gym_kwargs(getattr(policy, "mean", np.zeros(info.obs_dim)).shape[0]))
    rng = np.random.default_rng(seed)
    out = []
    with one_blas_thread():
        try:
            for ep in range(episodes):
                obs, _ = env.reset(seed=seed + ep)
                total, done = 0.0, False
                while not done:
                    obs, r, term, trunc, _ = env.step(policy(obs, rng))
                    total += float(r)
                    done = term or trunc
                out.append(total)
        finally:
            env.close()
    return Returns(tuple(out))


def stochastic_return(policy: TanhGaussianPolicy, env_name: str, episodes: int, seed: int,
                      max_episode_steps: int = 1000) -> Returns:
    """Returns of the sampling policy: what a dataset recorded from it will contain."""
    return episode_returns(NumpyPolicy(policy, stochastic=True), env_name, episodes, seed,
                           max_episode_steps)
