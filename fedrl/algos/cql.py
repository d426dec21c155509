"""CQL critic losses (Kumar et al. 2020, CQL(H)); the critic half of the DRPO local update.

Every loss takes optional leading learner dimensions (``...``): one learner's inputs give a
scalar, ``L`` learners' stacked inputs give ``(L,)`` (one value per learner), which the batched
learners (:mod:`fedrl.algos.batched`) sum before one backward pass. One source of the maths.

Source: the paper's eq. (cql) and CORL ``algorithms/offline/cql.py`` for the practical
log-sum-exp estimate of the penalty. CQL itself is DRPO with lambda1 = lambda2 = 0
(:func:`fedrl.algos.config.cql_config`); its learner is :class:`fedrl.algos.drpo.DRPOLearner`.
"""

from __future__ import annotations

import math

import torch


def td_target(
    rewards: torch.Tensor,
    dones: torch.Tensor,
    next_q: torch.Tensor,
    gamma: float,
    next_log_prob: torch.Tensor | None = None,
    alpha: torch.Tensor | float = 0.0,
) -> torch.Tensor:
    """``y = r + gamma (1 - done) (Q_targ(s', a') - alpha log pi(a'|s'))``, all ``(..., B)``.

    ``next_q`` is already the minimum over the target critics; pass ``next_log_prob`` only when
    the entropy bonus is backed up (``DRPOConfig.backup_entropy``). ``gamma`` and ``alpha``: a
    number, or one value per learner ``(...)``.
    """
    v = next_q if next_log_prob is None else next_q - per_sample(alpha) * next_log_prob
    return rewards + per_sample(gamma) * (1.0 - dones) * v


def per_sample(x):
    """A per-learner value ``(L,)`` as ``(L, 1)``, to scale that learner's ``(L, B)`` samples; a
    number or a 0-d tensor (one learner) as it is."""
    return x.unsqueeze(-1) if isinstance(x, torch.Tensor) and x.ndim > 0 else x


def td_loss(q_data: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """``sum_e 1/2 E_D[(Q_e(s,a) - y)^2]`` for ``q_data (..., E, B)``, ``target (..., B)`` (eq. cql)."""
    return 0.5 * (q_data - target.detach().unsqueeze(-2)).pow(2).mean(dim=-1).sum(dim=-1)


def cql_penalty(
    q_data: torch.Tensor,
    q_rand: torch.Tensor,
    q_pi: torch.Tensor,
    log_pi: torch.Tensor,
    q_pi_next: torch.Tensor,
    log_pi_next: torch.Tensor,
    act_dim: int,
    floor: torch.Tensor | None = None,
    gradient_only: bool | torch.Tensor = False,
) -> torch.Tensor:
    """CQL(H) penalty ``sum_e E_s[logsumexp_a Q_e(s,a) - Q_e(s,a_D)]`` (before the beta weight).

    The log-sum-exp over actions is estimated with importance sampling from three proposals, all
    evaluated at the current state ``s``: uniform actions (density ``0.5^|A|``), ``a ~ pi(.|s)``
    and ``a ~ pi(.|s')``. Shapes: ``q_data (..., E, B)``, ``q_* (..., E, B, N)``, ``log_pi*
    (..., B, N)``. The log-probabilities are proposal densities and carry no gradient.

    ``floor (..., B)``: Cal-QL's calibration. The policy's actions enter as ``max(Q, floor)``, so
    no gradient pushes a policy action's value below the floor (the data's return-to-go from s);
    the uniform actions are not calibrated (as Cal-QL).

    ``gradient_only`` (one bool, or ``(L,)`` per learner of a batch): the floor stops the penalty's
    gradient instead of lifting the value. A policy action valued below the floor keeps its own
    value in the log-sum-exp (so the uniform actions keep CQL(H)'s weights and are still pushed
    down) but is not itself pushed further down. Cal-QL's lifted value, when the floor is far above
    every early Q, makes the floor dominate the log-sum-exp and silences the whole push-down.
    """
    log_uniform = act_dim * math.log(0.5)
    if floor is not None:
        f = floor.unsqueeze(-2).unsqueeze(-1)  # (..., 1, B, 1) against (..., E, B, N)
        raw_pi, raw_next = q_pi, q_pi_next
        q_pi, q_pi_next = torch.maximum(q_pi, f), torch.maximum(q_pi_next, f)
        if isinstance(gradient_only, torch.Tensor) or gradient_only:
            held_pi = torch.where(raw_pi < f, raw_pi.detach(), raw_pi)
            held_next = torch.where(raw_next < f, raw_next.detach(), raw_next)
            if isinstance(gradient_only, torch.Tensor):  # per learner: (L,) -> (L, 1, 1, 1)
                m = gradient_only.reshape(-1, *[1] * (q_pi.ndim - 1))
                q_pi, q_pi_next = torch.where(m, held_pi, q_pi), torch.where(m, held_next, q_pi_next)
            else:
                q_pi, q_pi_next = held_pi, held_next
    cat = torch.cat(
        [q_rand - log_uniform, q_pi - log_pi.detach().unsqueeze(-3),
         q_pi_next - log_pi_next.detach().unsqueeze(-3)], dim=-1
    )  # (..., E, B, 3N)
    return (torch.logsumexp(cat, dim=-1) - q_data).mean(dim=-1).sum(dim=-1)


def temperature_loss(
    log_alpha: torch.Tensor, log_prob: torch.Tensor, target_entropy: float | torch.Tensor
) -> torch.Tensor:
    """SAC temperature loss ``-log_alpha * E[log pi(a|s) + H_target]`` (log-prob detached);
    ``log_alpha`` and ``target_entropy`` one per learner ``(...)``, ``log_prob (..., B)``."""
    return -(per_sample(log_alpha) * (log_prob.detach() + per_sample(target_entropy))).mean(dim=-1)
