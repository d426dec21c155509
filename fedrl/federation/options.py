"""The settings every federated run has, declared and checked once.

A service run (:class:`fedrl.federation.runconfig.RunConfig`, JSON sent to the aggregator) and an
in-process run (:class:`fedrl.federation.simulate.SimConfig`, ``fedrl simulate``) both extend
:class:`FederationOptions`: an option defined here exists on both paths with the same meaning
and the same check, which the two paths' equivalence (same config and seed, same weights) needs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import ClassVar

from fedrl.algos import ALGOS, BCConfig, DRPOConfig
from fedrl.data.normalize import NORM_CHOICES
from fedrl.federation.choices import AGGREGATIONS, FEDERATE_CHOICES, WEIGHTINGS


@dataclass(frozen=True)
class FederationOptions:
    """What a federated run trains and how its rounds combine the agents' work.

    Subclasses set :attr:`algos` (the algorithms their path can run) and may redeclare a field
    to give it another default. Construction checks every field and raises ``ValueError`` with
    a message that starts with the option's name (:meth:`option_name`).
    """

    algo: str = "drpo"
    """drpo, fed-cql, fed-bc (and, in-process only, cql: each agent alone, no federation)."""
    agents: int = 2
    """How many agents train (each with its own shard); every round selects all of them."""
    rounds: int = 5
    """Communication rounds; the run finishes after the last one closes."""
    local_steps: int = 50
    """Local gradient steps each agent takes per round (paper: 1000)."""
    eval_episodes: int = 10
    """Evaluation episodes of each new global policy (0 = no evaluation)."""
    seed: int = 0
    """Seeds the shards, the initial global policy, every agent's training and the evaluation."""
    env: str | None = None
    """Evaluation env; default: the env the agents' data reports. Set, it must be their task
    (same env and dimensions)."""
    obs_norm: str = "pooled"
    """Observation normalisation: pooled, local or none (see fedrl/data/normalize.py)."""
    weighting: str = "uniform"
    """FedAvg weights: uniform (paper) or samples (by shard size)."""
    aggregation: str = "fedavg"
    """fedavg (paper), median or trimmed-mean (coordinate-wise; robust to a minority of bad agents)."""
    trim_fraction: float = 0.1
    """Share of the largest and of the smallest values dropped per coordinate by trimmed-mean,
    in [0, 0.5)."""
    federate: str = "policy"
    """What is averaged: policy (paper) or policy+critic."""
    dp_clip: float = 0.0
    """Differential privacy (agent-level DP-FedAvg; docs/guides/privacy.md): each agent clips its
    update to this L2 norm before sending it (0 = off; else in [1e-6, 1e6])."""
    dp_noise: float = 0.0
    """The noise multiplier sigma: the round's sum of clipped updates gets Gaussian noise of std
    sigma * dp_clip (0 = clipping alone, no privacy guarantee; else in [1e-3, 1e3])."""
    dp_delta: float = 1e-5
    """The delta at which the privacy spent, epsilon, is reported."""
    dp_epsilon_budget: float = 0.0
    """Stop before a round that would spend more than this epsilon (0 = no budget)."""
    dp_clip_quantile: float = 0.0
    """Adaptive clipping (Andrew et al. 2021): the share of the agents' updates the clipping norm
    should hold, in (0, 1); dp_clip is then the norm's first value (0 = the norm stays dp_clip)."""
    dp_clip_lr: float = 0.2
    """Adaptive clipping's step: each round the norm is multiplied by exp(-lr * (share of the
    updates within it - dp_clip_quantile)), in (0, 10]; the norm stays in [1e-6, 1e6]."""
    dp_count_noise: float = 0.0
    """Adaptive clipping's noise (std) on the count of updates within the norm; it must be above
    dp_noise / 2, in [1e-3, 1e4], and the updates' noise is raised to keep the run's epsilon
    (0 = agents / 20)."""
    secagg_threshold: int = 0
    """Secure aggregation (docs/guides/privacy.md): with t >= 2, every round's average is taken
    under the masks of Bonawitz et al. 2017, so that no single update is seen, and recovered
    while at least t agents answer (0 = off). With dp_noise, each agent adds its share of the
    noise (distributed DP)."""
    drpo: DRPOConfig = field(default_factory=DRPOConfig)
    """DRPO / CQL hyperparameters (defaults: the paper's table)."""
    bc: BCConfig = field(default_factory=BCConfig)
    """Fed-BC hyperparameters."""

    algos: ClassVar[tuple[str, ...]] = ALGOS
    """The algorithms this kind of run accepts."""

    @property
    def own_policies(self) -> bool:
        """Each agent keeps and is judged by its own policy, and nothing is averaged: the ``cql``
        baseline (no federation). Every other algorithm has one global policy."""
        return self.algo == "cql"

    @classmethod
    def option_name(cls, name: str) -> str:
        """How errors name field ``name`` (a JSON field here; a command-line flag in simulate)."""
        return name

    def __post_init__(self) -> None:
        opt = self.option_name
        choices = {"algo": self.algos, "obs_norm": NORM_CHOICES, "weighting": WEIGHTINGS,
                   "aggregation": AGGREGATIONS, "federate": FEDERATE_CHOICES}
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"{opt(name)}: {getattr(self, name)!r} is not one of {', '.join(allowed)}")
        for name, low in (("agents", 1), ("rounds", 1), ("local_steps", 0), ("eval_episodes", 0), ("seed", 0)):
            if getattr(self, name) < low:
                raise ValueError(f"{opt(name)}: must be >= {low}, got {getattr(self, name)}")
        if not 0.0 <= self.trim_fraction < 0.5:  # also refuses NaN
            raise ValueError(f"{opt('trim_fraction')}: must be in [0, 0.5), got {self.trim_fraction}")
        self._check_privacy()
        self._check_secagg()
        if self.federate == "policy+critic" and self.algo == "fed-bc":
            raise ValueError(f"{opt('federate')}: policy+critic needs a critic; fed-bc has none")

    def _check_secagg(self) -> None:
        opt, t = self.option_name, self.secagg_threshold
        if not isinstance(t, int) or isinstance(t, bool) or t < 0 or t == 1:
            raise ValueError(f"{opt('secagg_threshold')}: 0 (off) or an integer >= 2, got {t!r}")
        if not t:
            return
        refused = {"algo": ("cql", "each agent alone shares nothing to aggregate"),
                   "aggregation": (("median", "trimmed-mean"), "it needs the individual updates that secure "
                                   "aggregation hides; each agent checks and clips its own"),
                   "obs_norm": ("local", "the global policy's normaliser would be made from each agent's "
                                "moments in the clear; pooled moments are summed under the masks")}

        for name, (bad, why) in refused.items():
            if getattr(self, name) in ((bad,) if isinstance(bad, str) else bad):
                raise ValueError(f"{opt(name)}: {getattr(self, name)!r} cannot run with "
                                 f"{opt('secagg_threshold')}: {why}")

    def _check_privacy(self) -> None:
        opt = self.option_name
        for name in ("dp_clip", "dp_noise", "dp_epsilon_budget", "dp_clip_quantile", "dp_count_noise"):
            v = getattr(self, name)
            if not (isinstance(v, int | float) and math.isfinite(v) and v >= 0):
                raise ValueError(f"{opt(name)}: must be a finite number >= 0, got {v}")
        if not 0.0 < self.dp_delta < 1.0:
            raise ValueError(f"{opt('dp_delta')}: must be in (0, 1), got {self.dp_delta}")
        if not self.dp_clip_quantile < 1.0:
            raise ValueError(f"{opt('dp_clip_quantile')}: a share in (0, 1) (0: fixed clipping), got "
                             f"{self.dp_clip_quantile}")
        from fedrl.federation.privacy import CLIP_LR_MAX, CLIP_RANGE, COUNT_NOISE_RANGE, NOISE_RANGE

        for name, (low, high) in (("dp_clip", CLIP_RANGE), ("dp_noise", NOISE_RANGE),
                                  ("dp_count_noise", COUNT_NOISE_RANGE)):
            v = getattr(self, name)
            if v and not low <= v <= high:
                raise ValueError(f"{opt(name)}: 0 (off) or in [{low:g}, {high:g}], got {v:g}")
        if not (isinstance(self.dp_clip_lr, int | float) and math.isfinite(self.dp_clip_lr)
                and 0 < self.dp_clip_lr <= CLIP_LR_MAX):
            raise ValueError(f"{opt('dp_clip_lr')}: must be in (0, {CLIP_LR_MAX:g}], got {self.dp_clip_lr}")
        if self.dp_count_noise and not self.dp_clip_quantile:
            raise ValueError(f"{opt('dp_count_noise')}: needs {opt('dp_clip_quantile')} (the count is adaptive "
                             "clipping's)")
        if not self.dp_clip:
            for name in ("dp_noise", "dp_epsilon_budget", "dp_clip_quantile"):
                if getattr(self, name):
                    raise ValueError(f"{opt(name)}: needs {opt('dp_clip')} > 0 (differential privacy clips "
                                     "every update first)")
            return
        if self.dp_epsilon_budget and not self.dp_noise:
            raise ValueError(f"{opt('dp_epsilon_budget')}: without {opt('dp_noise')} every round spends an "
                             "infinite epsilon")
        if self.dp_clip_quantile and self.dp_noise:
            from fedrl.federation.privacy import count_noise, update_noise

            try:
                update_noise(self.dp_noise, count_noise(self))
            except ValueError:
                raise ValueError(f"{opt('dp_count_noise')}: {count_noise(self):g}"
                                 f"{'' if self.dp_count_noise else ' (agents / 20, as it is unset)'} leaves nothing "
                                 f"of {opt('dp_noise')} {self.dp_noise:g} for the updates: set it above "
                                 f"{self.dp_noise / 2:g}") from None
        # what DP-FedAvg's guarantee is computed for: one average of every agent's clipped update
        refused = {"algo": ("cql", "each agent alone shares nothing to privatise"),
                   "aggregation": (("median", "trimmed-mean"), "it reads individual updates; DP's noise is on their average"),
                   "weighting": ("samples", "an agent's weight would scale its sensitivity: use uniform"),
                   "obs_norm": ("local", "each agent's own normaliser would travel in its update, unprivatised")}
        for name, (bad, why) in refused.items():
            if getattr(self, name) in ((bad,) if isinstance(bad, str) else bad):
                raise ValueError(f"{opt(name)}: {getattr(self, name)!r} cannot run with {opt('dp_clip')}: {why}")
