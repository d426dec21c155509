"""A preset's table column for one dataset in one call of a lent GPU: measure, fit, run, pack.

    python -m benchmarks.paper.device run --budget 540 --out DIR [--preset paper] [--dataset hopper-medium-v2] [--seeds 0,1,2]
    python -m benchmarks.paper.device unpack DIR/paper-device.tgz
    python -m benchmarks.paper.device run --tiny --device cpu --out DIR   (the CPU check: 2 agents, 2 rounds, 5 steps)

The column: DRPO, Fed-CQL, CQL alone and Fed-BC, 10 agents x 20 rounds x 1,000 local steps, each
agent holding the paper's ~5,000 transitions (whole episodes, as the ``claim`` preset), three
seeds; the cells and their settings are ``benchmarks.paper``'s (``paper`` preset, ``table``
experiment), so the results render beside the harness's own. ``--preset claim-v2`` runs that
preset's column instead (the claim's scale at today's defaults), ``--preset verdict`` or
``heldout-walker2d`` theirs (named variants included; ``--dataset`` defaults to the preset's
first). Cells whose result is already in
``--results`` (default ``benchmarks/results``: finished on the CPU, or copied, as claim-v2's
Fed-BC) are left out. Every cell trains in one process
as one batched model (``fedrl.federation.cells``: the DRPO family in one batch, Fed-BC in
another), each round evaluated in one vectorised pass spread over the machine's idle cores.

1. Measure: one batched DRPO step at the batch's size and one BC step, on the device, for a few
   seconds each: agent-steps/s.
2. Fit: from those rates, the most seeds (0, then 1, then 2: every method of a seed together)
   whose 20 rounds fit in the budget, less a margin for start-up, evaluation and packing. If not
   even one seed fits, the first seed runs until the budget ends (every round is checkpointed, and the
   plan says so: ``device.json``'s ``fits``).
3. Run, stopping before a round that would end after the budget.
4. Pack: each finished cell's result in the harness's format, every cell's ``rounds.jsonl``, the
   rates, the plan and the machine into ``DIR/paper-device.tgz`` (and ``DIR/device.json``).

``unpack`` puts finished cells in ``benchmarks/results/paper-PRESET/table/`` and unfinished cells'
rows in ``benchmarks/results/paper-PRESET/partial-device/``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import shutil
import sys
import tarfile
import time
from pathlib import Path

from benchmarks.common import ROOT
from benchmarks.paper.cells import cell_result
from benchmarks.paper.presets import PRESETS, planned, result_path, sim_config

METHODS = ("drpo", "fed-cql", "cql", "fed-bc")
MARGIN_S = 45.0  # start-up (data, CUDA), the first round's evaluation beyond the estimate, packing


def log(msg: str) -> None:
    print(f"{time.strftime('%H:%M:%S')} {msg}", flush=True)


def preset(tiny: bool, name: str = "paper"):
    if tiny:  # the CPU check of the whole path: smoke sizes, 2 agents x 2 rounds x 5 local steps
        return dataclasses.replace(PRESETS["smoke"], agents=2, rounds=2, local_steps=5, eval_episodes=2)
    if name == "paper":  # the paper's agents and rounds, agents holding whole episodes as the claim's
        return dataclasses.replace(PRESETS["paper"], transitions=5000, eval_episodes=10)
    if name not in PRESETS:
        raise SystemExit(f"--preset: no preset {name!r} (presets: {', '.join(PRESETS)})")
    return PRESETS[name]


def plan_cells(p, dataset: str, seeds: tuple[int, ...], device: str, done_in: Path | None = None):
    """The harness's RunSpecs for the column and their cells (``fedrl.federation.cells.Cell``):
    the cells the preset plans (``presets.planned``: a method's added seeds too, as the verdict's
    seeds 3-4 of DRPO with the gradient stop) at ``seeds``, less those whose result ``done_in``
    already holds. A seed the preset plans no cell at is not made up here."""
    from fedrl.federation.cells import Cell

    # every column of the preset's table, a named variant's too (the verdict's and the held-out
    # preset's DRPO with the gradient stop): it is the same algorithm with other hyperparameters
    specs = [r for r in planned(p, "table") if r.seed in seeds and r.datasets == (dataset,) and r.algo in METHODS]
    if not specs:
        raise SystemExit(f"no cells of {dataset} at seeds {','.join(map(str, seeds))} in the {p.name} preset's table")
    if done_in is not None:
        done = [r.key for r in specs if result_path(p, r, done_in).exists()]
        if done:
            log(f"already in {done_in}: {', '.join(done)}")
        specs = [r for r in specs if r.key not in done]
        if not specs:
            raise SystemExit(f"every cell of {dataset} in the {p.name} preset's table is already in {done_in}")
    return specs, [Cell(r.key, sim_config(p, r, device)) for r in specs]


def measure(cells, device: str, seconds: float) -> dict:
    """Agent-steps/s of the column's two batches (the DRPO family's members, Fed-BC's)."""
    import numpy as np
    import torch

    from benchmarks.common import synthetic_transitions, sync
    from fedrl.algos.batched import build_batched
    from fedrl.data.buffer import StackedBuffer, TensorBuffer
    from fedrl.federation.round import algo_config, returns_gamma

    dev = torch.device(device)
    out = {}
    for kind in ("drpo", "bc"):
        cfgs = [algo_config(c.cfg.algo, c.cfg.drpo, c.cfg.bc) for c in cells
                for _ in range(c.cfg.agents) if (c.cfg.algo == "fed-bc") == (kind == "bc")]
        if not cfgs:
            continue
        learner = build_batched(cfgs, 11, 3, dev, torch.Generator(device=dev).manual_seed(0))
        one = TensorBuffer(synthetic_transitions(11, 3), np.zeros(11, np.float32), np.ones(11, np.float32), dev,
                           max((returns_gamma(c) or 0.0 for c in cfgs), default=0.0) or None)  # any member's
        buf, gen = StackedBuffer([one] * len(cfgs)), torch.Generator(device=dev).manual_seed(1)
        for _ in range(3):
            learner.update(buf.sample(cfgs[0].batch_size, gen))
        sync(dev)
        n, t0 = 0, time.perf_counter()
        while n < 3 or time.perf_counter() - t0 < seconds:
            learner.update(buf.sample(cfgs[0].batch_size, gen))
            n += 1
        sync(dev)
        steps_s = n / (time.perf_counter() - t0)
        out[kind] = {"members": len(cfgs), "steps_per_s": steps_s, "agent_steps_per_s": steps_s * len(cfgs)}
        del learner, buf
    return out


def round_seconds(rates: dict, cells, local_steps: int) -> float:
    """One round's training at the measured rates (the batches run one after the other)."""
    s = 0.0
    for kind, r in rates.items():
        members = sum(c.cfg.agents for c in cells if (c.cfg.algo == "fed-bc") == (kind == "bc"))
        if members:  # the rate at the measured size; a smaller batch is taken as no faster per step
            s += local_steps / r["steps_per_s"]
    return s


def cmd_run(a) -> int:
    import torch

    from fedrl.common.device import resolve_device
    from fedrl.federation.cells import run_cells

    t_start = time.time()
    deadline = t_start + a.budget
    device = str(resolve_device(a.device))
    torch.set_num_threads(1 if device.startswith("cuda") else max(1, a.threads))
    p = preset(a.tiny, a.preset)
    seeds = tuple(int(s) for s in a.seeds.split(","))
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    work = out / "work"
    done_in = Path(a.results) if a.results else None if a.tiny else ROOT / "benchmarks" / "results"
    dataset = a.dataset or p.datasets[0]
    specs, cells = plan_cells(p, dataset, seeds, device, done_in)
    seeds = tuple(s for s in seeds if any(r.seed == s for r in specs))  # those with a cell left to run
    log(f"{len(cells)} cells planned on {device}: {', '.join(c.key for c in cells)}")
    rates = measure(cells, device, a.measure_seconds)
    for kind, r in rates.items():
        log(f"measured {kind}: batch of {r['members']}, {r['agent_steps_per_s']:.0f} agent-steps/s")
    # fit: the most seeds whose rounds fit in what is left
    left = deadline - time.time() - a.margin
    chosen, est = (), 0.0
    for k in range(len(seeds), 0, -1):
        sub = [c for c in cells if int(c.key.rsplit("-s", 1)[1]) in seeds[:k]]
        est = round_seconds(rates, sub, p.local_steps) * p.rounds
        if est <= left:
            chosen = seeds[:k]
            break
    fits = bool(chosen)
    if not fits:
        chosen = seeds[:1]
        log(f"the column does not fit: one seed needs ~{est:.0f}s of training, {left:.0f}s are left; "
            f"running seed {chosen[0]} until the budget ends")
    else:
        log(f"running seeds {','.join(map(str, chosen))}: ~{est:.0f}s of training estimated, {left:.0f}s left")
    run_specs = [s for s in specs if s.seed in chosen]
    run_cells_ = [c for c in cells if int(c.key.rsplit("-s", 1)[1]) in chosen]
    hint = round_seconds(rates, run_cells_, p.local_steps)
    t_run = time.time()
    results = run_cells(run_cells_, work, log=log, deadline=deadline - a.pack_seconds, round_seconds_hint=hint,
                        eval_workers=a.eval_workers)
    wall = time.time() - t_run
    table = out / "results" / f"paper-{p.name}" / "table"
    partial = out / "results" / f"paper-{p.name}" / "partial-device"
    for spec, cell in zip(run_specs, run_cells_):
        res = results[cell.key] | {"rounds_jsonl": work / cell.key / "rounds.jsonl"}
        if res["finished"]:
            table.mkdir(parents=True, exist_ok=True)
            (table / f"{spec.key}.json").write_text(json.dumps(cell_result(p, spec, cell, res, wall, device), indent=1))
        else:
            partial.mkdir(parents=True, exist_ok=True)
            shutil.copy(res["rounds_jsonl"], partial / f"{spec.key}.rounds.jsonl")
    info = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "device": device,
            "device_name": torch.cuda.get_device_name(0) if device.startswith("cuda") else platform.processor(),
            "torch": torch.__version__, "budget_s": a.budget, "dataset": dataset, "preset": p.name,
            "seeds_planned": list(seeds), "seeds_run": list(chosen), "fits": fits, "rates": rates,
            "estimated_training_s": est, "run_seconds": round(wall, 1),
            "cells": {c.key: {"rounds_done": results[c.key]["rounds_done"], "finished": results[c.key]["finished"],
                              "final_score": (results[c.key]["final"] or {}).get("score_mean")} for c in run_cells_},
            "total_seconds": round(time.time() - t_start, 1)}
    (out / "device.json").write_text(json.dumps(info, indent=1))
    with tarfile.open(out / "paper-device.tgz", "w:gz") as tar:
        tar.add(out / "device.json", "device.json")
        if (out / "results").exists():
            tar.add(out / "results", "results")
        for c in run_cells_:
            tar.add(work / c.key / "rounds.jsonl", f"rounds/{c.key}.rounds.jsonl")
    log(f"packed {out / 'paper-device.tgz'}: " + ", ".join(f"{k} {'done' if v['finished'] else v['rounds_done']}"
                                                          for k, v in info["cells"].items()))
    return 0


def cmd_unpack(a) -> int:
    """Copy a pack's finished cells and partial rows into ``benchmarks/results``."""
    dest = Path(a.dest)
    with tarfile.open(a.file) as tar:
        names = [m for m in tar.getmembers() if m.isfile() and m.name.startswith("results/")
                 and ".." not in Path(m.name).parts]
        for m in names:
            target = dest / Path(m.name).relative_to("results")
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(tar.extractfile(m).read())
            print(f"unpacked {target}")
        info = json.loads(tar.extractfile("device.json").read())
    (dest / f"paper-{info['preset']}" / "device-paper.json").write_text(json.dumps(info, indent=1))
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.paper.device", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--budget", type=float, default=540.0, help="seconds this call may take in all (default 540)")
    r.add_argument("--out", required=True)
    r.add_argument("--preset", default="paper",
                   help="benchmarks.paper preset whose table column runs (default paper: its agents and rounds, "
                        "agents holding ~5,000 transitions; claim-v2: the claim at today's defaults; verdict, "
                        "heldout-walker2d: their cells not yet in --results)")
    r.add_argument("--results", default=None,
                   help="cells whose result file this folder holds are left out (default benchmarks/results; "
                        "with --tiny, none)")
    r.add_argument("--dataset", default=None, help="the column's dataset (default: the preset's first)")
    r.add_argument("--seeds", default="0,1,2")
    r.add_argument("--device", default="auto")
    r.add_argument("--tiny", action="store_true", help="2 agents x 2 rounds x 5 steps, small networks (the CPU check)")
    r.add_argument("--measure-seconds", type=float, default=8.0)
    r.add_argument("--margin", type=float, default=MARGIN_S)
    r.add_argument("--pack-seconds", type=float, default=15.0)
    r.add_argument("--eval-workers", type=int, default=max(1, (os.cpu_count() or 2) - 1))
    r.add_argument("--threads", type=int, default=1, help="torch threads on the CPU")
    r.set_defaults(func=cmd_run)
    u = sub.add_parser("unpack")
    u.add_argument("file")
    u.add_argument("--dest", default=str(ROOT / "benchmarks" / "results"))
    u.set_defaults(func=cmd_unpack)
    a = ap.parse_args(argv)
    return a.func(a)


if __name__ == "__main__":
    sys.exit(main())
