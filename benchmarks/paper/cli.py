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
from pathlib import Path
from typing import Any


from benchmarks.common import BENCHMARKS_MD, RESULTS, replace_blocks
from benchmarks.paper.cells import (
    CellBusy,
    agents_in_round,
    find_identical,
    load_results,
    lock_holder,
    minutes_left,
    reuse,
    rounds_done,
    run_batched,
    run_one,
    work_dir,
)
from benchmarks.paper.plots import curves_png, lambda_curves_png, studies_png
from benchmarks.paper.presets import EXPERIMENTS, PRESETS, Preset, RunSpec, plan, planned, result_path
from benchmarks.paper.tables import STUDIES_MD, columns, md_blocks, render_blocks, study_blocks


def cmd_run(a) -> int:
    p = PRESETS[a.preset]
    seeds = tuple(int(x) for x in a.seeds.split(",")) if a.seeds else None
    exps = (p.planned or EXPERIMENTS) if a.experiment == "all" else (a.experiment,)
    root = Path(a.results)
    jobs, agent_threads = getattr(a, "jobs", 1), getattr(a, "agent_threads", 1)
    if jobs < 1 or agent_threads < 1:
        raise SystemExit("--jobs and --agent-threads must be at least 1")
    todo = [r for e in exps for r in (plan(p, e, seeds) if seeds else planned(p, e))]
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

    busy = []

    def skip(e: CellBusy) -> None:  # another process trains it: say so, and go on with the rest
        busy.append(str(e))
        print(f"skipped: {e}", flush=True)
        bar.update(1)

    if getattr(a, "batched", False):
        with bar:
            for r, res, secs in run_batched(p, pending, root, device, on_busy=skip):
                report(r, res, secs, ", batched")
        return 1 if busy else 0
    if jobs == 1:
        with bar:
            for r in pending:
                try:
                    report(*run_one(p.name, r, str(root), agent_threads, device))
                except CellBusy as e:
                    skip(e)
        return 1 if busy else 0
    from concurrent.futures import as_completed

    from fedrl.common.lifetime import child_pool

    with child_pool(jobs) as ex:
        futs = [ex.submit(run_one, p.name, r, str(root), agent_threads, device) for r in pending]
        with bar:
            for fut in as_completed(futs):
                try:
                    report(*fut.result())
                except CellBusy as e:
                    skip(e)
    return 1 if busy else 0


def cmd_status(a) -> int:
    """Per experiment: how many of its planned cells are done, each one in progress (its round,
    pace, and whether a process holds it), and, for the preset's plan, the cells still to run."""
    p = PRESETS[a.preset]
    root = Path(getattr(a, "results", RESULTS))
    for e in EXPERIMENTS:
        todo = planned(p, e)
        done = [r for r in todo if result_path(p, r, root).exists()]
        rest = [r for r in todo if r not in done]
        going = [(r, rounds_done(work_dir(p, r, root))) for r in rest if work_dir(p, r, root).exists()]
        off_plan = p.planned is not None and e not in p.planned
        print(f"{e:13s} {len(done):4d} / {len(todo)} runs done" + "".join(_going(p, r, k, root) for r, k in going)
              + (f" (not in the {p.name} preset's plan: runs only when asked for by name)" if off_plan else ""))
        if done:
            revs = sorted({json.loads(result_path(p, r, root).read_text()).get("code_revision", "unknown")
                           for r in done})
            print(f"{'':13s} code revisions of the finished runs: {', '.join(revs)}")
        waiting = [r.key for r in rest if not work_dir(p, r, root).exists()]
        if waiting and not off_plan:
            print(f"{'':13s} not started: {', '.join(waiting)}")
    return 0


def _going(p: Preset, r: RunSpec, k: int, root: Path) -> str:
    """``; KEY at round k/n (+m of a agents of round k+1), ~T min left`` for a run in progress."""
    work, rounds = work_dir(p, r, root), r.rounds or p.rounds
    m = agents_in_round(work, k + 1)
    left = minutes_left(work, (rounds - k) * r.agents - m, r.agents)
    pid = lock_holder(work)
    return (f"; {r.key} at round {k}/{rounds}" + (f" (+{m} of {r.agents} agents of round {k + 1})" if m else "")
            + (f", ~{left:.0f} min left at its last agents' pace" if left is not None else "")
            + ("" if pid is None else f", running (pid {pid})" if pid else ", stopped (the run command resumes it)"))


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
    for doc, blocks_ in ((BENCHMARKS_MD, md_blocks(p, root, blocks)), (STUDIES_MD, study_blocks(p, root, blocks))):
        if a.update_md and blocks_:
            doc.write_text(replace_blocks(doc.read_text(), blocks_))
            print(f"updated {doc}")
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
                   help="do not rewrite the generated blocks of BENCHMARKS.md and the studies' page (presets they show only)")
    d.add_argument("--results", default=str(RESULTS), help="results root (default benchmarks/results)")
    d.set_defaults(func=cmd_render)
    a = ap.parse_args(argv)
    return a.func(a)

