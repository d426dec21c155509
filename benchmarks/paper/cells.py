"""Running the paper's cells: one per process (resumable per round), or a group as one batched model;
a finished cell's result file, a cell copied from an identical finished one, and what a running cell has left."""

from __future__ import annotations

import json
import re
import shutil
import statistics
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

from benchmarks.common import RESULTS, code_revision, device_name
from benchmarks.paper.presets import PRESETS, Preset, RunSpec, result_path, sim_config


def _write_result(p: Preset, r: RunSpec, res: dict[str, Any], root: Path) -> dict[str, Any]:
    """Write a run's result atomically (a run cut in the middle leaves no file)."""
    path = result_path(p, r, root)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(res, indent=1))
    tmp.replace(path)
    return res


class CellBusy(RuntimeError):
    """The cell is being run by another process (its lock is held)."""


def _lock_path(work: Path) -> Path:
    return work.with_name(work.name + ".lock")


def _lock(work: Path):
    """Hold ``<work>.lock`` for this process (released when it exits, however it exits): two processes
    training one cell would write each other's checkpoints in ``work``, and mix the runs silently."""
    import fcntl
    import os

    work.parent.mkdir(parents=True, exist_ok=True)
    f = open(_lock_path(work), "a+")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        holder = f.read().strip() or "unknown"
        f.close()
        raise CellBusy(f"{work.name} is already running (pid {holder}; its rounds are in {work})") from None
    f.seek(0)
    f.truncate()
    f.write(str(os.getpid()))
    f.flush()
    return f


def lock_holder(work: Path) -> int | None:
    """The pid of the process running the cell whose rounds go to ``work``; 0 when none is; None
    when no run of it ever took the lock (a run started before cells took locks: unknown)."""
    import fcntl

    path = _lock_path(work)
    if not path.exists():
        return None
    with open(path) as f:
        try:
            fcntl.flock(f, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            text = f.read().strip()
            return int(text) if text.isdigit() else -1
        return 0  # closing the file releases the shared lock just taken


def _finished(p: Preset, r: RunSpec, root: Path) -> dict[str, Any] | None:
    """The cell's result when a run of it has finished, else None (read under its lock)."""
    path = result_path(p, r, root)
    return json.loads(path.read_text()) if path.exists() else None


def execute(p: Preset, r: RunSpec, root: Path = RESULTS, agent_threads: int = 1,
            device: str = "cpu") -> dict[str, Any]:
    """Run one experiment cell on ``device`` (recorded in its config); write and return its result.
    Raises :class:`CellBusy`, having touched nothing, when another process runs the same cell."""
    work = work_dir(p, r, root)  # checkpointed every round: a stopped run resumes after its last round
    with _lock(work):
        if (done := _finished(p, r, root)) is not None:  # by the lock's holder before this one took it
            return done
        return _execute(p, r, root, agent_threads, device, work)


def _execute(p: Preset, r: RunSpec, root: Path, agent_threads: int, device: str, work: Path) -> dict[str, Any]:
    import torch

    from fedrl.federation.simulate import run as simulate

    torch.set_num_threads(1)  # reproducible numbers, and one core left for the rest
    revision = code_revision()  # before the run: the code this process loaded, not later edits
    cfg = sim_config(p, r, device)
    t0 = time.perf_counter()
    work.mkdir(parents=True, exist_ok=True)
    resumed_from = rounds_done(work)
    kept = agents_in_round(work, resumed_from + 1)  # agents of the next round a stopped process trained
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
    if resumed_from or kept:  # wall_seconds then counts only this process's part of the run
        out["resumed_after_round"] = resumed_from
        if kept:
            out["resumed_agents_kept"] = kept
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


BATCHED_ENGINE = "batched cells (benchmarks.paper.device)"  # a result's engine when its cell ran in a batch


def cell_result(p, spec, cell, res: dict, wall: float, device: str) -> dict:
    """A finished cell in ``benchmarks.paper``'s result format."""
    import torch

    return {"preset": p.name, "experiment": spec.experiment, "key": spec.key, "algo": spec.algo,
            "datasets": list(spec.datasets), "seed": spec.seed, "agents": spec.agents,
            "trajectories": spec.trajectories, "local_steps": spec.local_steps, "rounds": cell.cfg.rounds,
            "variant": spec.variant, "config": cell.cfg.as_dict(), "curve": res["curve"], "final": res["final"],
            "losses_per_round": round_losses(res["rounds_jsonl"]), "wall_seconds": round(wall, 1),
            "code_revision": code_revision(), "device_name": device_name(device), "torch": torch.__version__,
            "shards": res["shards"], "engine": BATCHED_ENGINE,
            **({"final_long": res["final_long"]} if "final_long" in res else {})}


def work_dir(p: Preset, r: RunSpec, root: Path = RESULTS) -> Path:
    """Where a run in progress keeps its rounds and checkpoint (not committed: ``runs/`` is ignored;
    beside the results when they live elsewhere, as in the tests)."""
    base = Path(root).resolve().parent.parent / "runs" if Path(root).resolve() == RESULTS else Path(root) / ".work"
    return base / f"paper-{p.name}" / r.experiment / r.key


def rounds_done(work: Path) -> int:
    """Rounds a run in progress has checkpointed (0: none)."""
    ck = work / "checkpoint.safetensors"
    if not ck.exists():
        return 0
    from safetensors import safe_open

    with safe_open(str(ck), "pt") as f:
        return int(json.loads(f.metadata()["fedrl_checkpoint"])["round"])


def agents_in_round(work: Path, r: int) -> int:
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


def minutes_left(work: Path, agents_left: int, agents: int) -> float | None:
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
# at 1 (the 1/2 MSE every earlier run used) and became 2 (2026-11-25, benchmarks.studies.reference);
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


def run_one(preset: str, r: RunSpec, root: str, agent_threads: int = 1,
             device: str = "cpu") -> tuple[RunSpec, dict[str, Any], float]:
    t0 = time.perf_counter()
    return r, execute(PRESETS[preset], r, Path(root), agent_threads, device), time.perf_counter() - t0


def run_batched(p: Preset, specs: list[RunSpec], root: Path, device: str,
                on_busy: Callable[[CellBusy], None] | None = None):
    """``specs`` as batched processes (``fedrl.federation.cells``): every cell of the same rounds,
    local steps and evaluation trained as one model, one group after another; each finished
    cell's result written as :func:`execute` writes it. Yields (spec, result, seconds).

    A group holds each member's lock while it trains: a member another process runs is left out
    and handed to ``on_busy`` (raised when it is None), one finished meanwhile yields its result.
    A group's checkpoint folder is named by its members, so a stopped group resumes in the next
    invocation whatever else is still to run."""
    import contextlib

    import torch

    from fedrl.federation.cells import SHARED, Cell, run_cells

    torch.set_num_threads(1)
    groups: dict[tuple, list[tuple[RunSpec, Any]]] = {}
    for r in specs:
        cfg = sim_config(p, r, device)
        groups.setdefault(tuple(getattr(cfg, k) for k in SHARED), []).append((r, Cell(r.key, cfg)))
    for candidates in groups.values():
        with contextlib.ExitStack() as held:
            members = []
            for r, c in candidates:
                try:
                    held.enter_context(_lock(work_dir(p, r, root)))
                except CellBusy as e:
                    if on_busy is None:
                        raise
                    on_busy(e)
                    continue
                if (done := _finished(p, r, root)) is not None:  # by the lock's last holder
                    yield r, done, 0.0
                else:
                    members.append((r, c))
            if not members:
                continue
            work = group_work_dir(p, [r for r, _ in members], root)
            t0 = time.perf_counter()
            res = run_cells([c for _, c in members], work, log=lambda m: print(m, flush=True))
            secs = time.perf_counter() - t0
            for r, c in members:
                out = cell_result(p, r, c, res[c.key] | {"rounds_jsonl": work / c.key / "rounds.jsonl"}, secs, device)
                yield r, _write_result(p, r, out, root), secs
            shutil.rmtree(work, ignore_errors=True)


def group_work_dir(p: Preset, members: list[RunSpec], root: Path = RESULTS) -> Path:
    """The checkpoint folder of a batched group: named by its members' keys, never by its place in
    one invocation's list (where a group stopped in one run would meet other cells in the next)."""
    import hashlib

    digest = hashlib.sha256("\n".join(sorted(r.key for r in members)).encode()).hexdigest()[:12]
    return work_dir(p, members[0], root).parent / f"batched-{members[0].experiment}-{digest}"


def load_results(p: Preset, experiment: str, root: Path = RESULTS) -> list[dict[str, Any]]:
    d = Path(root) / f"paper-{p.name}" / experiment
    return [json.loads(f.read_text()) for f in sorted(d.glob("*.json"))] if d.exists() else []
