"""Why the critic's Q on the data sinks below zero on walker2d-medium (issue 53): measured, not guessed.

    python -m benchmarks.studies.critic_sink run [--cells base|causes|all|candidates] [--dataset D] [--only A,B]
    python -m benchmarks.studies.critic_sink cycle [--steps 5000]
    python -m benchmarks.studies.critic_sink report

The setting the issue found it in, on the project's own ``walker2d-medium-v2``: 2 agents x 5
trajectories, 1,000 local steps x 5 rounds, the current defaults. Cells (each a run of
``fedrl.federation.cells``, trained together as one batched model, one torch thread):

- ``base``: DRPO, Fed-CQL, and CQL alone (each agent on its own shard: a learner effect shows
  here, a federation effect does not);
- ``causes``: DRPO with one candidate cause changed at a time (``--only`` picks some): the temperature's rate
  (``alpha_lr`` 3e-4), the TD target's action (``mean``, d3rlpy's), the CQL weight relative to
  the reward scale (``cql_weight`` 5), the TD weight (``td_weight`` 1), the critic's rate
  (``critic_lr`` 1e-4), and the actor's Adam kept across rounds (``reset_actor_optimizer`` off);
- ``candidates``: DRPO at today's defaults and at candidate defaults (the mean target action,
  beta 5, both; Cal-QL's calibration of the penalty by the data's returns), on ``--dataset`` (walker2d-medium or hopper-medium); files are named
  ``<dataset's task>-<cell>``.

Every round records, per agent, its diagnostics' means over every 100 local steps (``trace``):
Q on the data, Q at the TD target's action (``q_target_action``), the targets
(``td_target``), the CQL penalty's pushed-down side (``cql_logsumexp``) beside ``q_data``, the TD
error, the temperature and the policy's entropy. Results: ``benchmarks/results/critic_sink/``,
one file per cell, written when the cells finish; every round is checkpointed in ``--work``, and
the same command resumes a stopped run.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from pathlib import Path

import numpy as np

from benchmarks.common import ROOT

RESULTS = ROOT / "benchmarks" / "results" / "critic_sink"
DATASET = "walker2d-medium-v2"
CHOICES_MD = ROOT / "docs" / "explanation" / "choices.md"
SINK_MD = ROOT / "docs" / "explanation" / "critic-sink.md"
CAUSES = {"alpha_lr_3e-4": {"alpha_lr": 3e-4}, "target_mean": {"target_action": "mean"},
          "cql_weight_5": {"cql_weight": 5.0}, "td_weight_1": {"td_weight": 1.0},
          "critic_lr_1e-4": {"critic_lr": 1e-4}, "actor_adam_kept": {"reset_actor_optimizer": False}}
# Candidate defaults, each from today's defaults (the temperature's rate already 3e-4), on either task
# "now": the penalty as written at today's other defaults (the candidates were measured against it;
# pinned, since "returns-gradient" became the default)
CANDIDATES = {"now": {"cql_calibration": "none"}, "now-target_mean": {"target_action": "mean"}, "now-cql_weight_5": {"cql_weight": 5.0},
              "now-target_mean-cql_weight_5": {"target_action": "mean", "cql_weight": 5.0},
              "now-calibrated": {"cql_calibration": "returns"},
              "now-calibrated-gradient": {"cql_calibration": "returns-gradient"},
              # the gradient stop with the actor's Q term scaled to 2.5 / mean|Q| (TD3+BC): does the
              # data regulariser's shrinking share of the actor loss, as Q grows, cost walker2d its return?
              "now-calibrated-gradient-q_normalized": {"cql_calibration": "returns-gradient", "q_scale": "normalized"}}
DATASETS = ("walker2d-medium-v2", "hopper-medium-v2")
TRACE_EVERY = 100


def _issue_defaults():
    """The defaults the issue found the sinking with (the temperature's rate then 3e-5): every
    cell here keeps them, so a cause is the one setting changed."""
    from fedrl.algos import DRPOConfig

    return dataclasses.replace(DRPOConfig(), alpha_lr=3e-5)


def cells(which: str, only: tuple[str, ...] = (), dataset: str = DATASET, seed: int = 0):
    from fedrl.algos import DRPOConfig
    from fedrl.federation.cells import Cell
    from fedrl.federation.simulate import SimConfig

    ISSUE_DEFAULTS = _issue_defaults()
    base = dict(datasets=(dataset,), agents=2, trajectories=5, rounds=5, local_steps=1000, eval_episodes=10,
                seed=seed, device="cpu")
    out = []
    if which in ("base", "all"):
        out += [Cell(a, SimConfig(algo=a, drpo=ISSUE_DEFAULTS, **base)) for a in ("drpo", "fed-cql", "cql")]
    if which in ("causes", "all"):
        out += [Cell(f"drpo-{k}", SimConfig(algo="drpo", drpo=dataclasses.replace(ISSUE_DEFAULTS, **v), **base))
                for k, v in CAUSES.items() if not only or k in only]
    if which == "candidates":
        task = dataset.split("-")[0]
        out += [Cell(f"{task}-drpo-{k}" + (f"-s{seed}" if seed else ""), SimConfig(algo="drpo", drpo=dataclasses.replace(DRPOConfig(), **v), **base))
                for k, v in CANDIDATES.items() if not only or k in only]
    return out


def cmd_run(a) -> int:
    import torch

    from fedrl.federation.cells import run_cells

    torch.set_num_threads(1)
    only = tuple(x for x in a.only.split(",") if x)
    names = CANDIDATES if a.cells == "candidates" else CAUSES
    unknown = set(only) - set(names)
    if unknown:
        raise SystemExit(f"--only: no cell {', '.join(sorted(unknown))} (with --cells {a.cells}: {', '.join(names)})")
    if (a.dataset != DATASET or a.seed) and a.cells != "candidates":
        raise SystemExit("--dataset, --seed: only with --cells candidates (the other cells are the issue's walker2d "
                         "setting, seed 0)")
    cs = cells(a.cells, only, a.dataset, a.seed)
    work = Path(a.work) / (a.cells + (f"-{a.dataset}" if a.cells == "candidates" else "")
                           + ("-" + "-".join(only) if only else "") + (f"-s{a.seed}" if a.seed else ""))
    res = run_cells(cs, work, log=lambda m: print(m, flush=True), trace_every=TRACE_EVERY)
    RESULTS.mkdir(parents=True, exist_ok=True)
    for c in cs:
        rows = [json.loads(x) for x in (work / c.key / "rounds.jsonl").read_text().splitlines()]
        (RESULTS / f"{c.key}.json").write_text(json.dumps({
            "key": c.key, "dataset": a.dataset, "config": c.cfg.as_dict(), "trace_every": TRACE_EVERY,
            "rounds": rows, "curve": res[c.key]["curve"], "data_return": res[c.key]["data_return"],
            "finished": res[c.key]["finished"]}, indent=1))
    return 0


# -- the cycle: a problem whose values are known (tests/unit/test_critic_values.py) ---------------
CYCLE = dict(states=3, act_dim=6, horizon=60, gamma=0.9, steps=1000, round_steps=1000)


CYCLE_VARIANTS = {"uncalibrated": {"cql_calibration": "none"}, "calibrated": {"cql_calibration": "returns"},
                  "uncalibrated-mean-target": {"cql_calibration": "none", "target_action": "mean"},
                  "calibrated-gradient": {"cql_calibration": "returns-gradient"}}


def cycle_data(episodes: int = 30, seed: int = 0):
    """A 3-state cycle whose every reward is 1 and which never terminates: every policy's value is
    1 / (1 - gamma) = 10 at gamma 0.9, whatever the action. The data's actions are narrow (a fixed
    action per state in 6 dimensions, noise 0.1), as a small offline set's are; its trajectories are
    cut by timeouts after 60 steps, so every discounted return-to-go lies in [1, 10)."""
    from fedrl.data.d4rl import Transitions

    S, A, T = CYCLE["states"], CYCLE["act_dim"], CYCLE["horizon"]
    rng = np.random.default_rng(seed)
    centers = rng.uniform(-0.6, 0.6, (S, A))
    k = ((np.arange(T)[None, :] + rng.integers(S, size=(episodes, 1))) % S).reshape(-1)
    eye = np.eye(S, dtype=np.float32)
    acts = np.clip(centers[k] + 0.1 * rng.normal(size=(len(k), A)), -0.99, 0.99)
    return Transitions(eye[k], acts.astype(np.float32), np.ones(len(k), np.float32), eye[(k + 1) % S],
                       np.zeros(len(k), np.float32), np.repeat(np.arange(episodes), T))


def cycle_q(cfg, steps: int = CYCLE["steps"], every: int = 0, round_steps: int = CYCLE["round_steps"]) -> dict:
    """Train one learner ``steps`` steps on the cycle, as a federation of one agent: every
    ``round_steps`` (the paper's 1,000 local steps) it begins a round from its own policy, so pi_bar
    is the last round's policy, as FedAvg of one policy gives (in the first round it is the initial
    policy, as in every federation). Its mean Q on the data at the end (every ``every`` steps too),
    the lowest it read (checked every 100 steps), and the data's least return-to-go."""
    import torch

    from fedrl.data.buffer import TensorBuffer
    from fedrl.federation.round import build_learner, returns_gamma

    S, A = CYCLE["states"], CYCLE["act_dim"]
    tr = cycle_data()
    buf = TensorBuffer(tr, np.zeros(S), np.ones(S), torch.device("cpu"), returns_gamma(cfg))
    ln = build_learner(cfg, S, A, torch.device("cpu"), 0, 1)
    g = torch.Generator().manual_seed(3)
    curve, lowest = [], math.inf
    for i in range(steps):
        if i and i % round_steps == 0:
            ln.begin_round(ln.shared_state())
        ln.update(buf.sample(cfg.batch_size, g))
        if (i + 1) % 100 == 0 or (every and (i + 1) % every == 0):
            with torch.no_grad():
                q = ln.critic(buf.obs, buf.actions).mean().item()
            lowest = min(lowest, q)
            if every and (i + 1) % every == 0:
                curve.append(round(q, 2))
    with torch.no_grad():
        q = ln.critic(buf.obs, buf.actions).mean().item()
    return {"q_data": q, "curve": curve, "lowest": round(min(lowest, q), 2),
            "least_return": float(tr.returns_to_go(cfg.gamma).min()), "true_value": 1.0 / (1.0 - cfg.gamma)}


def cmd_cycle(a) -> int:
    """The cycle at 5,000 steps, Q on the data every 1,000: calibrated or not, sampled or mean
    target, DRPO and CQL; ``results/critic_sink/cycle.json``."""
    import torch

    from fedrl.algos import DRPOConfig, cql_config

    torch.set_num_threads(1)
    base = DRPOConfig(hidden=(64, 64), gamma=CYCLE["gamma"])
    only = [x for x in a.only.split(",") if x]
    unknown = set(only) - set(CYCLE_VARIANTS)
    if unknown:
        raise SystemExit(f"--only: no variant {', '.join(sorted(unknown))} (variants: {', '.join(CYCLE_VARIANTS)})")
    out = {"setting": CYCLE, "steps": a.steps, "rows": []}
    old = RESULTS / "cycle.json"
    if only and old.exists():  # the other variants' rows, when they ran the same setting
        prev = json.loads(old.read_text())
        if prev["setting"] == CYCLE and prev["steps"] == a.steps:
            out["rows"] = [r for r in prev["rows"] if r["variant"] not in only]
    for name, kw in CYCLE_VARIANTS.items():
        if only and name not in only:
            continue
        for algo in ("drpo", "cql"):
            cfg = dataclasses.replace(base, **kw)
            cfg = cql_config(cfg) if algo == "cql" else cfg
            r = cycle_q(cfg, a.steps, a.steps // 5)
            out["rows"].append({"variant": name, "algo": algo, **r})
            print(f"{name:26s} {algo:5s} Q on the data every {a.steps // 5}: {r['curve']}", flush=True)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "cycle.json").write_text(json.dumps(out, indent=1) + "\n")
    return 0


def cycle_md(results: Path = RESULTS) -> str:
    r = json.loads((Path(results) / "cycle.json").read_text())
    n = r["steps"] // 5
    lines = [f"| variant | learner | Q on the data at {', '.join(str(n * i) for i in range(1, 6))} steps | lowest |",
             "| --- | --- | --- | --- |"]
    for row in r["rows"]:
        lines.append(f"| {row['variant']} | {row['algo']} | {' / '.join(f'{q:.1f}' for q in row['curve'])} | "
                     f"{row['lowest']:.1f} |")
    return "\n".join(lines)


def candidates_md(results: Path = RESULTS) -> str:
    """One row per candidate cell (``--cells candidates``): Q on the data and the return by round."""
    lines = ["| task | cell | seed | Q on the data by round | return by round |", "| --- | --- | --- | --- | --- |"]
    files = sorted(Path(results).glob("*-drpo-now*.json"))
    same = Path(results) / "drpo-alpha_lr_3e-4.json"  # walker2d at today's defaults, run as a cause
    if same.exists() and not (Path(results) / "walker2d-drpo-now.json").exists():
        files.append(same)
    for f in files:
        r = json.loads(f.read_text())
        task, cell = r["key"].split("-", 1) if r["key"] != "drpo-alpha_lr_3e-4" else ("walker2d", "drpo-now (cause alpha_lr_3e-4)")
        seed = r["config"]["seed"]
        cell = cell.removesuffix(f"-s{seed}")
        rows = summary(r)
        lines.append(f"| {task} | {cell} | {seed} | {' / '.join(format(x['q_data'], '.1f') for x in rows)} | "
                     f"{' / '.join(str(round(x['return'])) for x in rows)} |")
    return "\n".join(lines)


def choices_blocks(results: Path = RESULTS) -> dict[str, str]:
    """docs/explanation/choices.md's blocks."""
    return {"critic-candidates": candidates_md(results), "critic-cycle": cycle_md(results)}


def summary(r: dict) -> list[dict]:
    """Per round: mean over agents of the round's mean diagnostics, and the evaluation."""
    out = []
    for row in r["rounds"]:
        ag = row["agents"]
        keys = ("q_data", "q_target_action", "td_target", "cql_logsumexp", "critic_td", "alpha", "entropy")
        s = {k: float(np.mean([x[k] for x in ag])) for k in keys if k in ag[0]}
        s["round"] = row["round"]
        s["return"] = row.get("eval", {}).get("return_mean")
        out.append(s)
    return out


def report_md(results: Path = RESULTS) -> str:
    """Per cell and round: the round's mean diagnostics over its agents and the evaluation."""
    lines = ["| cell | round | Q on data | Q at target action | TD target | CQL log-sum-exp | TD error | alpha | entropy | return |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for f in sorted(Path(results).glob("*.json")):
        if f.name == "cycle.json":
            continue
        r = json.loads(f.read_text())
        for s in summary(r):
            ret = s["return"]
            lines.append(f"| {r['key']} | {s['round']} | {s['q_data']:.1f} | {s['q_target_action']:.1f} | "
                         f"{s['td_target']:.1f} | {s['cql_logsumexp']:.1f} | {s['critic_td']:.1f} | {s['alpha']:.3f} | "
                         f"{s['entropy']:.2f} | {ret if ret is None else round(ret)} |")
    return "\n".join(lines)


def cmd_report(a) -> int:
    md = report_md()
    if a.update_md:
        from benchmarks.common import replace_blocks

        SINK_MD.write_text(replace_blocks(SINK_MD.read_text(), {"critic-sink": md}))
        CHOICES_MD.write_text(replace_blocks(CHOICES_MD.read_text(), choices_blocks()))
    print(md)
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.studies.critic_sink", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--cells", choices=("base", "causes", "all", "candidates"), default="base")
    r.add_argument("--dataset", choices=DATASETS, default=DATASET, help="with --cells candidates")
    r.add_argument("--seed", type=int, default=0, help="with --cells candidates (default 0; others keep 0)")
    r.add_argument("--work", default=str(ROOT / "runs" / "critic_sink"))
    r.add_argument("--only", default="", help=f"with --cells causes: these of {', '.join(CAUSES)}; "
                                              f"with candidates: of {', '.join(CANDIDATES)}")
    r.set_defaults(func=cmd_run)
    c = sub.add_parser("cycle", help="the 3-state cycle whose values are known: calibrated or not")
    c.add_argument("--steps", type=int, default=5000)
    c.add_argument("--only", default="", help=f"comma-separated variants of {', '.join(CYCLE_VARIANTS)} (default: all); "
                                              "the file keeps the other variants' rows at the same --steps")
    c.set_defaults(func=cmd_cycle)
    p = sub.add_parser("report")
    p.add_argument("--update-md", action="store_true",
                   help="also write the blocks of docs/explanation/critic-sink.md and choices.md")
    p.set_defaults(func=cmd_report)
    a = ap.parse_args(argv)
    return a.func(a)


if __name__ == "__main__":
    sys.exit(main())
