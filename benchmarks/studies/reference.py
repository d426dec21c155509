"""Our learners beside an independent implementation (d3rlpy) on the same data, same settings.

    python -m benchmarks.studies.reference run    [--runs cql-ours-5traj,...|all] [--seeds 0,1] [--steps 20000] [--jobs 2]
    python -m benchmarks.studies.reference status
    python -m benchmarks.studies.reference render (curves PNG + tables.md + the BENCHMARKS.md block)
    python -m benchmarks.studies.reference check  [--runs ...] [--steps 2000]  (rerun, compare with the committed rows)

Learners (``LEARNERS``): our single-agent CQL (``cql_config`` of the project's defaults), the same
with the earlier ``td_weight=1`` (half CORL's and d3rlpy's TD term), d3rlpy 2.8.1's CQL set to the
same hyperparameters (actor/critic/temperature lr 3e-5/3e-4/3e-5, batch 256, 2 x 256 ReLU
networks, gamma 0.99, tau 5e-3, twin critics, 10 sampled actions of each kind, auto temperature
from 1.0 to -|A|, a *fixed* CQL weight 10: d3rlpy's Lagrangian on it is switched off with
``alpha_learning_rate=0``); our BC (tanh-Gaussian NLL, the default), ours with the squared error
of tanh(mu) (d3rlpy's loss), and d3rlpy's deterministic BC, all at one learning rate.

What is the same by construction: the data (the transitions ``fedrl`` trains on, observations
standardised once with the data's mean/std for both, so neither library's scaler is in play) and
every minibatch (indices drawn from one seeded generator, fed to both: d3rlpy's update is called
directly with a ``TorchMiniBatch``). What is each library's own: initialisation, the update's
order and maths. Known differences of d3rlpy's CQL kept as they are (it is the reference): the TD
target's next action is the policy's mean (ours samples), the critic steps before the actor
within an update, the log-std clamp is [-20, 2] (ours [-5, 2]).

Every ``--every`` steps (default 1,000) a run records: mean Q on the data (mean of the twin
critics over the data's transitions, or a fixed 10,000 of them for a large file), the policy's
mean NLL of the data actions (``-log pi(a_D|s)``, the same code for both), the temperature, and
the evaluated return of the deterministic policy (``fedrl.envs.evaluation.evaluate``, 10 episodes,
fixed seed, for both: d3rlpy's policy is copied into our policy class). Beside them the data's
own discounted return-to-go (Monte-Carlo, gamma 0.99), what Q on the data estimates for the
behaviour policy.

Resumable: training runs in chunks of ``--every`` steps in a worker process (d3rlpy's in its own
virtual environment, ``benchmarks/.venv-d3rlpy``, made on first use: d3rlpy pins gymnasium 1.0.0,
which this project's environment does not have), each ending with a checkpoint under
``runs/reference/``; the result file ``benchmarks/results/reference/<run>.json`` gets a row per
chunk. A stopped run continues from its last row (bit-identically for ours, which restores its RNG);
where its checkpoint is gone (``runs/`` is not committed: another machine, a new session), the
recorded rows are recomputed in the same chunks and each is checked against the record first.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.common import ROOT
from benchmarks.studies.reference_worker import (
    D3RLPY_PIN,
    DATA,
    DATASET,
    DEFAULT_RUNS,
    EVAL_EPISODES,
    LABEL,
    LEARNERS,
    RESULTS,
    VENV,
    WORK,
    prepare_data,
    shared_settings,
    split_run,
)

# -- the driver (project environment) ---------------------------------------------------------
def ensure_venv() -> Path:
    """The d3rlpy virtual environment (made once: this project's torch wheel + d3rlpy)."""
    import torch

    from benchmarks.common import ensure_venv

    return ensure_venv(VENV, "d3rlpy, safetensors",
                       [f"torch=={torch.__version__.split('+')[0]}", D3RLPY_PIN, "safetensors"], D3RLPY_PIN)


def result_path(run: str, seed: int, results: Path = RESULTS) -> Path:
    return results / f"{run}-s{seed}.json"


def evaluate_snapshot(home: Path, seed: int) -> dict[str, float]:
    import torch
    from safetensors import safe_open
    from safetensors.torch import load_file

    from fedrl.algos.nets import TanhGaussianPolicy
    from fedrl.envs.evaluation import evaluate

    path = home / "policy.safetensors"
    with safe_open(str(path), "pt") as f:
        meta = f.metadata()
    st = load_file(str(path))
    act_dim = st["head.bias"].shape[0] // 2
    pol = TanhGaussianPolicy(st["obs_mean"].shape[0], act_dim, json.loads(meta["hidden"]),
                             log_std_min=float(meta["log_std_min"]))
    pol.load_state_dict(st)
    torch.set_num_threads(1)
    e = evaluate(pol, "Hopper-v5", EVAL_EPISODES, seed=10_000 + seed)
    return {"return_mean": round(e.return_mean, 1), "return_std": round(e.return_std, 1),
            "score_mean": round(e.score_mean, 2)}


def drive(run: str, seed: int, steps: int, every: int, results: Path = RESULTS, work: Path = WORK) -> dict[str, Any]:
    """Advance one run to ``steps`` in chunks of ``every``, recording a row per chunk."""
    from benchmarks.common import code_revision

    learner, data = split_run(run)
    algo, impl, over = LEARNERS[learner]
    path = result_path(run, seed, results)
    npz = np.load(prepare_data(data, work))
    settings = shared_settings()
    if path.exists():
        res = json.loads(path.read_text())
    else:
        res = {"run": run, "learner": learner, "label": LABEL[learner], "algo": algo, "implementation": impl,
               "data": data, "dataset": DATASET, "trajectories": DATA[data] or int(npz["episodes"]),
               "transitions": int(len(npz["rewards"])), "seed": seed, "settings": settings, "overrides": over,
               "data_discounted_return": round(float(npz["mc_return"]), 2), "rows": []}
    rows = res["rows"]
    py = sys.executable if impl == "ours" else str(ensure_venv())
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}

    def chunk(until: int) -> dict[str, Any]:
        cmd = [py, "-m", "benchmarks.studies.reference_worker", "--run", run, "--seed", str(seed), "--until", str(until),
               "--settings", json.dumps(res["settings"]), "--work", str(work)]
        p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env)
        if p.returncode != 0:
            raise RuntimeError(f"{run} s{seed}: worker failed:\n{p.stderr[-3000:]}")
        m = json.loads(p.stdout.strip().splitlines()[-1])
        if m["step"] != until:
            raise RuntimeError(f"{run} s{seed}: worker stopped at {m['step']}, asked for {until}")
        return m | evaluate_snapshot(work / f"{run}-s{seed}", seed)

    step = rows[-1]["step"] if rows else 0
    if rows and not (work / f"{run}-s{seed}" / "checkpoint.pt").exists():
        # Recorded rows but no checkpoint (another machine, or its work folder was lost): retrain
        # from step 0 in the same chunks, checking each recorded row on the way (the runs are
        # deterministic), then go on from the last one.
        print(f"{run} s{seed}: no checkpoint for its {step} recorded steps; recomputing them", flush=True)
        for old in rows:
            m = chunk(old["step"])
            diffs = {k: (m[k], old[k]) for k in ("q_data", "nll_data", "return_mean") if not _close(m[k], old[k])}
            print(f"{run} s{seed} step {old['step']}: " + (f"DIFFERS from the recorded row {diffs}" if diffs
                                                          else "same as recorded"), flush=True)
    t_start, step_start = time.monotonic(), step
    while step < steps:
        until = min(steps, step + every)
        m = chunk(until)
        rows.append(m)
        res["code_revision"] = code_revision()
        if impl == "d3rlpy":
            res["d3rlpy"] = D3RLPY_PIN
        tmp = path.with_suffix(".tmp")
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(res, indent=1))
        tmp.replace(path)
        step = until
        left = (time.monotonic() - t_start) / (step - step_start) * (steps - step)  # at this run's pace so far
        eta = f", {step}/{steps} steps, ETA {int(left // 60)} min" if step < steps else f", {step}/{steps} steps"
        print(f"{run} s{seed} step {step}: Q on data {m['q_data']:.1f}, NLL {m['nll_data']:.2f}, "
              f"return {m['return_mean']:.0f} (score {m['score_mean']:.1f}), {m['train_seconds']:.0f}s{eta}", flush=True)
    return res


def _drive_star(args):
    return drive(*args)


def cmd_check(a) -> int:
    """Rerun runs from step 0 to ``--steps`` in a scratch folder and compare every row with the
    committed file's: the committed curves are reproducible, not just recorded."""
    import tempfile

    bad = 0
    runs = tuple(a.runs.split(","))
    for r in runs:
        split_run(r)
    with tempfile.TemporaryDirectory() as tmp:
        for run in runs:
            for seed in (int(s) for s in a.seeds.split(",")):
                committed = json.loads(result_path(run, seed).read_text())
                every = committed["rows"][0]["step"]
                fresh = drive(run, seed, a.steps, every, Path(tmp) / "results", Path(tmp) / "work")
                for new, old in zip(fresh["rows"], committed["rows"]):
                    diffs = {k: (new[k], old[k]) for k in ("q_data", "nll_data", "return_mean")
                             if not _close(new[k], old[k])}
                    print(f"{run} s{seed} step {new['step']}: " + (f"DIFFERS {diffs}" if diffs else "same as committed"))
                    bad += bool(diffs)
    return 1 if bad else 0


def _close(a: float, b: float) -> bool:
    """Equal up to float rounding (NaN equals NaN: a metric a learner does not have)."""
    return (np.isnan(a) and np.isnan(b)) or abs(a - b) <= 1e-3 * max(1.0, abs(b))


def cmd_run(a) -> int:
    runs = DEFAULT_RUNS if a.runs == "all" else tuple(a.runs.split(","))
    for r in runs:
        split_run(r)
    seeds = [int(s) for s in a.seeds.split(",")]
    todo = [(r, s, a.steps, a.every) for s in seeds for r in runs]
    if a.jobs <= 1:
        for t in todo:
            drive(*t)
        return 0
    from fedrl.common.lifetime import child_pool

    with child_pool(a.jobs) as ex:
        list(ex.map(_drive_star, todo))
    return 0


def cmd_status(a) -> int:
    for f in sorted(RESULTS.glob("*.json")):
        r = json.loads(f.read_text())
        last = r["rows"][-1] if r["rows"] else {}
        print(f"{f.stem:28s} {last.get('step', 0):6d} steps  Q {last.get('q_data', float('nan')):7.1f}  "
              f"return {last.get('return_mean', float('nan')):6.0f}")
    return 0


def load_all() -> list[dict[str, Any]]:
    return [json.loads(f.read_text()) for f in sorted(RESULTS.glob("*.json"))]


def table_md(results: list[dict[str, Any]]) -> str:
    """Per learner and data, at each 5,000 steps: mean over seeds of Q on the data, NLL, return, and
    (CQL) the temperature."""
    out = []
    groups: dict[tuple[str, str], list] = {}
    for r in results:
        groups.setdefault((r["data"], r["learner"]), []).append(r)
    marks = (1000, 5000, 10000, 15000, 20000)
    out.append("| data | learner | seeds | " + " | ".join(f"{m // 1000}k: Q / NLL / return / alpha" for m in marks) + " |")
    out.append("| --- | --- | --- | " + " | ".join("---" for _ in marks) + " |")
    for (data, learner), rs in sorted(groups.items(), key=lambda kv: (kv[0][0], list(LEARNERS).index(kv[0][1]))):
        cells = []
        for m in marks:
            pts = [row for r in rs for row in r["rows"] if row["step"] == m]
            if not pts:
                cells.append("-")
                continue
            q = np.nanmean([p["q_data"] for p in pts]) if any(np.isfinite(p["q_data"]) for p in pts) else float("nan")
            nll = [p["nll_data"] for p in pts if np.isfinite(p["nll_data"])]
            ret = [p["return_mean"] for p in pts]
            temp = [p["temperature"] for p in pts if np.isfinite(p.get("temperature", float("nan")))]
            alpha = f" / {np.mean(temp):.2f}" if temp else " / -"
            qs = f"{q:.1f}" if np.isfinite(q) else "-"  # BC has no critic
            cells.append((f"{qs} / {np.mean(nll):.2f} / {np.mean(ret):.0f}" if nll else
                          f"{qs} / - / {np.mean(ret):.0f}") + alpha)
            cells[-1] += f" (n={len(pts)})" if len(pts) != len(rs) else ""
        mc = rs[0]["data_discounted_return"]
        alr = {(r["overrides"] or {}).get("alpha_lr", r["settings"]["alpha_lr"]) for r in rs}
        label = LABEL[learner] + (f" (alpha lr {', '.join(f'{x:g}' for x in sorted(alr))})"
                                  if rs[0]["algo"] == "cql" and "alr" not in learner else "")
        out.append(f"| {data} ({rs[0]['transitions']} transitions; data's discounted return {mc:.0f}) | "
                   f"{label} | {','.join(str(r['seed']) for r in rs)} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def curves_png(results: list[dict[str, Any]], path: Path) -> bool:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    datas = [d for d in DATA if any(r["data"] == d for r in results)]
    if not datas:
        return False
    fig, axes = plt.subplots(len(datas), 4, figsize=(20, 3.6 * len(datas)), squeeze=False)
    for row, data in zip(axes, datas):
        rs = [r for r in results if r["data"] == data and r["rows"]]
        for learner in LEARNERS:
            for r in (x for x in rs if x["learner"] == learner):
                steps = [p["step"] for p in r["rows"]]
                style = dict(color=f"C{list(LEARNERS).index(learner)}", alpha=0.9 if r["seed"] == 0 else 0.5,
                             label=f"{LABEL[learner]}" if r["seed"] == min(x["seed"] for x in rs if x["learner"] == learner)
                             else None)
                if r["algo"] == "cql":
                    row[0].plot(steps, [p["q_data"] for p in r["rows"]], **style)
                    row[3].plot(steps, [p.get("temperature", float("nan")) for p in r["rows"]], **style)
                if r["implementation"] == "ours" or r["algo"] == "cql":
                    row[1].plot(steps, [p["nll_data"] for p in r["rows"]], **style)
                row[2].plot(steps, [p["return_mean"] for p in r["rows"]], **style)
        if rs:
            row[0].axhline(rs[0]["data_discounted_return"], color="k", ls=":", label="data's discounted return")
        for ax, title in zip(row, ("mean Q on the data", "NLL of the data actions", "evaluated return (10 episodes)",
                                   "SAC temperature alpha (CQL)")):
            ax.set_title(f"{title}: {DATASET}, {data}", fontsize=9)
            ax.set_xlabel("gradient steps")
            ax.grid(alpha=0.3)
        row[0].legend(fontsize=7)
        row[2].legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=80, metadata={"Software": None})
    plt.close(fig)
    return True


def cmd_render(a) -> int:
    from benchmarks.common import BENCHMARKS_MD, replace_blocks

    results = load_all()
    md = table_md(results)
    (RESULTS / "tables.md").write_text(md + "\n")
    curves_png(results, RESULTS / "curves.png")
    if a.update_md:
        BENCHMARKS_MD.write_text(replace_blocks(BENCHMARKS_MD.read_text(), {"reference": md}))
    print(md)
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.studies.reference", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="train and record (resumes where each run stopped)")
    r.add_argument("--runs", default="all", help=f"comma-separated <learner>-<data> (default: all = {','.join(DEFAULT_RUNS)})")
    r.add_argument("--seeds", default="0,1")
    r.add_argument("--steps", type=int, default=20_000)
    r.add_argument("--every", type=int, default=1000, help="steps per recorded row and checkpoint (default 1000)")
    r.add_argument("--jobs", type=int, default=1, help="runs at once, one process and one thread each")
    r.set_defaults(func=cmd_run)
    s = sub.add_parser("status")
    s.set_defaults(func=cmd_status)
    d = sub.add_parser("render")
    d.add_argument("--no-update-md", dest="update_md", action="store_false")
    d.set_defaults(func=cmd_render)
    c = sub.add_parser("check", help="rerun from scratch to --steps and compare with the committed rows")
    c.add_argument("--runs", default="cql-ours-5traj,cql-d3rlpy-5traj")
    c.add_argument("--seeds", default="0")
    c.add_argument("--steps", type=int, default=2000)
    c.set_defaults(func=cmd_check)
    a = ap.parse_args(argv)
    if getattr(a, "steps", 1) < 1 or getattr(a, "every", 1) < 1:
        raise SystemExit("--steps and --every must be at least 1")
    return a.func(a)


if __name__ == "__main__":
    sys.exit(main())
