"""The settings of one in-process federated run (``fedrl simulate``, the benchmarks' cells): the
options it shares with the services (:class:`~fedrl.federation.options.FederationOptions`, here
with the paper's scale as defaults) and its own, and how they are read from JSON."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from fedrl.algos.config import config_to_dict
from fedrl.federation.options import FederationOptions

# how `fedrl simulate` trains its agents (simulate.py)
ENGINES = ("auto", "batched", "per-agent")

DEFAULT_DATASET = "hopper-random-v2"


@dataclass(frozen=True)
class SimConfig(FederationOptions):
    """One in-process federated run: the options it shares with the services
    (:class:`FederationOptions`, here with the paper's scale as defaults) and its own."""

    agents: int = 10
    """Agents per dataset given without ``:N`` (paper: 10)."""
    rounds: int = 20
    """Communication rounds (paper: converges within ~20)."""
    local_steps: int = 1000
    """Local gradient steps per round (paper: 1000)."""
    datasets: tuple[str, ...] = (DEFAULT_DATASET,)
    """Dataset paths or names; ``PATH:N`` gives N agents to that file (heterogeneous mixes)."""
    trajectories: int = 5
    """Whole trajectories per agent (paper: 5)."""
    transitions: int = 0
    """With > 0, each agent also takes further whole trajectories until it holds at least this many
    transitions (the paper's agents hold ~5,000: 5 trajectories of ~1,000 steps)."""
    eval_every: int = 1
    """Evaluate every this many rounds (the last round is always evaluated)."""
    final_eval_episodes: int = 0
    """With > 0, the final policy is evaluated once more with this many episodes (their own seed),
    reported as the summary's ``final_long`` (0: not)."""
    grad_norms_every: int = 0
    """With > 0, DRPO/CQL agents measure the actor's gradient norm from each of its terms on every
    this many-th local step (either engine; the training is unchanged; 0: never)."""
    device: str = "auto"
    """auto (CUDA when present), cpu, cuda or cuda:N."""

    # the fields ``fedrl simulate`` has a flag of their own for; the rest are set with --set or --config
    FLAGGED = ("algo", "agents", "trajectories", "transitions", "rounds", "local_steps", "eval_episodes",
               "eval_every", "seed", "device", "obs_norm", "weighting", "federate", "aggregation", "trim_fraction",
               "secagg_threshold", "env")

    @classmethod
    def option_name(cls, name: str) -> str:
        """How an error names field ``name``: its flag, or the --set key that sets it."""
        return "--" + name.replace("_", "-") if name in cls.FLAGGED else f"--set {name}"

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("final_eval_episodes", "grad_norms_every"):
            if getattr(self, name) < 0:
                raise ValueError(f"{self.option_name(name)}: must be >= 0, got {getattr(self, name)}")
        for name in ("trajectories", "eval_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"{self.option_name(name)}: must be >= 1, got {getattr(self, name)}")
        if self.transitions < 0:
            raise ValueError(f"--transitions: must be >= 0, got {self.transitions}")
        if not self.datasets:
            raise ValueError("at least one --dataset is needed")

    def as_dict(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        d["datasets"] = list(self.datasets)
        d["drpo"], d["bc"] = config_to_dict(self.drpo), config_to_dict(self.bc)
        return d


def parse_sim_config(data: dict[str, Any]) -> SimConfig:
    """A :class:`SimConfig` from a JSON object of its fields (``drpo`` and ``bc`` objects of
    :class:`DRPOConfig`'s and :class:`BCConfig`'s fields): ``fedrl simulate --config/--set``.
    Raises ``ValueError`` naming the field: an unknown one, a wrong type, a value out of range."""
    from fedrl.algos import BCConfig, DRPOConfig
    from fedrl.federation.runconfig import _sub_config

    if not isinstance(data, dict):
        raise ValueError(f"settings must be a JSON object, got {type(data).__name__}")
    data = dict(data)
    nested = {k: _sub_config(cls, data.pop(k), k) for k, cls in (("drpo", DRPOConfig), ("bc", BCConfig)) if k in data}
    if "datasets" in data:
        ds = data.pop("datasets")
        if isinstance(ds, str):
            ds = [ds]
        if not isinstance(ds, list) or not ds or not all(isinstance(d, str) and d for d in ds):
            raise ValueError(f"datasets: expected a list of dataset names or paths, got {ds!r}")
        nested["datasets"] = tuple(ds)
    if "env" in data and data["env"] is not None and not isinstance(data["env"], str):
        raise ValueError(f"env: expected a string, got {data['env']!r}")
    top = {k: data.pop(k) for k in ("env",) if k in data}
    try:
        base = _sub_config(SimConfig, data, "settings")
        return dataclasses.replace(base, **top, **nested)
    except ValueError as e:
        raise ValueError(str(e).removeprefix("settings.").removeprefix("settings: ")) from None
