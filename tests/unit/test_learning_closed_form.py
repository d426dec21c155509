"""The CQL/DRPO learner learns, on offline data from MDPs whose answers are known in closed form.

No MuJoCo, seconds each: a 4-state chain whose Q-values are geometric sums, and a one-step bandit
whose best action is known. The data's actions are uniform, so the CQL(H) penalty (invariant to a
shift of Q(s, .)) leaves the chain's values where the Bellman equation puts them.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from fedrl.algos import BCConfig, DRPOConfig, cql_config
from fedrl.algos.base import Batch
from fedrl.federation.round import build_learner

GAMMA, L = 0.9, 4
# CQL(H) as written: these check its maths (the calibrated penalty: tests/unit/test_critic_values.py)
FAST = cql_config(DRPOConfig(hidden=(64, 64), batch_size=64, cql_n_actions=4, gamma=GAMMA, tau=0.05,
                             critic_lr=1e-3, actor_lr=1e-3, alpha_lr=1e-3, cql_calibration="none"))
CHAIN_Q = [sum(GAMMA ** j for j in range(L - s)) for s in range(L)]  # 3.439, 2.71, 1.9, 1.0


def chain(n: int = 600, seed: int = 0) -> tuple[torch.Tensor, Batch]:
    """s_k -> s_{k+1} whatever the action, reward 1, the episode ends after s_{L-1}:
    Q(s_k, a) = sum_{j < L-k} gamma^j for every a."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randint(L, (n,), generator=g)
    one_hot = torch.nn.functional.one_hot
    return k, Batch(one_hot(k, L).float(), torch.rand(n, 1, generator=g) * 1.8 - 0.9, torch.ones(n),
                    one_hot((k + 1).clamp(max=L - 1), L).float(), (k == L - 1).float())


def bandit(n: int = 600, seed: int = 0) -> Batch:
    """One step, reward 1 - 2 (a - 0.5)^2: the best action is 0.5; the data's actions are uniform."""
    g = torch.Generator().manual_seed(seed)
    a = torch.rand(n, 1, generator=g) * 1.8 - 0.9
    obs = torch.ones(n, 2)
    return Batch(obs, a, 1 - 2 * (a[:, 0] - 0.5) ** 2, obs, torch.ones(n))


def train(cfg, data: Batch, steps: int, obs_dim: int):
    torch.manual_seed(0)
    ln = build_learner(cfg, obs_dim, 1, torch.device("cpu"), 0, 1)
    g = torch.Generator().manual_seed(3)
    n = len(data.rewards)
    for _ in range(steps):
        idx = torch.randint(n, (cfg.batch_size,), generator=g)
        ln.update(Batch(*(None if x is None else x[idx] for x in data)))
    return ln


@pytest.mark.slow(reason="trains a critic to its closed-form values")
@pytest.mark.parametrize("beta,steps,tol", [(0.0, 1000, 0.05), (10.0, 1500, 0.2)])
def test_critic_reaches_the_chains_closed_form_q_values(beta, steps, tol):
    k, data = chain()
    ln = train(dataclasses.replace(FAST, cql_weight=beta), data, steps, L)
    with torch.no_grad():
        q = ln.critic(data.obs, data.actions)  # (2, n)
    for s in range(L):
        for member in range(2):
            got = float(q[member, k == s].mean())
            assert abs(got - CHAIN_Q[s]) < tol, f"beta {beta}: Q(s{s}) = {got:.3f}, closed form {CHAIN_Q[s]:.3f}"


@pytest.mark.slow(reason="trains an actor to convergence on a bandit")
def test_actor_picks_the_bandits_best_action():
    ln = train(dataclasses.replace(FAST, cql_weight=0.0), bandit(), 1500, 2)
    best = float(ln.policy.act(torch.ones(1, 2)))
    assert abs(best - 0.5) < 0.1, f"deterministic action {best:.3f}, best 0.5"


def test_bc_recovers_the_data_policy():
    """Behaviour cloning of a deterministic data policy a = 0.6 tanh(s): the clone's action."""
    g = torch.Generator().manual_seed(0)
    obs = torch.randn(600, 1, generator=g)
    data = Batch(obs, 0.6 * torch.tanh(obs), torch.zeros(600), obs, torch.zeros(600))
    cfg = BCConfig(hidden=(64, 64), batch_size=64, lr=1e-3)
    ln = train(cfg, data, 1000, 1)
    probe = torch.linspace(-2, 2, 9)[:, None]
    err = (ln.policy.act(probe) - 0.6 * torch.tanh(probe)).abs().max()
    assert err < 0.05, f"largest action error {float(err):.3f}"
