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

Adaptive clipping (Andrew et al. 2021, ``dp_clip_quantile``): ``C`` follows a quantile of the
agents' update norms instead of staying fixed. Each round the aggregator counts the updates
within ``C`` (each agent's bit, centred: sensitivity 1/2), adds N(0, sigma_b^2) to the count
(:func:`noisy_unclipped_fraction`), and moves ``C`` geometrically towards the target quantile
(:func:`next_clip`). Under secure aggregation each agent clips to the round's norm and adds its
noisy centred bit (:func:`count_share`) to the vector it masks, so the aggregator learns only the
noisy count. The updates' noise multiplier becomes ``sigma_u = (sigma^-2 - (2 sigma_b)^-2)^-1/2``
(:func:`update_noise`), so that the two Gaussian mechanisms of a round together spend what one
of multiplier ``sigma`` does; :func:`epsilon` composes both, by the same accountant.

What this does not defend against: the aggregator sees each agent's clipped update before the
noise (central DP trusts it; secure aggregation is what hides single updates); the observation
moments an agent sends at Join with ``obs_norm=pooled`` are not privatised (``obs_norm=none``
sends none); floating-point Gaussian noise is not exactly the mechanism analysed (Mironov 2012).
"""

from __future__ import annotations

import functools
import math
import secrets
from collections.abc import Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported where noise is drawn or an update clipped: a settings check needs none
    import torch

# Tensors a shared state carries that no agent learns (the normaliser set from the pooled Join
# moments): they are neither clipped nor noised, and must come back as they went out.
NOT_LEARNED = ("obs_mean", "obs_std")
# The key a round's record (its ROUND_CLOSED event's metrics) gives the epsilon spent so far
PRIVACY_EPSILON = "privacy_epsilon"
# Adaptive clipping's metrics of a round (its ROUND_CLOSED event's), by their names in a round's record
ADAPTIVE_RECORD = {"dp_clip": "clip", "dp_unclipped_fraction": "unclipped_fraction", "dp_clip_next": "clip_next"}
# The ranges the settings must lie in (0 turns each off), so that the arithmetic can take them:
# a noise multiplier past ~1e155 overflows the accountant, one below 1e-3 spends an epsilon of
# billions; noise x clip stays below 1e9, far inside float32, so a noisy average is finite.
# Adaptive clipping keeps the norm it moves inside CLIP_RANGE whatever the noisy count says.
CLIP_RANGE = (1e-6, 1e6)
NOISE_RANGE = (1e-3, 1e3)
COUNT_NOISE_RANGE = (1e-3, 1e4)
CLIP_LR_MAX = 10.0


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
    import torch

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
    import torch

    g = torch.Generator()
    g.manual_seed(secrets.randbits(63))
    return g


def noisy_average(mean: Mapping[str, torch.Tensor], count: int, clip: float, noise: float,
                  generator: torch.Generator) -> dict[str, torch.Tensor]:
    """The average of ``count`` clipped updates (``mean``: their plain average, as FedAvg made it)
    with the mechanism's noise: ``N(0, (noise * clip)^2)`` on their sum, so ``noise * clip /
    count`` on each learned coordinate of the average. Unlearned tensors pass as they are."""
    import torch

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


def update_noise(noise: float, count_noise: float) -> float:
    """The updates' noise multiplier under adaptive clipping: ``(noise^-2 - (2 count_noise)^-2)^-1/2``,
    so that it and the clipped count's noise (``count_noise``; the centred count's sensitivity
    is 1/2) spend together what one Gaussian of multiplier ``noise`` does (Andrew et al. 2021,
    section 3). ``noise`` itself without a count noise (fixed clipping); 0 without noise."""
    if not noise > 0 or not count_noise:
        return noise
    rest = noise ** -2 - (2 * count_noise) ** -2
    if not rest > 0:
        raise ValueError(f"a count noise of {count_noise:g} spends more than a noise multiplier of {noise:g} "
                         f"allows: it must be above {noise / 2:g}")
    return rest ** -0.5


def noisy_unclipped_fraction(norms: list[float], clip: float, count_noise: float,
                             generator: torch.Generator | None) -> float:
    """The share of ``norms`` within ``clip``, with N(0, count_noise^2) added to their centred
    count (each update's bit minus 1/2): what adaptive clipping may release."""
    import torch

    if not norms:
        raise ValueError("no update to count")
    centred = sum((1.0 if x <= clip else 0.0) - 0.5 for x in norms)
    if count_noise > 0:
        if generator is None:
            raise ValueError("the clipped count's noise needs a generator")
        centred += count_noise * float(torch.randn((), generator=generator, dtype=torch.float64))
    return centred / len(norms) + 0.5


def noise_share_std(cfg, clip: float) -> float:
    """The std of the noise each agent adds to its own update under secure aggregation (settings
    ``cfg``, the round's norm ``clip``): ``sigma_u * clip / sqrt(t)``, so that any t or more
    survivors' sum carries at least the central mechanism's N(0, (sigma_u * clip)^2); 0 without
    noise. ``sigma_u`` is :func:`update_noise` (``dp_noise`` itself under fixed clipping)."""
    if not cfg.dp_noise:
        return 0.0
    return update_noise(cfg.dp_noise, count_noise(cfg)) * clip / math.sqrt(cfg.secagg_threshold)


def count_share(within: bool, count_noise: float, threshold: int, generator: torch.Generator | None) -> float:
    """An agent's share of adaptive clipping's count under secure aggregation: its centred bit
    (1/2 when its update was within the norm, else -1/2) with N(0, count_noise^2 / threshold)
    added, so that any ``threshold`` or more agents' sum carries at least the central noise."""
    import torch

    share = 0.5 if within else -0.5
    if count_noise > 0:
        if generator is None:
            raise ValueError("the clipped count's noise needs a generator")
        share += count_noise / math.sqrt(threshold) * float(torch.randn((), generator=generator, dtype=torch.float64))
    return share


def count_extra(cfg, metrics: Mapping[str, float], generator: torch.Generator | None) -> list[float]:
    """What an agent of a run with settings ``cfg`` sums with its model under secure aggregation
    beside it: under adaptive clipping its :func:`count_share` (from its round's ``metrics``:
    ``clipped`` is 0 when its update was within the norm), else nothing."""
    if not cfg.dp_clip_quantile:
        return []
    return [count_share(metrics["clipped"] == 0.0, count_noise(cfg), cfg.secagg_threshold, generator)]


def fraction_from_shares(mean_share: float) -> float:
    """The share of updates within the norm from the mean of the agents' :func:`count_share`s."""
    return mean_share + 0.5


def next_clip(clip: float, unclipped_fraction: float, quantile: float, lr: float) -> float:
    """Adaptive clipping's geometric step: ``clip * exp(-lr * (unclipped_fraction - quantile))``
    (it grows while fewer than ``quantile`` of the updates fit, and shrinks while more do), taken
    in log space and held inside :data:`CLIP_RANGE`: a noisy count far outside [0, 1] (large
    noise, or one agent's share under secure aggregation, which nobody sees) moves the norm to
    the range's end instead of overflowing. A fraction that is not a number is refused."""
    if not math.isfinite(unclipped_fraction):
        raise ValueError(f"the share of updates within the norm is {unclipped_fraction!r}, not a finite number")
    low, high = CLIP_RANGE
    step = math.log(clip) - lr * (unclipped_fraction - quantile)
    return math.exp(min(max(step, math.log(low)), math.log(high)))


@functools.lru_cache(maxsize=4096)
def epsilon(noise: float, rounds: int, delta: float, count_noise: float = 0.0) -> float:
    """The epsilon at ``delta`` that ``rounds`` rounds of the Gaussian mechanism with noise
    multiplier ``noise`` spend (every agent in every round), by ``dp-accounting``'s RDP
    accountant; ``inf`` without noise, 0 before the first round. With ``count_noise`` (adaptive
    clipping) each round is two Gaussian mechanisms, the updates' at :func:`update_noise` and the
    centred count's at ``2 * count_noise``, composed by the accountant. Kept once computed (a few
    thousand values): the aggregator computes a round's ahead of its close, off its lock
    (:func:`warm_epsilon`), so that the close finds it."""
    if rounds <= 0:
        return 0.0
    if not noise > 0:
        return math.inf
    from dp_accounting import dp_event, rdp

    one = dp_event.GaussianDpEvent(noise)
    if count_noise:
        one = dp_event.ComposedDpEvent([dp_event.GaussianDpEvent(update_noise(noise, count_noise)),
                                        dp_event.GaussianDpEvent(2 * count_noise)])
    acc = rdp.RdpAccountant()
    acc.compose(dp_event.SelfComposedDpEvent(one, rounds))
    return float(acc.get_epsilon(delta))


def warm_epsilon(cfg, rounds: int) -> None:
    """Compute (and keep) what the rounds of a run of settings ``cfg`` will ask the accountant for
    around round ``rounds``: the epsilon spent by it and by the round after (the budget's check)."""
    if cfg.dp_clip and cfg.dp_noise:
        for r in (rounds, rounds + 1):
            epsilon(cfg.dp_noise, r, cfg.dp_delta, count_noise(cfg))


def count_noise(cfg) -> float:
    """The clipped count's noise of a run with settings ``cfg``: ``dp_count_noise``, or under
    adaptive clipping with noise and none set, ``agents / 20`` (Andrew et al. 2021's choice);
    0 with fixed clipping or without noise."""
    if not cfg.dp_clip_quantile or not cfg.dp_noise:
        return 0.0
    return cfg.dp_count_noise or cfg.agents / 20


def agent_clip(cfg) -> float:
    """The norm an agent clips its own update to at first: the run's, or none under adaptive
    clipping without secure aggregation (the aggregator clips to the norm it moves; an agent
    clipping to another would skew its count). Under secure aggregation the agent clips, and
    adaptive clipping gives it each round's norm with the round's task."""
    return 0.0 if cfg.dp_clip_quantile and not cfg.secagg_threshold else cfg.dp_clip


def task_clip(cfg, given: float, round_: int) -> float | None:
    """The norm an agent clips round ``round_``'s update to where its task must give it (adaptive
    clipping under secure aggregation: the aggregator moves it every round), else None. A norm
    that is not a positive finite number is refused (ValueError, naming the round): an update left
    unclipped would break the privacy the run promises."""
    if not (cfg.secagg_threshold and cfg.dp_clip_quantile):
        return None
    if not (math.isfinite(given) and given > 0):
        why = "no clipping norm (an aggregator too old for adaptive clipping under secure aggregation)" \
            if given == 0 else f"the clipping norm {given!r}, not a positive finite number"
        raise ValueError(f"round {round_}'s task gives {why}")
    return given


def privacy_spent(cfg, rounds: int, clip: float | None = None) -> dict[str, float]:
    """What a run of settings ``cfg`` (its ``dp_*`` fields) has spent after ``rounds`` rounds
    (``clip``: the clipping norm now, where adaptive clipping moved it)."""
    out = {"epsilon": epsilon(cfg.dp_noise, rounds, cfg.dp_delta, count_noise(cfg)), "delta": cfg.dp_delta,
           "rounds": rounds, "noise_multiplier": cfg.dp_noise, "clip": cfg.dp_clip if clip is None else clip,
           "epsilon_budget": cfg.dp_epsilon_budget}
    if cfg.dp_clip_quantile:
        out |= {"clip_quantile": cfg.dp_clip_quantile, "count_noise": count_noise(cfg),
                "update_noise_multiplier": update_noise(cfg.dp_noise, count_noise(cfg))}
    return out
