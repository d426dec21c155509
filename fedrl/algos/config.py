"""Algorithm hyperparameters: frozen dataclasses whose defaults are the paper's table.

Source: Yue et al., "Federated Offline Policy Optimization with Dual Regularization",
Table "Hyperparameters". Fields the paper leaves open follow CORL's ``cql.py`` and say so.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Literal

# Settings that can train: Adam's learning rates at most 1 (1e30 was accepted, and every update
# came out NaN); loss weights and the initial temperature at most 10^4; an entropy target within
# +-10^3 nats (an action space of a thousand dimensions at most, as a Join allows).
LR_MAX, WEIGHT_MAX, TARGET_ENTROPY_MAX = 1.0, 1e4, 1e3

QScale = Literal["raw", "normalized"]
TargetAction = Literal["sample", "mean"]
CQLCalibration = Literal["none", "returns", "returns-gradient"]
CALIBRATIONS = ("none", "returns", "returns-gradient")
BCLoss = Literal["nll", "mse"]


@dataclass(frozen=True)
class DRPOConfig:
    """DRPO local update (CQL critic + doubly regularised actor). CQL is lambda1 = lambda2 = 0."""

    hidden: tuple[int, ...] = (256, 256)
    """Hidden layer widths of the policy and of each critic (paper: MLP 2 x 256, ReLU)."""
    actor_lr: float = 3e-5
    """Adam learning rate of the policy (paper: 3e-5)."""
    critic_lr: float = 3e-4
    """Adam learning rate of the twin critic (paper: 3e-4)."""
    alpha_lr: float = 3e-4
    """Adam learning rate of the entropy temperature (not in the paper): SAC's own rate. Adam moves
    log alpha by at most about its rate per step, so the rate bounds how far the temperature can
    travel in the paper's 20,000 local steps per agent: at CORL's 3e-5 (the actor's rate; CORL trains
    1M steps) at most 0.6, and on hopper-medium it was still falling in a straight line at 20,000
    steps; at 3e-4 it found its level (near 0.36 from 1.0) within 6,000 and then tracked it
    (``python -m benchmarks.studies.reference``; docs/explanation/choices.md; ``tests/unit/test_temperature.py``)."""
    gamma: float = 0.99
    """Discount factor (paper: 0.99)."""
    batch_size: int = 256
    """Transitions per gradient step (paper: 256)."""
    lambda1: float = 0.1
    """Weight of D(pi, pi_b) = E_D[-log pi(a|s)], cloning the local data (paper: 0.1)."""
    lambda2: float = 0.2
    """Weight of D(pi, pi_bar) = E_{s~D, a~pi_bar}[-log pi(a|s)], staying near the global policy (paper: 0.2)."""
    cql_weight: float = 10.0
    """beta, the CQL(H) penalty weight on each critic (paper: 10)."""
    td_weight: float = 2.0
    """Multiplies each critic's TD term 1/2 E[(Q - y)^2]. 2 (the default) is the full MSE that CORL's
    CQL (which the authors' code modifies) and d3rlpy's use: under Adam, eq. (cql)'s 1/2 with beta = 10
    behaves as the full MSE with beta = 20, twice as conservative as the references. With 1, Q on the
    data rises and then falls over long training while the TD error grows; with 2 it tracks d3rlpy
    (``python -m benchmarks.studies.reference``; docs/explanation/choices.md)."""
    cql_n_actions: int = 10
    """Sampled actions of each kind (uniform, pi(s), pi(s')) in the CQL(H) log-sum-exp (CORL: 10)."""
    tau: float = 5e-3
    """Polyak rate of the target critics, applied every step (CORL: 5e-3)."""
    auto_alpha: bool = True
    """Tune the SAC entropy temperature towards ``target_entropy`` (CORL: on)."""
    alpha_init: float = 1.0
    """Initial (or, with ``auto_alpha=False``, fixed) entropy temperature; 0 removes the entropy term."""
    target_entropy: float | None = None
    """Entropy target of the temperature tuning; ``None`` means -|A| (CORL's choice)."""
    target_action: TargetAction = "sample"
    """The next action in the TD target: ``sample`` a' ~ pi(.|s') (eq. cql, CORL) or ``mean``, the
    policy's deterministic action tanh(mu(s')) (d3rlpy's CQL without soft backup). Kept to explain
    the measured gap to d3rlpy (docs/explanation/choices.md)."""
    backup_entropy: bool = False
    """Subtract alpha * log pi(a'|s') in the TD target (CORL: off)."""
    cql_calibration: CQLCalibration = "returns-gradient"
    """How the CQL(H) penalty treats the policy's sampled actions, against G(s), the data's
    discounted return-to-go from s. ``returns-gradient`` (the default): each keeps its own value
    in the log-sum-exp, but no gradient pushes one valued below G(s) further down, so the penalty
    still pushes down the uniform actions and the policy's actions valued above what the data
    earned. ``returns``: Cal-QL's calibration (Nakamoto et al. 2023), the value itself lifted to
    max(Q(s, a), G(s)). ``none``: CQL(H) as written in the paper. Measured
    (docs/explanation/choices.md): ``none`` sinks Q on the data below zero on walker2d-medium;
    ``returns`` silences the push-down while Q is far below G and hopper-medium's policy fell at
    once; ``returns-gradient`` kept Q on the data rising towards the data's returns on both
    (walker2d's returns were lower than ``none``'s over the five rounds measured, hopper's higher).
    The default by returns: at the paper's per-agent budget on hopper-medium (three seeds, the
    verdict preset) ``returns-gradient`` scored above ``none`` over the last rounds."""
    q_scale: QScale = "raw"
    """How the actor's Q term enters L_pi. ``raw``: -Q exactly as eq. (local_updating_pi) is written.
    ``normalized``: -(q_norm / mean|Q|) * Q with mean|Q| detached (FEDORA / TD3+BC), which keeps the
    O(1) NLL regularisers relevant when Q is in the hundreds. See docs/explanation/choices.md."""
    q_norm: float = 2.5
    """Target magnitude of the Q term under ``q_scale='normalized'`` (FEDORA/TD3+BC: 2.5)."""
    global_samples: int = 1
    """Actions drawn from the frozen global policy per state for D(pi, pi_bar)."""
    log_std_min: float = -5.0
    """Lower clamp of the policy's log standard deviation."""
    log_std_max: float = 2.0
    """Upper clamp of the policy's log standard deviation."""
    action_clip_eps: float = 1e-6
    """Dataset actions are clipped to [-1+eps, 1-eps] before atanh in log pi(a|s)."""
    reset_actor_optimizer: bool = True
    """Start each round with fresh Adam moments for the policy (its weights were just replaced by
    pi_bar). Critic and temperature optimisers always persist, like the critics themselves."""

    def __post_init__(self) -> None:
        _check_types(self)
        _check_positive(self, "actor_lr", "critic_lr", "alpha_lr", "batch_size", "cql_n_actions",
                        "global_samples", "q_norm", "td_weight")
        _check_nonnegative(self, "lambda1", "lambda2", "cql_weight", "alpha_init")
        _check_at_most(self, LR_MAX, "actor_lr", "critic_lr", "alpha_lr")
        _check_at_most(self, WEIGHT_MAX, "lambda1", "lambda2", "cql_weight", "td_weight", "alpha_init", "q_norm")
        if self.target_entropy is not None and not abs(self.target_entropy) <= TARGET_ENTROPY_MAX:
            raise ValueError(f"target_entropy must be in [-{TARGET_ENTROPY_MAX:g}, {TARGET_ENTROPY_MAX:g}], "
                             f"got {self.target_entropy}")
        if not 0.0 <= self.gamma <= 1.0:
            raise ValueError(f"gamma must be in [0, 1], got {self.gamma}")
        if not 0.0 < self.tau <= 1.0:
            raise ValueError(f"tau must be in (0, 1], got {self.tau}")
        if self.target_action not in ("sample", "mean"):
            raise ValueError(f"target_action must be 'sample' or 'mean', got {self.target_action!r}")
        if self.cql_calibration not in CALIBRATIONS:
            raise ValueError(f"cql_calibration must be one of {', '.join(map(repr, CALIBRATIONS))}, "
                             f"got {self.cql_calibration!r}")
        if self.q_scale not in ("raw", "normalized"):
            raise ValueError(f"q_scale must be 'raw' or 'normalized', got {self.q_scale!r}")
        _check_policy(self)


@dataclass(frozen=True)
class BCConfig:
    """Behaviour cloning (the Fed-BC baseline's local update)."""

    hidden: tuple[int, ...] = (256, 256)
    """Hidden layer widths of the policy (same network as DRPO's)."""
    lr: float = 3e-5
    """Adam learning rate: DRPO's actor rate, as the paper trains "all algorithms with the same
    learning rate". 3e-4 (the usual BC rate) is the named variant ``fed-bc`` at ``--bc-lr 3e-4``."""
    batch_size: int = 256
    """Transitions per gradient step."""
    loss: BCLoss = "nll"
    """``nll``: -log pi(a|s) of the tanh-Gaussian policy (the same term as DRPO's D(pi, pi_b));
    ``mse``: squared error of the deterministic action tanh(mu(s))."""
    log_std_min: float = -5.0
    """Lower clamp of the policy's log standard deviation."""
    log_std_max: float = 2.0
    """Upper clamp of the policy's log standard deviation."""
    action_clip_eps: float = 1e-6
    """Dataset actions are clipped to [-1+eps, 1-eps] before atanh in log pi(a|s)."""
    reset_actor_optimizer: bool = True
    """Start each round with fresh Adam moments (the weights were just replaced by pi_bar)."""

    def __post_init__(self) -> None:
        _check_types(self)
        _check_positive(self, "lr", "batch_size")
        _check_at_most(self, LR_MAX, "lr")
        if self.loss not in ("nll", "mse"):
            raise ValueError(f"loss must be 'nll' or 'mse', got {self.loss!r}")
        _check_policy(self)


def cql_config(base: DRPOConfig | None = None) -> DRPOConfig:
    """CQL is DRPO without its two regularisers (lambda1 = lambda2 = 0)."""
    return dataclasses.replace(base or DRPOConfig(), lambda1=0.0, lambda2=0.0)


def config_to_dict(cfg: Any) -> dict[str, Any]:
    """JSON-ready dict of a config dataclass (saved beside every result and checkpoint)."""
    return {f.name: (list(v) if isinstance(v := getattr(cfg, f.name), tuple) else v)
            for f in dataclasses.fields(cfg)}


def _check_types(cfg: Any) -> None:
    """Every field has its declared type: ``bool`` fields a bool, ``int`` fields an integer (not a
    bool), ``float`` fields a finite number (``float | None``: or None), string fields a string,
    ``hidden`` a sequence of integers; a ValueError names the field."""
    for f in dataclasses.fields(cfg):
        v, kind = getattr(cfg, f.name), str(f.type)
        is_num = isinstance(v, int | float) and not isinstance(v, bool)
        if kind == "bool":
            ok = isinstance(v, bool)
        elif kind == "int":
            ok = isinstance(v, int) and not isinstance(v, bool)
        elif kind.startswith("float"):
            ok = (v is None and "None" in kind) or (is_num and math.isfinite(v))
        elif kind == "tuple[int, ...]":
            ok = isinstance(v, tuple | list) and all(isinstance(x, int) and not isinstance(x, bool) for x in v)
        else:  # Literal aliases: strings, checked against their choices by each config
            ok = isinstance(v, str)
        if not ok:
            raise ValueError(f"{f.name}: expected {kind.replace('tuple[int, ...]', 'a list of integers')}"
                             f"{' (finite)' if kind.startswith('float') else ''}, got {v!r}")


def _check_policy(cfg: Any) -> None:
    """What the policy network needs: positive layer widths, a log-std range, an action clip."""
    if not cfg.hidden or any(int(h) <= 0 for h in cfg.hidden):
        raise ValueError(f"hidden must be positive layer widths, got {cfg.hidden}")
    object.__setattr__(cfg, "hidden", tuple(int(h) for h in cfg.hidden))
    if not cfg.log_std_min < cfg.log_std_max:
        raise ValueError(f"log_std_min ({cfg.log_std_min}) must be below log_std_max ({cfg.log_std_max})")
    if not 0.0 < cfg.action_clip_eps < 0.5:
        raise ValueError(f"action_clip_eps must be in (0, 0.5), got {cfg.action_clip_eps}")


def _check_positive(cfg: Any, *names: str) -> None:
    for n in names:
        if not getattr(cfg, n) > 0:
            raise ValueError(f"{n} must be > 0, got {getattr(cfg, n)}")


def _check_at_most(cfg: Any, top: float, *names: str) -> None:
    for n in names:
        if not getattr(cfg, n) <= top:
            raise ValueError(f"{n} must be at most {top:g}, got {getattr(cfg, n)}")


def _check_nonnegative(cfg: Any, *names: str) -> None:
    for n in names:
        if not getattr(cfg, n) >= 0:
            raise ValueError(f"{n} must be >= 0, got {getattr(cfg, n)}")


__all__ = ["DRPOConfig", "BCConfig", "cql_config", "config_to_dict"]
