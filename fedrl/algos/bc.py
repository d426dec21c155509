"""Behaviour cloning, the Fed-BC baseline's local update.

Default loss is the tanh-Gaussian negative log-likelihood -log pi(a_D|s) (the same term as
DRPO's D(pi, pi_b)); ``BCConfig.loss='mse'`` regresses the deterministic action tanh(mu(s)).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from fedrl.algos.base import (
    POLICY,
    Batch,
    adam,
    generator_tensor,
    load_optimizer_tensors,
    load_prefixed,
    on_device,
    optimizer_tensors,
    prefixed_state,
)
from fedrl.algos.config import BCConfig
from fedrl.algos.nets import TanhGaussianPolicy


def bc_nll_loss(mean: torch.Tensor, log_std: torch.Tensor, actions: torch.Tensor,
                eps: float = 1e-6) -> torch.Tensor:
    """``E_D[-log pi(a_D|s)]`` for pre-tanh parameters ``(..., B, A)``: one value per learner."""
    return -TanhGaussianPolicy.log_prob_from(mean, log_std, actions, eps).mean(dim=-1)


def bc_mse_loss(mean: torch.Tensor, actions: torch.Tensor) -> torch.Tensor:
    """``E_D[||tanh(mu(s)) - a_D||^2]`` for ``(..., B, A)``: one value per learner."""
    return (torch.tanh(mean) - actions).pow(2).sum(-1).mean(dim=-1)


def bc_loss(cfg: BCConfig, mean: torch.Tensor, log_std: torch.Tensor, actions: torch.Tensor) -> torch.Tensor:
    """``cfg.loss``'s behaviour-cloning loss, one value per learner (see the two above)."""
    if cfg.loss == "nll":
        return bc_nll_loss(mean, log_std, actions, cfg.action_clip_eps)
    return bc_mse_loss(mean, actions)


class BCLearner:
    """One agent's behaviour-cloning state (a policy and its optimiser)."""

    def __init__(self, obs_dim: int, act_dim: int, cfg: BCConfig, device: torch.device,
                 generator: torch.Generator) -> None:
        self.cfg, self.device, self.gen = cfg, device, generator
        self.policy = TanhGaussianPolicy(
            obs_dim, act_dim, cfg.hidden, cfg.log_std_min, cfg.log_std_max
        ).to(device)
        self.opt = adam(self.policy.parameters(), cfg.lr)

    def begin_round(self, global_state: Mapping[str, torch.Tensor], adopt: bool = False) -> None:
        """Adopt the global policy (with ``adopt``, its very tensors: see ``load_prefixed``)."""
        state = on_device(global_state, self.device)
        if not load_prefixed(self.policy, state, POLICY, adopt=adopt):
            raise KeyError("global state has no 'policy.*' tensors")
        if self.cfg.reset_actor_optimizer:
            self.opt.state.clear()  # a fresh Adam: moments and step counts start over

    def shared_state(self, federate_critic: bool = False, copy: bool = True) -> dict[str, torch.Tensor]:
        """The policy parameters (BC has no critic)."""
        return prefixed_state(POLICY, self.policy, copy)

    def checkpoint(self) -> dict[str, torch.Tensor]:
        """Policy, optimiser moments and the RNG."""
        return prefixed_state(POLICY, self.policy) | optimizer_tensors("actor", self.opt) | {"rng": generator_tensor(self.gen)}

    @torch.no_grad()
    def restore(self, state: Mapping[str, torch.Tensor]) -> None:
        """Adopt a :meth:`checkpoint`."""
        self.gen.set_state(state["rng"])
        load_optimizer_tensors("actor", self.opt, state)
        if not load_prefixed(self.policy, {k: v.to(self.device) for k, v in state.items()}, POLICY):
            raise KeyError("checkpoint has no 'policy.*' tensors")

    def update(self, batch: Batch) -> dict[str, torch.Tensor]:
        """One BC gradient step."""
        mean, log_std = self.policy(batch.obs)
        loss = bc_loss(self.cfg, mean, log_std, batch.actions)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        self.opt.step()
        return {"bc_loss": loss.detach()}
