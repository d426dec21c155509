"""Agent-level differential privacy for the round's average (DP-FedAvg, McMahan et al. 2018).

Each agent clips its update, the change it made to the global model this round, to L2 norm ``C``
(``dp_clip``) over every learned tensor it sends (:func:`clip_update`; the observation
normaliser's statistics are set at Join, not learned, and are left as they are). The aggregator
averages the clipped updates and adds Gaussian noise of std ``sigma * C`` to their sum
(``dp_noise``, the noise multiplier; :func:`noisy_average`): one Gaussian mechanism per round
whose sensitivity to adding or removing one agent's whole update is ``C``.

The privacy spent is computed by Google's ``dp-accounting`` (its RDP accountant: the analysis
Opacus and TensorFlow Privacy use, maintained apart from any training library, and exact for the
Gaussian mechanism composed over rounds): every agent takes part in every round (no sampling), so
``rounds`` self-composed Gaussian mechanisms of noise multiplier ``sigma`` give ``epsilon`` at
``delta`` (:func:`epsilon`). A unit is one agent's whole dataset (agent-level DP).

What this does not defend against: the aggregator sees each agent's clipped update before the
noise (central DP trusts it; secure aggregation is what hides single updates); the observation
moments an agent sends at Join with ``obs_norm=pooled`` are not privatised (``obs_norm=none``
sends none); floating-point Gaussian noise is not exactly the mechanism analysed (Mironov 2012).
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Mapping

import torch

# Tensors a shared state carries that no agent learns (the normaliser set from the pooled Join
# moments): they are neither clipped nor noised, and must come back as they went out.
NOT_LEARNED = ("obs_mean", "obs_std")
# The key a round's record (its ROUND_CLOSED event's metrics) gives the epsilon spent so far
PRIVACY_EPSILON = "privacy_epsilon"


def learned(name: str) -> bool:
    return not name.endswith(NOT_LEARNED)


def update_norm(state: Mapping[str, torch.Tensor], base: Mapping[str, torch.Tensor]) -> float:
    """L2 norm of ``state - base`` over every learned floating tensor (in float64)."""
    total = 0.0
    for k, v in state.items():
        if learned(k) and v.is_floating_point():
            total += float((v.double() - base[k].double()).pow(2).sum())
    return math.sqrt(total)


def clip_update(state: Mapping[str, torch.Tensor], base: Mapping[str, torch.Tensor],
                clip: float) -> tuple[dict[str, torch.Tensor], float]:
    """``base + (state - base) * min(1, clip / ||state - base||)``: the update scaled into the
    ball of radius ``clip`` (new tensors; ``state`` and ``base`` are not changed), and the
    update's norm before. Names ``base`` lacks, or of other shapes, are refused."""
    if not clip > 0:
        raise ValueError(f"the clipping norm must be > 0, got {clip}")
    missing = [k for k in state if learned(k) and state[k].is_floating_point()
               and (k not in base or base[k].shape != state[k].shape)]
    if missing:
        raise ValueError(f"cannot clip an update of tensors the global model lacks: {', '.join(sorted(missing))}")
    norm = update_norm(state, base)
    scale = min(1.0, clip / norm) if norm > 0 else 1.0
    out = {}
    for k, v in state.items():
        if learned(k) and v.is_floating_point() and scale < 1.0:
            b = base[k].to(torch.float64)
            out[k] = (b + (v.to(torch.float64) - b) * scale).to(v.dtype)
        else:
            out[k] = v.clone()
    return out, norm


def noise_generator() -> torch.Generator:
    """A generator seeded from the operating system's secure source: noise nobody can replay
    from the run's settings."""
    g = torch.Generator()
    g.manual_seed(secrets.randbits(63))
    return g


def noisy_average(mean: Mapping[str, torch.Tensor], count: int, clip: float, noise: float,
                  generator: torch.Generator) -> dict[str, torch.Tensor]:
    """The average of ``count`` clipped updates (``mean``: their plain average, as FedAvg made it)
    with the mechanism's noise: ``N(0, (noise * clip)^2)`` on their sum, so ``noise * clip /
    count`` on each learned coordinate of the average. Unlearned tensors pass as they are."""
    if count < 1:
        raise ValueError(f"an average of {count} updates")
    std = noise * clip / count
    out = {}
    for k, v in mean.items():
        if learned(k) and v.is_floating_point() and std > 0:
            z = torch.randn(v.shape, generator=generator, dtype=torch.float64)
            out[k] = (v.to(torch.float64) + std * z).to(v.dtype)
        else:
            out[k] = v
    return out


def epsilon(noise: float, rounds: int, delta: float) -> float:
    """The epsilon at ``delta`` that ``rounds`` rounds of the Gaussian mechanism with noise
    multiplier ``noise`` spend (every agent in every round), by ``dp-accounting``'s RDP
    accountant; ``inf`` without noise, 0 before the first round."""
    if rounds <= 0:
        return 0.0
    if not noise > 0:
        return math.inf
    from dp_accounting import dp_event, rdp

    acc = rdp.RdpAccountant()
    acc.compose(dp_event.SelfComposedDpEvent(dp_event.GaussianDpEvent(noise), rounds))
    return float(acc.get_epsilon(delta))


def privacy_spent(cfg, rounds: int) -> dict[str, float]:
    """What a run of settings ``cfg`` (its ``dp_*`` fields) has spent after ``rounds`` rounds."""
    return {"epsilon": epsilon(cfg.dp_noise, rounds, cfg.dp_delta), "delta": cfg.dp_delta, "rounds": rounds,
            "noise_multiplier": cfg.dp_noise, "clip": cfg.dp_clip, "epsilon_budget": cfg.dp_epsilon_budget}
