"""DRPO local update: CQL critic and the doubly regularised actor.

Source: Yue et al., "Federated Offline Policy Optimization with Dual Regularization",
eq. (local_updating_pi) with the practical KL-based regularisers of its implementation section:

    L_pi = alpha log pi(a|s) - Q(s, a~pi) + lambda1 E_D[-log pi(a_D|s)] + lambda2 E_{a~pi_bar}[-log pi(a|s)]

``pi_bar`` is the frozen global policy received this round; it never receives a gradient.
"""

from __future__ import annotations

import math

import copy
from collections.abc import Mapping
from dataclasses import dataclass
from typing import NamedTuple

import torch

from fedrl.algos.base import (
    CRITIC,
    CRITIC_TARGET,
    POLICY,
    Batch,
    adam,
    generator_tensor,
    load_optimizer_tensors,
    load_prefixed,
    on_device,
    optimizer_tensors,
    prefixed_state,
    soft_update_,
)
from fedrl.algos.config import DRPOConfig
from fedrl.algos.cql import (
    cql_penalty,
    per_sample,
    td_loss,
    td_target,
    temperature_loss,
)
from fedrl.algos.nets import EnsembleCritic, TanhGaussianPolicy


@dataclass(frozen=True)
class ActorLoss:
    """The actor objective and its terms (each a scalar tensor)."""

    total: torch.Tensor
    q_term: torch.Tensor  # -E[Q] as it enters the loss (scaled under q_scale='normalized')
    entropy_term: torch.Tensor  # alpha E[log pi]
    reg_data: torch.Tensor  # E_D[-log pi(a_D|s)], before lambda1
    reg_global: torch.Tensor  # E_{a~pi_bar}[-log pi(a|s)], before lambda2


def actor_loss(
    q_pi: torch.Tensor,
    log_pi: torch.Tensor,
    alpha: torch.Tensor | float,
    nll_data: torch.Tensor | None,
    nll_global: torch.Tensor | None,
    lambda1: float,
    lambda2: float,
    q_scale: str = "raw",
    q_norm: float = 2.5,
) -> ActorLoss:
    """L_pi of eq. (local_updating_pi); all per-sample inputs ``(..., B)``, ``None`` = term off.
    ``alpha``, ``lambda1`` and ``lambda2``: numbers, or one per learner ``(...)``; every term
    comes out per learner ``(...)``.

    ``q_scale='raw'`` uses -E[Q] as written; ``'normalized'`` uses -(q_norm / E|Q|) E[Q] with
    E|Q| detached, so the Q term is O(q_norm) whatever the reward scale.
    """
    q_mean = q_pi.mean(dim=-1)
    if q_scale == "normalized":
        q_term = -(q_norm / q_pi.abs().mean(dim=-1).detach().clamp_min(1e-6)) * q_mean
    elif q_scale == "raw":
        q_term = -q_mean
    else:
        raise ValueError(f"q_scale must be 'raw' or 'normalized', got {q_scale!r}")
    zero = q_mean.new_zeros(q_mean.shape)
    entropy_term = (per_sample(alpha) * log_pi).mean(dim=-1)
    reg_data = nll_data.mean(dim=-1) if nll_data is not None else zero
    reg_global = nll_global.mean(dim=-1) if nll_global is not None else zero
    total = q_term + entropy_term + lambda1 * reg_data + lambda2 * reg_global
    return ActorLoss(total, q_term, entropy_term, reg_data, reg_global)


class Noise(NamedTuple):
    """Every random number one DRPO step uses, drawn up front (leading learner dims ``...``)."""

    pi: torch.Tensor  # (..., B, A) standard normal: the actor's sample a ~ pi(.|s)
    glob: torch.Tensor | None  # (..., B, G, A) standard normal: a ~ pi_bar(.|s) for D(pi, pi_bar); None: term off
    next: torch.Tensor  # (..., B, N+1, A) standard normal: a' ~ pi(.|s') (TD target, then N CQL proposals)
    cur: torch.Tensor  # (..., B, N, A) standard normal: CQL proposals a ~ pi(.|s)
    rand: torch.Tensor  # (..., B, N, A) uniform on [-1, 1): CQL's uniform proposals


def draw_noise(gen: torch.Generator, lead: tuple[int, ...], batch: int, act_dim: int, cfg: DRPOConfig,
               with_global: bool, device: torch.device, dtype: torch.dtype) -> Noise:
    """One step's draws from ``gen``, each kind in one call for all ``lead`` learners, in the
    order the single learner has always drawn them (its runs are unchanged by drawing up front)."""
    n = cfg.cql_n_actions

    def normal(*shape: int) -> torch.Tensor:
        return torch.randn((*lead, batch, *shape), generator=gen, device=device, dtype=dtype)

    pi = normal(act_dim)
    glob = normal(cfg.global_samples, act_dim) if with_global else None
    nxt, cur = normal(n + 1, act_dim), normal(n, act_dim)
    rand = torch.rand((*lead, batch, n, act_dim), generator=gen, device=device, dtype=dtype).mul_(2.0).sub_(1.0)
    return Noise(pi, glob, nxt, cur, rand)


@dataclass(frozen=True)
class Coefs:
    """The weights one DRPO step uses: numbers (one learner) or tensors ``(L,)`` (one per learner)."""

    lambda1: float | torch.Tensor
    lambda2: float | torch.Tensor
    cql_weight: float | torch.Tensor
    td_weight: float | torch.Tensor
    gamma: float | torch.Tensor
    target_entropy: float | torch.Tensor
    q_norm: float | torch.Tensor
    target_mean: bool | torch.Tensor = False
    """Whether the TD target takes the policy's mean action at s' (``target_action="mean"``),
    else the sampled one; ``(L,)`` booleans in a batch."""
    calibrate: bool | torch.Tensor = False
    """Whether the CQL penalty is calibrated by the data's return-to-go (``cql_calibration=
    "returns"`` or ``"returns-gradient"``); ``(L,)`` booleans in a batch."""
    floor_gradient_only: bool | torch.Tensor = False
    """Whether that floor only stops the penalty's gradient (``"returns-gradient"``) instead of
    lifting the policy's values to it; ``(L,)`` booleans in a batch."""


def _returns(batch: Batch) -> torch.Tensor:
    if batch.returns is None:
        raise ValueError("a calibrated CQL penalty (cql_calibration 'returns' or 'returns-gradient') needs "
                         "the data's returns-to-go in the batch (a buffer made with returns_gamma)")
    return batch.returns


def drpo_losses(policy, global_policy, critic, critic_target, batch: Batch, noise: Noise, cfg: DRPOConfig,
                coefs: Coefs, log_alpha: torch.Tensor | None, alpha: torch.Tensor, act_dim: int,
                twin_dim: int, data_reg: bool, global_reg: bool,
                grad_params: list[torch.Tensor] | None = None) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    """The losses of one DRPO step (temperature, actor, critic; each one value per learner), and
    its diagnostics. The single learner (``twin_dim=0``, its critics called as they are: ``(2, B)``)
    and the batched one (``twin_dim=1``, :meth:`EnsembleCritic.grouped`: ``(L, 2, B)``) both run
    exactly this.

    ``cfg`` gives the structural settings (sample counts, the Q scale, the action clip);
    ``coefs`` the weights and the TD target's action (``cfg``'s own are not read); ``data_reg`` / ``global_reg`` whether the lambda terms are
    computed at all (a learner whose lambda is 0 in a batch that computes them multiplies by 0).

    ``grad_params``: the policy's parameters, to also measure the norm of the actor's gradient
    from each of its terms (:func:`actor_grad_norms`; costs five more backward passes)."""
    obs, act, rew, next_obs, done = batch[:5]
    floor = None
    if isinstance(coefs.calibrate, torch.Tensor):  # per learner: the floor, or -inf (no calibration)
        if bool(coefs.calibrate.any()):
            floor = torch.where(coefs.calibrate[:, None], _returns(batch), torch.full_like(rew, -math.inf))
    elif coefs.calibrate:
        floor = _returns(batch)
    n = cfg.cql_n_actions
    sample = TanhGaussianPolicy.sample_with
    q, q_target = (critic.grouped, critic_target.grouped) if twin_dim else (critic, critic_target)

    # pi(.|s): one forward serves the actor sample, both regularisers and the CQL proposals.
    mean, log_std = policy(obs)  # (..., B, A) each
    pi_a, log_pi = sample(mean, log_std, noise.pi)  # (..., B, A), (..., B)

    losses = []
    if log_alpha is not None:
        losses.append(temperature_loss(log_alpha, log_pi, coefs.target_entropy))

    nll_data = nll_global = None
    if data_reg:
        nll_data = -TanhGaussianPolicy.log_prob_from(mean, log_std, act, cfg.action_clip_eps)
    if global_reg:
        with torch.no_grad():
            g_mean, g_log_std = global_policy(obs)
            g_a, _ = sample(g_mean, g_log_std, noise.glob)
        nll_global = -TanhGaussianPolicy.log_prob_from(
            mean.unsqueeze(-2), log_std.unsqueeze(-2), g_a, cfg.action_clip_eps
        ).mean(-1)  # (..., B)

    # Q(s, a~pi) for the actor: gradients flow into the action only, not the critic weights.
    critic.requires_grad_(False)
    q_pi = q(obs, pi_a).min(dim=twin_dim).values  # (..., B)
    critic.requires_grad_(True)
    actor = actor_loss(q_pi, log_pi, alpha, nll_data, nll_global,
                       coefs.lambda1, coefs.lambda2, cfg.q_scale, coefs.q_norm)
    losses.append(actor.total)
    grad_norms = actor_grad_norms(actor, coefs, grad_params, twin_dim) if grad_params is not None else {}

    # Critic: TD target from pi(.|s') and the target critics; CQL(H) proposals.
    with torch.no_grad():
        n_mean, n_log_std = policy(next_obs)
        next_a, next_log_pi = sample(n_mean, n_log_std, noise.next)
        if isinstance(coefs.target_mean, torch.Tensor):  # per learner: (L,) -> (L, 1, 1)
            a_next = torch.where(coefs.target_mean[:, None, None], torch.tanh(n_mean), next_a[..., 0, :])
        else:
            a_next = torch.tanh(n_mean) if coefs.target_mean else next_a[..., 0, :]
        next_q = q_target(next_obs, a_next).min(dim=twin_dim).values  # (..., B)
        y = td_target(rew, done, next_q, coefs.gamma,
                      next_log_pi[..., 0] if cfg.backup_entropy else None, alpha)
        cur_a, cur_log_pi = sample(mean, log_std, noise.cur)  # (..., B, N, A)
    # All critic evaluations at s in one ensemble call: data, uniform, pi(s), pi(s').
    all_a = torch.cat([act.unsqueeze(-2), noise.rand, cur_a, next_a[..., 1:, :]], dim=-2)  # (..., B, 1+3N, A)
    q_all = q(obs.unsqueeze(-2), all_a)  # (..., E, B, 1+3N)
    q_data = q_all[..., 0]
    q_rand, q_cur, q_next = q_all[..., 1:].split(n, dim=-1)
    c_td = td_loss(q_data, y)
    c_cql = cql_penalty(q_data, q_rand, q_cur, cur_log_pi, q_next, next_log_pi[..., 1:], act_dim, floor,
                        coefs.floor_gradient_only)
    losses.append(coefs.td_weight * c_td + coefs.cql_weight * c_cql)

    with torch.no_grad():
        q_data_mean = q_data.mean(dim=(-2, -1))
        diag = {
            "critic_td": c_td.detach(),
            "cql_penalty": c_cql.detach(),
            "actor_loss": actor.total.detach(),
            "actor_q_term": actor.q_term.detach(),
            "reg_data": actor.reg_data.detach(),
            "reg_global": actor.reg_global.detach(),
            "alpha": alpha,
            "q_data": q_data_mean,
            # where the critic's values come from (issue 53): the target's action values, the
            # targets, and the penalty's pushed-down side (its log-sum-exp) beside q_data
            "q_target_action": next_q.mean(dim=-1),
            "td_target": y.mean(dim=-1),
            "cql_logsumexp": c_cql.detach() / 2.0 + q_data_mean,
            "entropy": -log_pi.detach().mean(dim=-1),
            **grad_norms,
        }
    return losses, diag


def actor_grad_norms(actor: ActorLoss, coefs: Coefs, params: list[torch.Tensor],
                     twin_dim: int) -> dict[str, torch.Tensor]:
    """The norm of the gradient of L_pi with respect to the policy's ``params`` from each of its
    terms as weighted in L_pi (the Q term, alpha log pi, lambda1 D(pi, pi_b), lambda2 D(pi, pi_bar))
    and from the whole: which term steers the actor. Per learner: with ``twin_dim`` the parameters
    are stacked ``(L, ...)`` and each learner's norm sums over its own slice. A term that is off
    (its lambda's regulariser not computed) has norm 0. The graph is kept for the step's backward."""
    terms = {"grad_q": actor.q_term, "grad_entropy": actor.entropy_term,
             "grad_lambda1": coefs.lambda1 * actor.reg_data, "grad_lambda2": coefs.lambda2 * actor.reg_global,
             "grad_actor": actor.total}
    out = {}
    for name, term in terms.items():
        if not term.requires_grad:
            out[name] = torch.zeros_like(actor.total.detach())
            continue
        grads = torch.autograd.grad(term.sum(), params, retain_graph=True, allow_unused=True)
        sq = [g.pow(2).flatten(start_dim=1 if twin_dim else 0).sum(dim=-1) for g in grads if g is not None]
        out[name] = torch.stack(sq).sum(dim=0).sqrt() if sq else torch.zeros_like(actor.total.detach())
    return out


class DRPOLearner:
    """One agent's DRPO (or CQL, with lambdas 0) state: policy, twin critic, targets, temperature.

    Critics, target critics and the temperature persist across rounds; the policy is replaced by
    the global policy at :meth:`begin_round`.
    """

    def __init__(
        self,
        obs_dim: int,
        act_dim: int,
        cfg: DRPOConfig,
        device: torch.device,
        generator: torch.Generator,
    ) -> None:
        self.cfg, self.device, self.gen = cfg, device, generator
        self.act_dim = act_dim
        self.policy = TanhGaussianPolicy(
            obs_dim, act_dim, cfg.hidden, cfg.log_std_min, cfg.log_std_max
        ).to(device)
        self.global_policy = copy.deepcopy(self.policy).requires_grad_(False)
        self.critic = EnsembleCritic(obs_dim, act_dim, cfg.hidden, ensemble=2).to(device)
        self.critic_target = copy.deepcopy(self.critic).requires_grad_(False)
        self.target_entropy = (
            -float(act_dim) if cfg.target_entropy is None else float(cfg.target_entropy)
        )
        self.log_alpha: torch.Tensor | None = None
        if cfg.auto_alpha:
            self.log_alpha = torch.tensor(
                float(torch.log(torch.tensor(cfg.alpha_init))), device=device, requires_grad=True
            )
            self.alpha_opt = adam([self.log_alpha], cfg.alpha_lr)
        self.actor_opt = adam(self.policy.parameters(), cfg.actor_lr)
        self.critic_opt = adam(self.critic.parameters(), cfg.critic_lr)

    # -- federation interface -------------------------------------------------------------
    def begin_round(self, global_state: Mapping[str, torch.Tensor], adopt: bool = False) -> None:
        """Set pi and the frozen pi_bar to the global policy (and critics if they are federated).

        ``adopt``: the caller hands ``global_state`` over (see ``load_prefixed``): pi_bar and
        the critics take its tensors themselves, and only pi, which trains while pi_bar must
        keep the global values, gets a copy."""
        state = on_device(global_state, self.device)
        if adopt:
            if not load_prefixed(self.policy, state, POLICY):
                raise KeyError("global state has no 'policy.*' tensors")
            load_prefixed(self.global_policy, state, POLICY, adopt=True)
        # pi and the frozen pi_bar take the same values: one fused copy for both
        elif not load_prefixed((self.policy, self.global_policy), state, POLICY):
            raise KeyError("global state has no 'policy.*' tensors")
        load_prefixed(self.critic, state, CRITIC, adopt=adopt)
        load_prefixed(self.critic_target, state, CRITIC_TARGET, adopt=adopt)
        if self.cfg.reset_actor_optimizer:
            self.actor_opt.state.clear()  # a fresh Adam: moments and step counts start over

    def shared_state(self, federate_critic: bool = False, copy: bool = True) -> dict[str, torch.Tensor]:
        """Policy parameters (and critics when ``federate_critic``) as prefixed CPU tensors."""
        out = prefixed_state(POLICY, self.policy, copy)
        if federate_critic:
            out |= prefixed_state(CRITIC, self.critic, copy) | prefixed_state(CRITIC_TARGET, self.critic_target, copy)
        return out

    def _optimizers(self) -> dict[str, object]:
        opts = {"actor": self.actor_opt, "critic": self.critic_opt}
        if self.log_alpha is not None:
            opts["alpha"] = self.alpha_opt
        return opts

    def checkpoint(self) -> dict[str, torch.Tensor]:
        """Policy, frozen pi_bar, critics, targets, temperature, optimiser moments and the RNG."""
        out = (prefixed_state(POLICY, self.policy) | prefixed_state("global_policy", self.global_policy)
               | prefixed_state(CRITIC, self.critic) | prefixed_state(CRITIC_TARGET, self.critic_target))
        if self.log_alpha is not None:
            out["log_alpha"] = self.log_alpha.detach().to("cpu").clone()
        for name, opt in self._optimizers().items():
            out |= optimizer_tensors(name, opt)
        out["rng"] = generator_tensor(self.gen)
        return out

    @torch.no_grad()
    def restore(self, state: Mapping[str, torch.Tensor]) -> None:
        """Adopt a :meth:`checkpoint` of a learner with the same configuration."""
        state = dict(state)
        self.gen.set_state(state.pop("rng"))
        for name, opt in self._optimizers().items():
            load_optimizer_tensors(name, opt, state)
        dev = {k: v.to(self.device) for k, v in state.items() if not k.startswith("opt.")}
        for prefix, module in ((POLICY, self.policy), ("global_policy", self.global_policy),
                               (CRITIC, self.critic), (CRITIC_TARGET, self.critic_target)):
            if not load_prefixed(module, dev, prefix):
                raise KeyError(f"checkpoint has no '{prefix}.*' tensors")
        if self.log_alpha is not None:
            self.log_alpha.copy_(dev["log_alpha"])

    @property
    def alpha(self) -> torch.Tensor:
        if self.log_alpha is None:
            return torch.tensor(self.cfg.alpha_init, device=self.device)
        return self.log_alpha.detach().exp()

    # -- one gradient step ----------------------------------------------------------------
    def coefs(self) -> Coefs:
        cfg = self.cfg
        return Coefs(cfg.lambda1, cfg.lambda2, cfg.cql_weight, cfg.td_weight, cfg.gamma, self.target_entropy,
                     cfg.q_norm, cfg.target_action == "mean", cfg.cql_calibration != "none",
                     cfg.cql_calibration == "returns-gradient")

    def update(self, batch: Batch, noise: Noise | None = None, grad_norms: bool = False) -> dict[str, torch.Tensor]:
        """One DRPO step: temperature, actor and critic losses, one backward, one Polyak update.
        ``noise``: the step's draws (default: drawn from the learner's generator). ``grad_norms``:
        also report the actor's gradient norm from each term (:func:`actor_grad_norms`); the step
        itself is unchanged."""
        cfg = self.cfg
        if noise is None:
            noise = draw_noise(self.gen, (), batch.obs.shape[0], self.act_dim, cfg, cfg.lambda2 > 0,
                               batch.obs.device, batch.obs.dtype)
        losses, diag = drpo_losses(self.policy, self.global_policy, self.critic, self.critic_target, batch, noise,
                                   cfg, self.coefs(), self.log_alpha, self.alpha, self.act_dim, 0,
                                   cfg.lambda1 > 0, cfg.lambda2 > 0,
                                   [q for q in self.policy.parameters() if q.requires_grad] if grad_norms else None)

        # The three losses touch disjoint parameters, so one backward serves all of them.
        opts = [self.actor_opt, self.critic_opt]
        if self.log_alpha is not None:
            opts.append(self.alpha_opt)
        for o in opts:
            o.zero_grad(set_to_none=True)
        torch.stack(losses).sum().backward()
        for o in opts:
            o.step()
        soft_update_(self.critic_target, self.critic, cfg.tau)
        return diag
