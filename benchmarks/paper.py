"""Reproduce the paper's experiments: one command per experiment, resumable, results as JSON.

    python -m benchmarks.paper run    --preset reduced [--experiment table] [--seeds 0,1,2]
    python -m benchmarks.paper status --preset reduced
    python -m benchmarks.paper render --preset reduced      (tables + plots, updates BENCHMARKS.md)

Every run is the in-process federation (``fedrl.federation.simulate``: the same round logic as
the services) with one torch thread, so a rerun on the same machine reproduces its numbers. A
finished run writes ``benchmarks/results/paper-<preset>/<experiment>/<run>.json``; ``run``
skips runs whose file exists, and every run checkpoints each round under ``runs/paper-<preset>/``,
so an interrupted job resumes after the last round it finished. A run whose configuration equals a finished run of another experiment (the
studies' point at the table's setting) is copied from it, marked ``reused_from``. ``--jobs N``
runs N cells at once, one process each. ``render`` reads only those files.

Experiments (``ALGORITHM.md``; the paper's Table 1, Figures 2-4):
  table         Fed-BC, Fed-CQL, CQL (agents alone), DRPO on Hopper medium, medium-replay, expert
  agents        DRPO vs Fed-CQL with 1..20 agents (Hopper medium)
  trajectories  DRPO vs Fed-CQL with 1..20 trajectories per agent
  local_steps   DRPO with 10..1000 local steps per round
  lambdas       DRPO's lambda1 sweep (lambda2 = 1) and lambda2 sweep (lambda1 = 0.1), 0..20, with
                heterogeneous agents (4 expert + 1 medium), as the paper's section 5.3
  q_scale       DRPO with the Q term normalised (q_scale=normalized) on the table's datasets; the
                table's DRPO column is the raw Q term (the paper's equation, the default)
  q_scale_long  raw vs normalised Q term (and Fed-CQL, no regularisers; Fed-BC) with long local training
                (few agents, the paper's 1000 local steps): the regime where Q reaches the hundreds
                and the choice matters (issue: the Q-scale default defended by measurement)

Presets: ``paper`` (the paper's scale: 10 agents x 5 trajectories, 1000 local steps, 20 rounds,
5 seeds; for GPUs), ``reduced`` (5 agents x 5 trajectories, 50 local steps, 20 rounds, 3 seeds,
the paper's networks and hyperparameters: about 4 hours for the table on one core of this CPU), ``smoke`` (toy sizes, a minute: what the tests rerun).
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.common import BENCHMARKS_MD, RESULTS, code_revision, device_name, replace_blocks
ALGO_ORDER = ("fed-bc", "fed-cql", "cql", "drpo")
ALGO_LABEL = {"fed-bc": "Fed-BC", "fed-cql": "Fed-CQL", "cql": "CQL (alone)", "drpo": "DRPO",
              "fed-bc-3e-4": "Fed-BC at lr 3e-4", "drpo-returns-gradient": "DRPO, penalty's gradient stopped at G"}
# Named variants of a method: a table column of its own (key -> (algorithm, {"bc"/"drpo": overrides}))
VARIANTS = {"fed-bc-3e-4": ("fed-bc", {"bc": {"lr": 3e-4}}),
            "drpo-returns-gradient": ("drpo", {"drpo": {"cql_calibration": "returns-gradient"}})}
EXPERIMENTS = ("table", "agents", "trajectories", "local_steps", "lambdas", "q_scale", "q_scale_long")


@dataclass(frozen=True)
class Preset:
    name: str
    agents: int
    trajectories: int
    local_steps: int
    rounds: int
    eval_episodes: int
    eval_every: int
    seeds: tuple[int, ...]
    datasets: tuple[str, ...] = ("hopper-medium-v2", "hopper-medium-replay-v2", "hopper-expert-v2")
    study_dataset: str = "hopper-medium-v2"
    drpo: dict[str, Any] = field(default_factory=dict)
    bc: dict[str, Any] = field(default_factory=dict)
    agents_grid: tuple[int, ...] = (1, 2, 5, 10, 20)
    trajectories_grid: tuple[int, ...] = (1, 2, 5, 10, 20)
    local_steps_grid: tuple[int, ...] = (10, 50, 100, 200, 1000)
    # lambdas: the paper's two sweeps (section 5.3): lambda1 over these values with lambda2 fixed,
    # then lambda2 over them with lambda1 fixed (defaults: 0..20 around lambda2=1, lambda1=0.1)
    lambda_values: tuple[float, ...] = (0.0, 0.1, 1.0, 5.0, 20.0)
    lambda_fixed: tuple[float, float] = (0.1, 1.0)  # (lambda1 in the lambda2 sweep, lambda2 in the lambda1 sweep)
    # q_scale_long: (agents, local steps, rounds, evaluate every) of the long-training runs
    long: tuple[int, int, int, int] = (2, 1000, 10, 2)
    transitions: int = 0  # with > 0, agents take whole trajectories until they hold this many transitions
    lambda_sweeps: tuple[str, ...] = ("lambda1", "lambda2")  # which of the two sweeps ``lambdas`` runs
    # the table's methods in the order they run (a cell's seeds before the next dataset when
    # ``dataset_first``): the head-to-head first, so the first answer comes early
    methods: tuple[str, ...] = ALGO_ORDER
    dataset_first: bool = False
    # the experiments this preset is meant to run (None: all); ``run --experiment all`` runs
    # these and ``status`` marks the others as outside the plan
    planned: tuple[str, ...] | None = None
    # other presets whose finished runs a run here copies when they are the same computation
    # (:func:`find_identical`): a rerun at new DRPO defaults need not train Fed-BC again
    reuse_from: tuple[str, ...] = ()
    final_episodes: int = 0  # > 0: the final policy evaluated again with this many episodes
    grad_norms_every: int = 0  # > 0: the actor's gradient norm from each term, every this many local steps


PRESETS = {
    "paper": Preset("paper", 10, 5, 1000, 20, 10, 1, (0, 1, 2, 3, 4)),
    "reduced": Preset("reduced", 5, 5, 50, 20, 5, 2, (0, 1, 2),
                      local_steps_grid=(10, 25, 50, 100)),
    # the table on the project's HalfCheetah-v5 data (same scale as reduced; studies stay Hopper's)
    "reduced-halfcheetah": Preset("reduced-halfcheetah", 5, 5, 50, 20, 5, 2, (0, 1, 2),
                                  datasets=("halfcheetah-medium-v2", "halfcheetah-medium-replay-v2",
                                            "halfcheetah-expert-v2"),
                                  study_dataset="halfcheetah-medium-v2"),
    # The claim preset's hopper-medium column at the defaults chosen on 2026-11-27 (the temperature
    # at 3e-4, the CQL penalty's gradient stopped at the data's return-to-go): its own folder, so
    # the earlier claim's results keep their settings beside it
    "claim-v2": Preset("claim-v2", 5, 5, 1000, 10, 10, 1, (0, 1, 2), datasets=("hopper-medium-v2",),
                       transitions=5000, methods=("drpo", "fed-cql", "cql", "fed-bc"), planned=("table",),
                       reuse_from=("claim",)),
    # The verdict at the paper's per-agent budget (issue 68): the claim-v2 column at the paper's 20
    # rounds x 1,000 local steps (20,000 actor steps per agent), the critic as the paper writes it
    # (CQL(H), eq. cql) with the temperature at 3e-4, today's default critic as the named variant
    # drpo-returns-gradient; every setting a default change could move is written out. The final
    # policy is evaluated again over 50 episodes; the actor's per-term gradient norms every 50 steps.
    "verdict": Preset("verdict", 5, 5, 1000, 20, 10, 1, (0, 1, 2), datasets=("hopper-medium-v2",),
                      transitions=5000, methods=("drpo", "drpo-returns-gradient", "fed-cql", "cql", "fed-bc"),
                      drpo={"cql_calibration": "none", "alpha_lr": 3e-4, "td_weight": 2.0}, planned=("table",),
                      final_episodes=50, grad_norms_every=50),
    # The claim at a scale that can show it (issue: 10k actor steps per agent, three seeds): the
    # paper's 1,000 local steps per round, agents holding the paper's ~5,000 transitions each
    # (whole hopper-medium episodes: ~20 of them), 10 rounds; every round checkpointed.
    "claim": Preset("claim", 5, 5, 1000, 10, 10, 1, (0, 1, 2),
                    datasets=("hopper-medium-v2", "hopper-medium-replay-v2"), transitions=5000,
                    lambda_values=(0.0, 0.2, 1.0, 5.0), lambda_fixed=(0.1, 1.0), lambda_sweeps=("lambda2",),
                    methods=("drpo", "fed-cql", "cql", "fed-bc", "fed-bc-3e-4"), dataset_first=True,
                    planned=("table", "lambdas")),
    # The paper's Ant-v5 rows at the paper's scale (the sets come from the shipped Ant behaviour
    # policies, fedrl/behavior/checkpoints/ant)
    "ant": Preset("ant", 10, 5, 1000, 20, 10, 1, (0, 1, 2, 3, 4),
                  datasets=("ant-medium-v2", "ant-medium-replay-v2", "ant-expert-v2"),
                  study_dataset="ant-medium-v2", planned=("table",)),
    # the smoke scale on Ant-v5's random set (which needs no behaviour policy): the harness knows Ant
    "smoke-ant": Preset("smoke-ant", 2, 2, 5, 2, 1, 1, (0,), datasets=("ant-random-v2",),
                        study_dataset="ant-random-v2",
                        drpo={"hidden": [32, 32], "batch_size": 32, "cql_n_actions": 2},
                        bc={"hidden": [32, 32], "batch_size": 32}, planned=("table",)),
    "smoke": Preset("smoke", 2, 2, 5, 2, 2, 1, (0,), datasets=("hopper-medium-v2",),
                    drpo={"hidden": [32, 32], "batch_size": 32, "cql_n_actions": 2},
                    bc={"hidden": [32, 32], "batch_size": 32},
                    agents_grid=(1, 2), trajectories_grid=(1, 2), local_steps_grid=(2, 5), lambda_values=(0.0, 1.0),
                    long=(2, 10, 2, 1)),
}


@dataclass(frozen=True)
class RunSpec:
    experiment: str
    key: str  # file name under the experiment folder
    algo: str
    datasets: tuple[str, ...]
    seed: int
    agents: int
    trajectories: int
    local_steps: int
    variant: dict[str, Any] = field(default_factory=dict)  # what the study varies
    drpo: dict[str, Any] = field(default_factory=dict)
    bc: dict[str, Any] = field(default_factory=dict)
    rounds: int | None = None  # None: the preset's
    eval_every: int | None = None


def short(dataset: str) -> str:
    """``hopper-medium-replay-v2`` -> ``medium-replay`` (a preset's datasets share one env)."""
    return dataset.split("-", 1)[-1].removesuffix("-v2")


def env_prefix(dataset: str) -> str:
    return dataset.split("-", 1)[0]


def plan(p: Preset, experiment: str, seeds: tuple[int, ...]) -> list[RunSpec]:
    runs: list[RunSpec] = []
    base = dict(agents=p.agents, trajectories=p.trajectories, local_steps=p.local_steps)
    for s in seeds:
        if experiment == "table":
            for d in p.datasets:
                for m in p.methods:
                    a, over = VARIANTS.get(m, (m, {}))
                    runs.append(RunSpec("table", f"{m}-{short(d)}-s{s}", a, (d,), s, **base, bc=over.get("bc", {}),
                                        drpo=over.get("drpo", {}),
                                        variant={"dataset": short(d), **({"method": m} if m != a else {})}))
        elif experiment in ("agents", "trajectories"):
            grid = p.agents_grid if experiment == "agents" else p.trajectories_grid
            for n in grid:
                for a in ("drpo", "fed-cql"):
                    kw = {**base, experiment: n}
                    runs.append(RunSpec(experiment, f"{a}-{experiment}{n}-s{s}", a, (p.study_dataset,), s, **kw,
                                        variant={experiment: n}))
        elif experiment == "local_steps":
            for n in p.local_steps_grid:
                runs.append(RunSpec(experiment, f"drpo-steps{n}-s{s}", "drpo", (p.study_dataset,), s,
                                    **{**base, "local_steps": n}, variant={"local_steps": n}))
        elif experiment == "lambdas":
            n_exp = max(1, p.agents - 1)
            mix = (f"{env_prefix(p.study_dataset)}-expert-v2:{n_exp}", f"{p.study_dataset}:{p.agents - n_exp}")
            fix1, fix2 = p.lambda_fixed
            pairs = ([(v, fix2) for v in p.lambda_values] if "lambda1" in p.lambda_sweeps else []) + \
                    ([(fix1, v) for v in p.lambda_values] if "lambda2" in p.lambda_sweeps else [])
            for l1, l2 in dict.fromkeys(pairs):
                runs.append(RunSpec(experiment, f"drpo-l1_{l1}-l2_{l2}-s{s}", "drpo", mix, s, **base,
                                    variant={"lambda1": l1, "lambda2": l2},
                                    drpo={"lambda1": l1, "lambda2": l2}))
            runs.append(RunSpec(experiment, f"fed-bc-s{s}", "fed-bc", mix, s, **base,
                                variant={"reference": "fed-bc"}))  # what cloning the same agents gives
        elif experiment == "q_scale":
            for d in p.datasets:
                runs.append(RunSpec(experiment, f"drpo-normalized-{short(d)}-s{s}", "drpo", (d,), s, **base,
                                    variant={"dataset": short(d), "q_scale": "normalized"},
                                    drpo={"q_scale": "normalized"}))
        elif experiment == "q_scale_long":
            n_agents, steps, rounds, every = p.long
            kw = dict(agents=n_agents, trajectories=p.trajectories, local_steps=steps, rounds=rounds,
                      eval_every=every)
            for a, q in (("drpo", "raw"), ("drpo", "normalized"), ("fed-cql", None), ("fed-bc", None)):
                name = f"{a}-{q}" if q else a
                none = "none (no regularisers)" if a == "fed-cql" else "none (behaviour cloning)"
                runs.append(RunSpec(experiment, f"{name}-s{s}", a, (p.study_dataset,), s, **kw,
                                    variant={"q_scale": q or none},
                                    drpo={"q_scale": q} if q else {}))
        else:
            raise ValueError(f"unknown experiment {experiment!r}; choose from {', '.join(EXPERIMENTS)}")
    if experiment == "table" and p.dataset_first:  # every seed of a dataset before the next dataset
        runs.sort(key=lambda r: (p.datasets.index(r.datasets[0]), r.seed))
    return runs


def result_path(p: Preset, r: RunSpec, root: Path = RESULTS) -> Path:
    return Path(root) / f"paper-{p.name}" / r.experiment / f"{r.key}.json"


def sim_config(p: Preset, r: RunSpec, device: str = "cpu"):
    from fedrl.algos import BCConfig, DRPOConfig
    from fedrl.federation.simulate import SimConfig

    def cfg(cls, d):
        d = {k: tuple(v) if isinstance(v, list) else v for k, v in d.items()}
        return cls(**d)

    return SimConfig(algo=r.algo, datasets=r.datasets, agents=r.agents, trajectories=r.trajectories,
                     transitions=p.transitions,
                     rounds=r.rounds or p.rounds, local_steps=r.local_steps, eval_episodes=p.eval_episodes,
                     eval_every=r.eval_every or p.eval_every, seed=r.seed, device=device,
                     final_eval_episodes=p.final_episodes, grad_norms_every=p.grad_norms_every,
                     drpo=cfg(DRPOConfig, {**p.drpo, **r.drpo}), bc=cfg(BCConfig, {**p.bc, **r.bc}))


def _write_result(p: Preset, r: RunSpec, res: dict[str, Any], root: Path) -> dict[str, Any]:
    """Write a run's result atomically (a run cut in the middle leaves no file)."""
    path = result_path(p, r, root)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(res, indent=1))
    tmp.replace(path)
    return res


def execute(p: Preset, r: RunSpec, root: Path = RESULTS, agent_threads: int = 1,
            device: str = "cpu") -> dict[str, Any]:
    """Run one experiment cell on ``device`` (recorded in its config); write and return its result."""
    import torch

    from fedrl.federation.simulate import run as simulate

    torch.set_num_threads(1)  # reproducible numbers, and one core left for the rest
    revision = code_revision()  # before the run: the code this process loaded, not later edits
    cfg = sim_config(p, r, device)
    t0 = time.perf_counter()
    work = work_dir(p, r, root)  # checkpointed every round: a stopped run resumes after its last round
    work.mkdir(parents=True, exist_ok=True)
    resumed_from = _rounds_done(work)
    summary = simulate(cfg, work, log=lambda m: _progress(work, m), checkpoint=True, parallel_agents=agent_threads)
    losses = round_losses(work / "rounds.jsonl")
    out = {"preset": p.name, "experiment": r.experiment, "key": r.key, "algo": r.algo, "datasets": list(r.datasets),
           "seed": r.seed, "agents": r.agents, "trajectories": r.trajectories, "local_steps": r.local_steps,
           "rounds": cfg.rounds, "variant": r.variant, "config": cfg.as_dict(),
           "curve": summary["curve"], "final": summary["final"], "losses_per_round": losses,
           **({"final_long": summary["final_long"]} if "final_long" in summary else {}),
           "wall_seconds": round(time.perf_counter() - t0, 1), "code_revision": revision,
           "device_name": device_name(cfg.device), "torch": torch.__version__,
           "shards": json.loads((work / "config.json").read_text())["shards"]}
    if resumed_from:
        out["resumed_after_round"] = resumed_from  # wall_seconds then counts only this process's rounds
    res = _write_result(p, r, out, root)
    shutil.rmtree(work, ignore_errors=True)
    return res


def round_losses(rounds_jsonl: Path) -> dict[str, list[float]]:
    """Per loss, its mean over agents of each round's mean, from a run's ``rounds.jsonl``."""
    losses: dict[str, list[float]] = {}
    for line in rounds_jsonl.read_text().splitlines():
        rec = json.loads(line)
        for k in rec["agents"][0]:
            if k not in ("agent", "num_samples", "seconds"):
                losses.setdefault(k, []).append(float(np.mean([a[k] for a in rec["agents"]])))
    return losses


def cell_result(p, spec, cell, res: dict, wall: float, device: str) -> dict:
    """A finished cell in ``benchmarks.paper``'s result format."""
    import torch

    return {"preset": p.name, "experiment": spec.experiment, "key": spec.key, "algo": spec.algo,
            "datasets": list(spec.datasets), "seed": spec.seed, "agents": spec.agents,
            "trajectories": spec.trajectories, "local_steps": spec.local_steps, "rounds": cell.cfg.rounds,
            "variant": spec.variant, "config": cell.cfg.as_dict(), "curve": res["curve"], "final": res["final"],
            "losses_per_round": round_losses(res["rounds_jsonl"]), "wall_seconds": round(wall, 1),
            "code_revision": code_revision(), "device_name": device_name(device), "torch": torch.__version__,
            "shards": res["shards"], "engine": "batched cells (benchmarks.device_paper)"}


def work_dir(p: Preset, r: RunSpec, root: Path = RESULTS) -> Path:
    """Where a run in progress keeps its rounds and checkpoint (not committed: ``runs/`` is ignored;
    beside the results when they live elsewhere, as in the tests)."""
    base = Path(root).resolve().parent.parent / "runs" if Path(root).resolve() == RESULTS else Path(root) / ".work"
    return base / f"paper-{p.name}" / r.experiment / r.key


def _rounds_done(work: Path) -> int:
    """Rounds a run in progress has checkpointed (0: none)."""
    ck = work / "checkpoint.safetensors"
    if not ck.exists():
        return 0
    from safetensors import safe_open

    with safe_open(str(ck), "pt") as f:
        return int(json.loads(f.metadata()["fedrl_checkpoint"])["round"])


def _agents_in_round(work: Path, r: int) -> int:
    """Agents of round ``r`` that a stopped run has trained, each kept in its own file (a resumed
    run does not train them again); files of another round are spent."""
    from safetensors import safe_open

    from fedrl.federation.checkpoint import AGENTS_IN_ROUND

    n = 0
    for path in (work / AGENTS_IN_ROUND).glob("agent-*.safetensors"):
        with safe_open(str(path), "pt") as f:
            n += json.loads(f.metadata()["fedrl_checkpoint"])["round"] == r
    return n


_AGENT_DONE = re.compile(r"round \d+: agent \d+/\d+ done in ([0-9.]+)s$")
_ROUND_DONE = re.compile(r"round +\d+/\d+ .*\[([0-9.]+)s\]$")


def _minutes_left(work: Path, agents_left: int, agents: int) -> float | None:
    """Minutes a run in progress has left: its agents still to train, at the median pace of its
    last ``agents`` trained (from ``progress.log``; runs of under 200 local steps log no agent
    lines, so their last round's time shared among its agents); None before the first."""
    try:
        lines = (work / "progress.log").read_text().splitlines()
    except OSError:
        return None
    took = [float(m.group(1)) for line in lines if (m := _AGENT_DONE.search(line))][-agents:]
    if not took:
        took = [float(m.group(1)) / agents for line in lines if (m := _ROUND_DONE.search(line))][-1:]
    return agents_left * statistics.median(took) / 60 if took else None


def _progress(work: Path, message: str) -> None:
    """A run's progress lines, appended to ``progress.log`` in its work folder as they come."""
    with open(work / "progress.log", "a") as f:
        f.write(f"{time.strftime('%H:%M:%S')} {message}\n")


# What a result file that lacks a field ran with, where today's default differs: td_weight came in
# at 1 (the 1/2 MSE every earlier run used) and became 2 (2026-11-25, benchmarks.reference);
# cql_calibration came in (2026-11-27) after every earlier run had computed CQL(H) uncalibrated.
LEGACY_DEFAULTS = {"drpo": {"td_weight": 1.0, "cql_calibration": "none"}}


def find_identical(p: Preset, r: RunSpec, root: Path = RESULTS, device: str = "cpu") -> Path | None:
    """A finished run of any experiment of this preset (or of ``p.reuse_from``'s) with exactly r's
    configuration, less the settings its method never reads (Fed-BC reads no DRPO setting).

    Runs are deterministic (one thread, seeded), so e.g. the agents study's 5-agent point is the
    table's run on the same dataset: it is copied, not trained again."""
    from fedrl.algos import BCConfig, DRPOConfig
    from fedrl.federation.simulate import SimConfig

    from fedrl.federation.round import algo_config

    # a learner reads one of the two hyperparameter sets, the one algo_config hands it
    unread = ("drpo",) if isinstance(algo_config(r.algo, DRPOConfig(), BCConfig()), BCConfig) else ("bc",)
    cfg = sim_config(p, r, device)
    want = json.loads(json.dumps(cfg.as_dict()))
    for k in unread:
        want.pop(k)
    # options added after a run was recorded are absent from its file; they ran at their default of
    # the time, which is today's but for the defaults that changed since (LEGACY_DEFAULTS)
    defaults = json.loads(json.dumps(SimConfig(drpo=DRPOConfig(), bc=BCConfig()).as_dict()))
    for k, v in LEGACY_DEFAULTS.items():
        defaults[k].update(v)
    files = [f for name in (p.name, *p.reuse_from) for f in sorted((Path(root) / f"paper-{name}").glob("*/*.json"))]
    for f in files:
        res = json.loads(f.read_text())
        have = res.get("config")
        if res.get("reused_from") or not isinstance(have, dict):
            continue
        have = {**defaults, **have, **{k: {**defaults[k], **have.get(k, {})} for k in ("drpo", "bc")}}
        for k in unread:
            have.pop(k)
        if have == want:
            return f
    return None


def reuse(p: Preset, r: RunSpec, src: Path, root: Path = RESULTS) -> dict[str, Any]:
    res = json.loads(src.read_text())
    res.update(experiment=r.experiment, key=r.key, variant=r.variant,
               reused_from=(f"{src.parent.parent.name}/" if src.parent.parent.name != f"paper-{p.name}" else "")
               + f"{src.parent.name}/{src.stem}")
    return _write_result(p, r, res, root)


def _run_one(preset: str, r: RunSpec, root: str, agent_threads: int = 1,
             device: str = "cpu") -> tuple[RunSpec, dict[str, Any], float]:
    t0 = time.perf_counter()
    return r, execute(PRESETS[preset], r, Path(root), agent_threads, device), time.perf_counter() - t0


def cmd_run(a) -> int:
    p = PRESETS[a.preset]
    seeds = tuple(int(x) for x in a.seeds.split(",")) if a.seeds else p.seeds
    exps = (p.planned or EXPERIMENTS) if a.experiment == "all" else (a.experiment,)
    root = Path(a.results)
    jobs, agent_threads = getattr(a, "jobs", 1), getattr(a, "agent_threads", 1)
    if jobs < 1 or agent_threads < 1:
        raise SystemExit("--jobs and --agent-threads must be at least 1")
    todo = [r for e in exps for r in plan(p, e, seeds)]
    device = getattr(a, "device", "cpu")
    only = [k for k in (getattr(a, "only", None) or "").split(",") if k]
    if only:  # these cells, in this order
        by_key = {r.key: r for r in todo}
        unknown = [k for k in only if k not in by_key]
        if unknown:
            raise SystemExit(f"--only: no cell {', '.join(unknown)} in {p.name}/{a.experiment} "
                             f"(cells: {', '.join(by_key)})")
        todo = [by_key[k] for k in only]
    n_done = sum(result_path(p, r, root).exists() for r in todo)
    print(f"{len(todo)} runs, {n_done} already done", flush=True)

    def report(r: RunSpec, res: dict[str, Any], secs: float, note: str = "") -> None:
        nonlocal n_done
        n_done += 1
        f = res["final"] or {}
        print(f"[{n_done}/{len(todo)}] {r.experiment}/{r.key}: return {f.get('return_mean', float('nan')):.1f}"
              f" score {f.get('score_mean', float('nan')):.1f} ({secs:.0f}s{note})", flush=True)

    pending = []
    for r in todo:
        if result_path(p, r, root).exists():
            continue
        src = find_identical(p, r, root, device)
        if src is not None:
            res = reuse(p, r, src, root)
            report(r, res, 0, f", same configuration as {res['reused_from']}")
        else:
            pending.append(r)
    from fedrl.common.progress import Progress

    bar = Progress(len(pending), f"{p.name} {a.experiment}", "runs", every=60.0)
    inner = report

    def report(r, res, secs, note=""):  # noqa: F811 - the same report, then the bar
        inner(r, res, secs, note)
        bar.update(1)

    if getattr(a, "batched", False):
        with bar:
            for r, res, secs in run_batched(p, pending, root, device):
                report(r, res, secs, ", batched")
        return 0
    if jobs == 1:
        with bar:
            for r in pending:
                report(*_run_one(p.name, r, str(root), agent_threads, device))
        return 0
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor, as_completed

    with ProcessPoolExecutor(max_workers=jobs, mp_context=mp.get_context("spawn")) as ex:
        futs = [ex.submit(_run_one, p.name, r, str(root), agent_threads, device) for r in pending]
        with bar:
            for fut in as_completed(futs):
                report(*fut.result())
    return 0


def run_batched(p: Preset, specs: list[RunSpec], root: Path, device: str):
    """``specs`` as batched processes (``fedrl.federation.cells``): every cell of the same rounds,
    local steps and evaluation trained as one model, one group after another; each finished
    cell's result written as :func:`execute` writes it. Yields (spec, result, seconds)."""
    import torch

    from fedrl.federation.cells import SHARED, Cell, run_cells

    torch.set_num_threads(1)
    groups: dict[tuple, list[tuple[RunSpec, Any]]] = {}
    for r in specs:
        cfg = sim_config(p, r, device)
        groups.setdefault(tuple(getattr(cfg, k) for k in SHARED), []).append((r, Cell(r.key, cfg)))
    for i, members in enumerate(groups.values()):
        work = work_dir(p, members[0][0], root).parent / f"batched-{members[0][0].experiment}-{i}"
        t0 = time.perf_counter()
        res = run_cells([c for _, c in members], work, log=lambda m: print(m, flush=True))
        secs = time.perf_counter() - t0
        for r, c in members:
            out = cell_result(p, r, c, res[c.key] | {"rounds_jsonl": work / c.key / "rounds.jsonl"}, secs, device)
            yield r, _write_result(p, r, out, root), secs
        shutil.rmtree(work, ignore_errors=True)


def load_results(p: Preset, experiment: str, root: Path = RESULTS) -> list[dict[str, Any]]:
    d = Path(root) / f"paper-{p.name}" / experiment
    return [json.loads(f.read_text()) for f in sorted(d.glob("*.json"))] if d.exists() else []


def cmd_status(a) -> int:
    p = PRESETS[a.preset]
    root = Path(getattr(a, "results", RESULTS))
    for e in EXPERIMENTS:
        todo = plan(p, e, p.seeds)
        n = sum(result_path(p, r, root).exists() for r in todo)
        going = [(r, _rounds_done(work_dir(p, r, root))) for r in todo
                 if not result_path(p, r, root).exists() and work_dir(p, r, root).exists()]
        off_plan = p.planned is not None and e not in p.planned
        print(f"{e:13s} {n:4d} / {len(todo)} runs done" + "".join(_going(p, r, k, root) for r, k in going)
              + (f" (not in the {p.name} preset's plan: runs only when asked for by name)" if off_plan else ""))
        if n:
            revs = sorted({json.loads(result_path(p, r, root).read_text()).get("code_revision", "unknown")
                           for r in todo if result_path(p, r, root).exists()})
            print(f"{'':13s} code revisions of the finished runs: {', '.join(revs)}")
    return 0


def _going(p: Preset, r: RunSpec, k: int, root: Path) -> str:
    """``; KEY at round k/n (+m of a agents of round k+1), ~T min left`` for a run in progress."""
    work, rounds = work_dir(p, r, root), r.rounds or p.rounds
    m = _agents_in_round(work, k + 1)
    left = _minutes_left(work, (rounds - k) * r.agents - m, r.agents)
    return (f"; {r.key} at round {k}/{rounds}" + (f" (+{m} of {r.agents} agents of round {k + 1})" if m else "")
            + (f", ~{left:.0f} min left at its last agents' pace" if left is not None else ""))


# -- rendering -------------------------------------------------------------------------------
def _ms(xs: list[float]) -> str:
    if not xs:
        return "-"
    return f"{np.mean(xs):.1f} ± {np.std(xs):.1f}" if len(xs) > 1 else f"{xs[0]:.1f}"


def columns(p: Preset) -> tuple[str, ...]:
    """The preset's methods in the paper's column order, named variants beside their method."""
    order = ("fed-bc", "fed-bc-3e-4", "fed-cql", "cql", "drpo", "drpo-returns-gradient")
    return tuple(m for m in order if m in p.methods)


def method(r: dict[str, Any]) -> str:
    """A result's table column: its algorithm, or the named variant it ran (``fed-bc-3e-4``)."""
    return r["variant"].get("method", r["algo"])


def table_md(results: list[dict[str, Any]], datasets: tuple[str, ...], methods: tuple[str, ...] = ALGO_ORDER) -> str:
    rows = ["| dataset | " + " | ".join(ALGO_LABEL[a] for a in methods) + " |",
            "| --- | " + " | ".join("---" for _ in methods) + " |"]
    for d in datasets:
        cells = []
        for a in methods:
            rs = [r for r in results if method(r) == a and r["variant"]["dataset"] == short(d) and r["final"]]
            if not rs:
                cells.append("not run yet")
                continue
            sc = [r["final"]["score_mean"] for r in rs]
            ret = [r["final"]["return_mean"] for r in rs]
            gpu = sum(r["config"].get("device", "cpu") != "cpu" for r in rs)
            cells.append(f"{_ms(sc)} ({_ms(ret)}) n={len(rs)}" + (f", {gpu} on GPU" if gpu else ""))
        rows.append(f"| {short(d)} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def _best_then_final(r: dict[str, Any]) -> str:
    """A run's best evaluated score (its round) and its final one: ``51.6 (r7) -> 28.4``."""
    best = max(r["curve"], key=lambda c: c["score_mean"])
    return f"{best['score_mean']:.1f} (r{best['round']}) -> {r['curve'][-1]['score_mean']:.1f}"


def best_md(results: list[dict[str, Any]], datasets: tuple[str, ...], methods: tuple[str, ...] = ALGO_ORDER) -> str:
    """Per cell: the best evaluated score of each run's curve (its round) and how far the final
    score is below it, per seed: whether a method got there and then lost it."""
    rows = ["| dataset | " + " | ".join(ALGO_LABEL[a] for a in methods) + " |",
            "| --- | " + " | ".join("---" for _ in methods) + " |"]
    for d in datasets:
        cells = []
        for a in methods:
            rs = sorted((r for r in results if method(r) == a and r["variant"]["dataset"] == short(d) and r["curve"]),
                        key=lambda r: r["seed"])
            parts = [_best_then_final(r) for r in rs]
            cells.append("<br>".join(parts) if parts else "not run yet")
        rows.append(f"| {short(d)} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def study_md(results: list[dict[str, Any]], key: str) -> str:
    if not results:
        return "not run yet"
    algos = sorted({r["algo"] for r in results}, key=ALGO_ORDER.index)
    values = sorted({r["variant"][key] for r in results})
    rows = [f"| {key} | " + " | ".join(ALGO_LABEL[a] for a in algos) + " |",
            "| --- | " + " | ".join("---" for _ in algos) + " |"]
    for v in values:
        cells = [_ms([r["final"]["score_mean"] for r in results if r["algo"] == a and r["variant"][key] == v
                      and r["final"]]) for a in algos]
        rows.append(f"| {v} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def lambda_sweeps(results: list[dict[str, Any]], fixed: tuple[float, float],
                  sweeps: tuple[str, ...]) -> list[tuple[str, str, float, dict[float, list[dict[str, Any]]]]]:
    """Each sweep in ``sweeps`` that has finished DRPO runs: (varied lambda, held lambda, its
    value, {varied value: its finished runs, by seed}), values ascending; the table and the plot
    read this."""
    fix1, fix2 = fixed
    out = []
    for vary, hold, hold_value in (("lambda1", "lambda2", fix2), ("lambda2", "lambda1", fix1)):
        rs = [r for r in results if r["algo"] == "drpo" and r["final"] and r["variant"][hold] == hold_value]
        values = sorted({r["variant"][vary] for r in rs})
        if vary in sweeps and values:
            out.append((vary, hold, hold_value,
                        {v: sorted((r for r in rs if r["variant"][vary] == v), key=lambda r: r.get("seed", 0))
                         for v in values}))
    return out


def lambdas_md(results: list[dict[str, Any]], fixed: tuple[float, float] = (0.1, 1.0),
               sweeps: tuple[str, ...] = ("lambda1", "lambda2")) -> str:
    """The paper's Figure 4(c) sweeps that ``sweeps`` names: lambda1 with lambda2 fixed, lambda2
    with lambda1 fixed; each value's final score over its seeds, how many seeds ran, and each
    seed's best score (its round) and final score (whether a setting got there and lost it)."""
    refs = [r for r in results if r["algo"] != "drpo" and r["final"]]
    results = [r for r in results if r["algo"] == "drpo"]
    if not results:
        return "not run yet"
    out = []
    for vary, hold, hold_value, per in lambda_sweeps(results, fixed, sweeps):
        values = list(per)
        out += [f"| {vary} ({hold} = {hold_value:g}) | " + " | ".join(f"{v:g}" for v in values) + " |",
                "| --- | " + " | ".join("---" for _ in values) + " |",
                "| DRPO score | " + " | ".join(_ms([r["final"]["score_mean"] for r in per[v]]) for v in values) + " |",
                "| seeds | " + " | ".join(str(len(per[v])) for v in values) + " |"]
        if any(r.get("curve") for v in values for r in per[v]):
            out.append("| best (round) -> final, by seed | " + " | ".join(
                "<br>".join(f"s{r['seed']}: {_best_then_final(r)}" for r in per[v] if r.get("curve"))
                for v in values) + " |")
        out.append("")
    for a in sorted({r["algo"] for r in refs}):
        out.append(f"{ALGO_LABEL[a]} on the same agents, for reference: "
                   f"{_ms([r['final']['score_mean'] for r in refs if r['algo'] == a])}")
        out.append("")
    return "\n".join(out[:-1])


def q_scale_md(table: list[dict[str, Any]], normalized: list[dict[str, Any]], datasets: tuple[str, ...]) -> str:
    rows = ["| dataset | DRPO, raw Q term (default) | DRPO, normalised Q term |", "| --- | --- | --- |"]
    for d in datasets:
        raw = [r["final"]["score_mean"] for r in table if r["algo"] == "drpo" and r["variant"]["dataset"] == short(d)
               and r["final"]]
        nor = [r["final"]["score_mean"] for r in normalized if r["variant"]["dataset"] == short(d) and r["final"]]
        rows.append(f"| {short(d)} | {_ms(raw) if raw else 'not run yet'} (n={len(raw)}) | "
                    f"{_ms(nor) if nor else 'not run yet'} (n={len(nor)}) |")
    return "\n".join(rows)


def q_scale_long_md(results: list[dict[str, Any]]) -> str:
    """Final score, best score and, at the last round, mean Q on the data and the policy's NLL of
    the data actions (what lambda1 pulls down), per Q-term variant, mean ± std over seeds."""
    if not results:
        return "not run yet"
    order = ("raw", "normalized", "none (no regularisers)", "none (behaviour cloning)")
    label = {"raw": "DRPO, raw Q term (default)", "normalized": "DRPO, normalised Q term",
             "none (no regularisers)": "Fed-CQL (no regularisers)",
             "none (behaviour cloning)": "Fed-BC (the same budget, for reference)"}
    r0 = results[0]
    rows = [f"{r0['agents']} agents x {r0['trajectories']} trajectories of {short(r0['datasets'][0])}, "
            f"{r0['rounds']} rounds x {r0['local_steps']} local steps (normalised score; return in brackets)", "",
            "| variant | final score | best score | mean Q on data (last round) | NLL of data actions (last round) |",
            "| --- | --- | --- | --- | --- |"]
    for v in order:
        rs = [r for r in results if r["variant"]["q_scale"] == v and r["final"]]
        if not rs:
            rows.append(f"| {label[v]} | not run yet | | | |")
            continue
        last = lambda k: [r["losses_per_round"][k][-1] for r in rs if k in r["losses_per_round"]]  # noqa: E731
        best = [max(c["score_mean"] for c in r["curve"]) for r in rs]
        rows.append(f"| {label[v]} | {_ms([r['final']['score_mean'] for r in rs])} "
                    f"({_ms([r['final']['return_mean'] for r in rs])}) n={len(rs)} | {_ms(best)} | "
                    f"{_ms(last('q_data')) if rs[0]['algo'] != 'fed-bc' else 'no critic'} | "
                    f"{_ms(last('reg_data')) if rs[0]['algo'] == 'drpo' else 'not computed'} |")
    return "\n".join(rows)


def _save(fig, path: Path) -> None:
    """Lay out, write (no software tag: the same results draw the same bytes) and close a figure."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90, metadata={"Software": None})
    plt.close(fig)


def curves_png(results: list[dict[str, Any]], datasets: tuple[str, ...], path: Path,
               methods: tuple[str, ...] = ALGO_ORDER) -> bool:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    present = [d for d in datasets if any(r["variant"]["dataset"] == short(d) for r in results)]
    if not present:
        return False
    fig, axes = plt.subplots(1, len(present), figsize=(5 * len(present), 3.6), squeeze=False)
    for ax, d in zip(axes[0], present):
        for a in methods:
            rs = [r for r in results if method(r) == a and r["variant"]["dataset"] == short(d) and r["curve"]]
            if not rs:
                continue
            rounds = [c["round"] for c in rs[0]["curve"]]
            ys = np.array([[c["score_mean"] for c in r["curve"]] for r in rs if len(r["curve"]) == len(rounds)])
            m = ys.mean(0)
            ax.plot(rounds, m, label=f"{ALGO_LABEL[a]} (n={len(ys)})")
            if len(ys) > 1:
                ax.fill_between(rounds, m - ys.std(0), m + ys.std(0), alpha=0.2)
        ax.set_title(short(d))
        ax.set_xlabel("round")
        ax.set_ylabel("normalised score")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    _save(fig, path)
    return True


def studies_png(p: Preset, root: Path, path: Path) -> bool:
    """Final score against each study's variable (the paper's Figures 3-4): one panel per study run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = []  # (title, x label, log x, {label: [(x, scores)]})
    for e in ("agents", "trajectories", "local_steps"):
        rs = [r for r in load_results(p, e, root) if r["final"]]
        if rs:
            series = {}
            for a in ALGO_ORDER:
                xs = sorted({r["variant"][e] for r in rs if r["algo"] == a})
                if xs:
                    series[ALGO_LABEL[a]] = [(x, [r["final"]["score_mean"] for r in rs
                                                  if r["algo"] == a and r["variant"][e] == x]) for x in xs]
            panels.append((e.replace("_", " "), e.replace("_", " "), series))
    lam = [r for r in load_results(p, "lambdas", root) if r["final"] and r["algo"] == "drpo"]
    if lam:
        series = {f"{vary} ({hold} = {v0:g})": [(v, [r["final"]["score_mean"] for r in rs]) for v, rs in per.items()]
                  for vary, hold, v0, per in lambda_sweeps(lam, p.lambda_fixed, p.lambda_sweeps)}
        panels.append(("lambdas, 4 expert + 1 medium agents", "lambda (0 drawn at the left edge)", series))
    if not panels:
        return False
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.4), squeeze=False)
    for ax, (title, xlabel, series) in zip(axes[0], panels):
        for label, pts in series.items():
            xs = _lambda_x(pts) if title.startswith("lambdas") else np.array([x for x, _ in pts], float)
            m = np.array([np.mean(y) for _, y in pts])
            sd = np.array([np.std(y) for _, y in pts])
            ax.errorbar(xs, m, yerr=sd, marker="o", capsize=3, label=f"{label} (n={max(len(y) for _, y in pts)})")
        ax.set_xscale("log")
        if title.startswith("lambdas"):  # ticks at the values run, 0 named as itself
            ticks = sorted({(x, v) for pts in series.values() for (v, _), x in zip(pts, _lambda_x(pts))})
            ax.set_xticks([x for x, _ in ticks], [f"{v:g}" for _, v in ticks])
            ax.minorticks_off()
        ax.set_title(title, fontsize=10)
        ax.set_xlabel(xlabel)
        ax.set_ylabel("normalised score")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    _save(fig, path)
    return True


def _lambda_x(pts: list[tuple[float, Any]]) -> np.ndarray:
    """Where a lambda sweep's values go on a log axis: 0 one decade left of the smallest positive."""
    xs = np.array([x for x, _ in pts], float)
    pos = xs[xs > 0]
    return np.where(xs > 0, xs, (pos.min() / 10) if len(pos) else 1.0)


def lambda_curves_png(results: list[dict[str, Any]], fixed: tuple[float, float], path: Path,
                      values: tuple[float, ...] = ()) -> bool:
    """Score by round of the lambda2 sweep (lambda1 held at ``fixed[0]``): each seed thin, the
    mean over seeds bold, one colour per lambda2 (its place in ``values``, the preset's, so a
    setting keeps its colour as others arrive); the Fed-BC reference's mean dashed, in black.
    Shows what a final score hides: a setting still rising at the last round, or one that peaked
    and fell."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [r for r in results if r["final"] and r.get("curve")]
    drpo = [r for r in runs if r["algo"] == "drpo" and r["variant"]["lambda1"] == fixed[0]]
    if not drpo:
        return False
    fig, ax = plt.subplots(figsize=(6.4, 3.8))
    palette = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    present = sorted({r["variant"]["lambda2"] for r in drpo})
    order = [*values, *(v for v in present if v not in values)]
    groups = [(f"DRPO, lambda2 = {v:g}", [r for r in drpo if r["variant"]["lambda2"] == v], "-",
               palette[order.index(v) % len(palette)]) for v in present]
    refs = [r for r in runs if r["algo"] != "drpo"]
    if refs:
        groups.append(("Fed-BC (reference)", refs, "--", "black"))
    for label, rs, style, colour in groups:
        for r in rs:
            ax.plot([c["round"] for c in r["curve"]], [c["score_mean"] for c in r["curve"]], style,
                    color=colour, alpha=0.35, linewidth=0.9)
        rounds = [c["round"] for c in rs[0]["curve"]]
        full = np.array([[c["score_mean"] for c in r["curve"]] for r in rs if len(r["curve"]) == len(rounds)])
        ax.plot(rounds, full.mean(0), style, color=colour, linewidth=2.2, label=f"{label} (n={len(full)})")
    ax.set_xlabel("round")
    ax.set_ylabel("normalised score")
    ax.set_title(f"4 expert + 1 medium agents, lambda1 = {fixed[0]:g}: each seed thin, their mean bold", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    _save(fig, path)
    return True


def system_md(root: Path = RESULTS) -> str:
    """The system-speed table, from benchmarks/results/{throughput,services}-cpu.json."""
    rows = ["| measure | result | beside | target |", "| --- | --- | --- | --- |"]
    tp, sv = Path(root) / "throughput-cpu.json", Path(root) / "services-cpu.json"
    if tp.exists():
        t = json.loads(tp.read_text())
        for r in t["rows"]:
            rows.append(f"| {r['update'].upper()} local update, paper sizes, {t['threads']} threads | "
                        f"{r['steps_per_s']:.1f} steps/s | {100 * r['fraction_of_peak_ceiling']:.0f}% of the "
                        f"FLOP ceiling at peak GEMM ({t['matmul_gflops']:.0f} GFLOP/s; its own GEMMs alone run "
                        f"at {100 * r['shape_gflops'] / t['matmul_gflops']:.0f}% of that peak), "
                        f"{100 * r['fraction_of_shapes_ceiling']:.0f}% at its own GEMM shapes | "
                        f"{'>= 80% (DRPO)' if r['update'] == 'drpo' else ''} |")
    if sv.exists():
        s = json.loads(sv.read_text())
        o, tr, ev = s["overhead"], s["transfer"], s["evaluator"]
        cpu = o.get("cpu_ms_per_round_steady") or {}
        rows.append(f"| round overhead, {o['agents']} agent processes, zero local steps | "
                    f"{o['round_ms_median']:.0f} ms median (p90 {o['round_ms_p90']:.0f}) | CPU per round: "
                    f"aggregator {cpu.get('aggregator', float('nan')):.0f} ms, agents {cpu.get('agents_total', float('nan')):.0f} ms"
                    f" on {o.get('cores', '?')} cores | < {o['target_ms']:.0f} ms |")
        calls = o.get("calls_transport")
        if calls:
            cc = calls.get("cpu_ms_per_round_steady") or {}
            rows.append(f"| the same round with a call per task (`--transport calls`), same run | "
                        f"{calls['round_ms_median']:.0f} ms median (p90 {calls['round_ms_p90']:.0f}) | CPU per "
                        f"round: aggregator {cc.get('aggregator', float('nan')):.0f} ms, agents "
                        f"{cc.get('agents_total', float('nan')):.0f} ms; the Session stream's round is "
                        f"{o['session_to_calls_ratio']:.2f}x this | |")
        floor = o.get("bare_grpc_floor")
        if floor:
            srv = np.median([r["server_cpu_ms_per_round"] for r in floor["runs"]])
            cli = np.median([r["clients_cpu_ms_per_round"] for r in floor["runs"]])
            rows.append(f"| the same round in bare gRPC (same messages and processes, no work) | "
                        f"{floor['round_ms_median']:.0f} ms median | CPU per round: server {srv:.0f} ms, "
                        f"clients {cli:.0f} ms; the federation's round is {o['ratio_to_floor']:.1f}x this floor | |")
        runs = tr["raw_grpc"].get("runs")  # measured before and after the federation (since 2026-11-25)
        each = " and ".join(f"{r['mb_per_s']:.0f}" for r in runs or ())
        raw = (f"raw gRPC {tr['raw_grpc']['mb_per_s']:.0f} MB/s (mean of {each}, before and after)" if runs
               else f"raw gRPC {tr['raw_grpc']['mb_per_s']:.0f} MB/s")
        cpu = tr.get("cpu_per_round")
        cpu = (f"; CPU per round {cpu['federation_ms'] / 1e3:.2f} s vs raw's {cpu['raw_ms'] / 1e3:.2f} s"
               if cpu else "")
        cycle = ("" if "ratio_to_raw_cycle" not in tr else  # reported since 2026-11-25 (evening)
                 f" ({tr['federation']['mb_per_s_cycle']:.0f} MB/s and {100 * tr['ratio_to_raw_cycle']:.0f}% "
                 f"over the whole cycle, the version's fsynced write included)")
        rows.append(f"| transfer, {tr['federation']['model_mb']:.0f} MB model, {tr['agents']} agents | "
                    f"{tr['federation']['mb_per_s']:.0f} MB/s | {raw}: {100 * tr['ratio_to_raw']:.0f}%{cycle}{cpu} | "
                    f">= {100 * tr['target_ratio']:.0f}% |")
        rows.append(f"| evaluator, {ev['env']}, {ev['num_envs']} envs | {ev['policy_steps_per_s']:.0f} steps/s | "
                    f"random actions {ev['raw_steps_per_s']:.0f} steps/s: {100 * ev['ratio_to_raw']:.0f}% | "
                    f">= {100 * ev['target_ratio']:.0f}% |")
        for name, mb in (s.get("peak_rss_mb") or {}).items():
            rows.append(f"| peak memory (RSS), {name} | {mb:.0f} MB | | |")
    return "\n".join(rows)


# The presets BENCHMARKS.md shows, and which of their blocks (None: all of them)
MD_BLOCKS: dict[str, tuple[str, ...] | None] = {"reduced": None, "reduced-halfcheetah": ("table", "best"),
                                                 "claim": ("table", "best", "lambdas"), "claim-v2": ("table", "best")}


def md_blocks(p: Preset, root: Path = RESULTS) -> dict[str, str]:
    """The blocks of ``p`` that BENCHMARKS.md holds (none for a preset it does not show)."""
    if p.name not in MD_BLOCKS:
        return {}
    blocks, keep = render_blocks(p, root), MD_BLOCKS[p.name]
    return {k: v for k, v in blocks.items()
            if keep is None or k.removeprefix(f"paper-{p.name}-") in keep or k == "system"}


def render_blocks(p: Preset, root: Path = RESULTS) -> dict[str, str]:
    """Markdown blocks, keyed by marker name, generated from the result files only."""
    table = load_results(p, "table", root)
    blocks = {
        f"paper-{p.name}-table": table_md(table, p.datasets, columns(p)),
        f"paper-{p.name}-best": best_md(table, p.datasets, columns(p)),
        f"paper-{p.name}-agents": study_md(load_results(p, "agents", root), "agents"),
        f"paper-{p.name}-trajectories": study_md(load_results(p, "trajectories", root), "trajectories"),
        f"paper-{p.name}-local_steps": study_md(load_results(p, "local_steps", root), "local_steps"),
        f"paper-{p.name}-lambdas": lambdas_md(load_results(p, "lambdas", root), p.lambda_fixed,
                                                        p.lambda_sweeps),
        f"paper-{p.name}-q_scale": q_scale_md(table, load_results(p, "q_scale", root), p.datasets),
        f"paper-{p.name}-q_scale_long": q_scale_long_md(load_results(p, "q_scale_long", root)),
    }
    if p.name == "reduced":
        blocks["system"] = system_md(root)
    return blocks


def cmd_render(a) -> int:
    p = PRESETS[a.preset]
    root = Path(a.results)
    out = root / f"paper-{p.name}"
    blocks = render_blocks(p, root)
    out.mkdir(parents=True, exist_ok=True)
    (out / "tables.md").write_text("\n\n".join(f"### {k}\n\n{v}" for k, v in blocks.items()) + "\n")
    if curves_png(load_results(p, "table", root), p.datasets, out / "learning_curves.png", columns(p)):
        print(f"wrote {out / 'learning_curves.png'}")
    if studies_png(p, root, out / "studies.png"):
        print(f"wrote {out / 'studies.png'}")
    if "lambda2" in p.lambda_sweeps and lambda_curves_png(load_results(p, "lambdas", root), p.lambda_fixed,
                                                          out / "lambda2_curves.png", p.lambda_values):
        print(f"wrote {out / 'lambda2_curves.png'}")
    if a.update_md and md_blocks(p, root):
        BENCHMARKS_MD.write_text(replace_blocks(BENCHMARKS_MD.read_text(), md_blocks(p, root)))
        print(f"updated {BENCHMARKS_MD}")
    print(f"wrote {out / 'tables.md'}")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.paper", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--preset", choices=PRESETS, default="reduced")
    r.add_argument("--experiment", choices=(*EXPERIMENTS, "all"), default="table")
    r.add_argument("--seeds", default=None, help="comma-separated (default: the preset's)")
    r.add_argument("--results", default=str(RESULTS), help="results root (default benchmarks/results)")
    r.add_argument("--jobs", type=int, default=1,
                   help="runs in parallel, one process and one torch thread each (default 1)")
    r.add_argument("--agent-threads", type=int, default=1,
                   help="a run's agents trained at once, one thread each: the same numbers, sooner; "
                        "--agent-threads 2 puts one run on both cores (default 1)")
    r.add_argument("--device", default="cpu",
                   help="cpu (default: every committed CPU result ran so), cuda or cuda:N; recorded in each "
                        "result's config, with the device's name")
    r.add_argument("--batched", action="store_true",
                   help="train the cells as one batched model per group of equal rounds and local steps "
                        "(fedrl.federation.cells; each cell's draws its batch's, not the per-agent engine's): "
                        "for a GPU, where one process of many learners fills the device")
    r.add_argument("--only", default=None,
                   help="comma-separated cell keys (e.g. drpo-medium-s0,fed-cql-medium-s0): run just these, "
                        "in this order")
    r.set_defaults(func=cmd_run)
    s = sub.add_parser("status")
    s.add_argument("--preset", choices=PRESETS, default="reduced")
    s.add_argument("--results", default=str(RESULTS), help="results root (default benchmarks/results)")
    s.set_defaults(func=cmd_status)
    d = sub.add_parser("render")
    d.add_argument("--preset", choices=PRESETS, default="reduced")
    d.add_argument("--no-update-md", dest="update_md", action="store_false",
                   help="do not rewrite the generated blocks of BENCHMARKS.md (presets it shows only)")
    d.add_argument("--results", default=str(RESULTS), help="results root (default benchmarks/results)")
    d.set_defaults(func=cmd_render)
    a = ap.parse_args(argv)
    return a.func(a)


if __name__ == "__main__":
    sys.exit(main())
