"""The cost of agent-level differential privacy on hopper-medium (issue 64): Fed-BC and DRPO
at noise multipliers that spend epsilon about 8, 4 and 1 at delta 1e-5 over each run's rounds,
beside the same runs without privacy.

    python -m benchmarks.studies.privacy_cost run [--only KEY,...]   # each cell in turn, one core
    python -m benchmarks.studies.privacy_cost status
    python -m benchmarks.studies.privacy_cost table                  # the markdown table of the results
    python -m benchmarks.studies.privacy_cost render                 # its blocks in docs/guides/privacy.md

The setting (stated, not tuned): hopper-medium-v2, 5 agents x 5 trajectories (at least 5,000
transitions each, the claim's data), 1,000 local steps a round, 10 evaluation episodes a round
and 50 for the final policy. Fed-BC: 10 rounds, seeds 0-2, clip C 2.0 (near the median update
norm of a run without privacy, 1.5-2.5; measured with ``fedrl simulate --set dp_clip=1000000``).
DRPO at today's defaults: 3 rounds, where its curves peaked in the claim at 10 rounds (a DRPO
step costs ~40x a BC step here), seed 0, clip C 1.0; its cell without privacy clips at 10^6 (no
cut) so that its update norms are recorded. Each agent clips its update; noise of std sigma x C
goes on the sum of the 5 (central DP; secure aggregation's distributed noise adds at least as
much). A cell takes ~6 min (Fed-BC) or ~45 min (DRPO) on one busy core; each is checkpointed
every round under ``runs/privacy-cost/`` and resumes there, and several workers can share the
list. Results: ``benchmarks/results/privacy-cost/<key>.json``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from typing import Any

import numpy as np

from benchmarks.common import ROOT

RESULTS = ROOT / "benchmarks" / "results" / "privacy-cost"
PRIVACY_MD = ROOT / "docs" / "guides" / "privacy.md"
WORK = ROOT / "runs" / "privacy-cost"
DELTA = 1e-5
# per method: rounds, local steps, clip, and the sigmas that spend epsilon ~8, ~4, ~1 at delta
# 1e-5 over its rounds with every agent in every round (dp-accounting's RDP), 0 = no privacy
SETTINGS = {"fed-bc": {"rounds": 10, "local_steps": 1000, "clip": 2.0, "sigmas": (0.0, 2.0, 3.6, 12.5),
                       "seeds": (0, 1, 2)},
            "drpo": {"rounds": 3, "local_steps": 1000, "clip": 1.0, "sigmas": (0.0, 1.1, 2.0, 7.0), "seeds": (0,)}}
NO_CUT = 1e6  # a cell without privacy still clips (at this, never reached) when it records update norms


def cells() -> list[dict[str, Any]]:
    """Every cell, seed 0 of every method and sigma first (the table's first full column)."""
    every = [{"key": f"{algo}-sigma{s:g}-s{seed}", "algo": algo, "sigma": s, "seed": seed, **st}
             for algo, st in SETTINGS.items() for s in st["sigmas"] for seed in st["seeds"]]
    return sorted(every, key=lambda c: c["seed"])


def sim_config(c: dict[str, Any]):
    from fedrl.federation.simulate import SimConfig

    if c["sigma"]:
        dp = {"dp_clip": c["clip"], "dp_noise": c["sigma"], "dp_delta": DELTA}
    else:
        dp = {"dp_clip": NO_CUT} if c["algo"] == "drpo" else {}
    return SimConfig(algo=c["algo"], datasets=("hopper-medium-v2",), agents=5, trajectories=5, transitions=5000,
                     rounds=c["rounds"], local_steps=c["local_steps"], eval_episodes=10, final_eval_episodes=50,
                     seed=c["seed"], device="cpu", **dp)


def execute(c: dict[str, Any]) -> dict[str, Any]:
    import torch

    from benchmarks.common import code_revision
    from fedrl.federation.simulate import run as simulate

    torch.set_num_threads(1)
    revision = code_revision()
    cfg = sim_config(c)
    work = WORK / c["key"]
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    summary = simulate(cfg, work, log=lambda m: print(f"{c['key']}: {m}", flush=True), checkpoint=True)
    rounds = [json.loads(line) for line in (work / "rounds.jsonl").read_text().splitlines()]
    out = {"key": c["key"], "algo": c["algo"], "sigma": c["sigma"], "seed": c["seed"], "clip": c["clip"],
           "config": cfg.as_dict(), "curve": summary["curve"], "final": summary["final"],
           "final_long": summary.get("final_long"),
           "privacy": [r.get("privacy") for r in rounds],
           "epsilon": (rounds[-1].get("privacy") or {}).get("epsilon") if c["sigma"] else None,
           "wall_seconds": round(time.perf_counter() - t0, 1), "code_revision": revision}
    RESULTS.mkdir(parents=True, exist_ok=True)
    tmp = RESULTS / f"{c['key']}.tmp"
    tmp.write_text(json.dumps(out, indent=1))
    tmp.replace(RESULTS / f"{c['key']}.json")
    shutil.rmtree(work, ignore_errors=True)
    return out


def _claim(key: str) -> bool:
    """Take cell ``key`` for this process, unless a live process holds it (its pid in the lock)."""
    import os

    lock = WORK / key / "worker.pid"
    lock.parent.mkdir(parents=True, exist_ok=True)
    try:
        pid = int(lock.read_text())
        if pid != os.getpid():
            os.kill(pid, 0)
            return False  # alive: its cell
    except (FileNotFoundError, ValueError, ProcessLookupError):
        pass
    lock.write_text(str(os.getpid()))
    return True


def load() -> list[dict[str, Any]]:
    return [json.loads(p.read_text()) for p in sorted(RESULTS.glob("*.json"))]


def _ms(xs: list[float]) -> str:
    if not xs:
        return "-"
    return f"{np.mean(xs):.1f} ± {np.std(xs):.1f}" if len(xs) > 1 else f"{xs[0]:.1f}"


def table_md(results: list[dict[str, Any]]) -> str:
    """Per algorithm and sigma: epsilon spent, the final score over 50 episodes, the mean of the
    last 3 rounds' scores (mean ± std over seeds), and the seeds done."""
    lines = ["| method | sigma | clip C | epsilon at delta 1e-5 | final (50 episodes) | mean of the last 3 rounds "
             "| seeds |", "|---|---|---|---|---|---|---|"]
    label = {"fed-bc": "Fed-BC", "drpo": "DRPO"}
    for algo, st in SETTINGS.items():
        for s in st["sigmas"]:
            rs = [r for r in results if r["algo"] == algo and r["sigma"] == s]
            if not rs:
                continue
            eps = "none (no privacy)" if not s else f"{rs[0]['epsilon']:.2f}"
            final = [r["final_long"]["score_mean"] for r in rs if r.get("final_long")]
            last = [float(np.mean([p["score_mean"] for p in r["curve"][-3:]])) for r in rs]
            lines.append(f"| {label[algo]} ({st['rounds']} x {st['local_steps']} steps) | {s:g} | "
                         f"{'-' if not s else st['clip']} | {eps} | {_ms(final)} | {_ms(last)} | "
                         f"{', '.join(str(r['seed']) for r in rs)} |")
    return "\n".join(lines)


def secagg_md() -> str:
    """What secure aggregation costs, from the committed results of ``benchmarks.system.services secagg``,
    ``benchmarks.system.secagg_peers`` and ``benchmarks.system.secagg_cost``."""
    res = RESULTS.parent
    sv = json.loads((res / "secagg-services.json").read_text())
    out = [f"- Our services (`{sv['command']}`, {sv['agents']} agent processes, Hopper's policy, zero local "
           f"steps, threshold {sv['threshold']}): {sv['secure_round_ms_median']:.0f} ms a round against "
           f"{sv['plain_round_ms_median']:.1f} ms without ({sv['ratio']:.1f}x); the aggregator's CPU "
           f"{sv['secure_cpu_ms_per_round_steady']['aggregator']:.0f} ms a round against "
           f"{sv['plain_cpu_ms_per_round_steady']['aggregator']:.0f}, each agent's "
           f"{sv['secure_cpu_ms_per_round_steady']['agent_mean']:.0f} ms against "
           f"{sv['plain_cpu_ms_per_round_steady']['agent_mean']:.1f}."]
    if (res / "secagg-peers.json").exists():
        pe = json.loads((res / "secagg-peers.json").read_text())
        m = pe["round_ms_median"]
        out.append(f"- Beside Flower's SecAgg+ in one run (`{pe['command'].strip()}`, {pe['clients']} clients, "
                   f"Flower's deployment engine with SecAgg+ over every client, threshold {pe['threshold']}): "
                   f"ours {m['ours_secure']:.0f} ms a round with the protocol and {m['ours_plain']:.0f} ms "
                   f"without ({pe['ours_secure_over_plain']:.1f}x); Flower's {m['flower_secaggplus'] / 1e3:.1f} s "
                   f"and {m['flower_plain'] / 1e3:.1f} s ({pe['flower_secaggplus_over_plain']:.1f}x): Flower's "
                   f"SecAgg+ round takes {pe['flower_secaggplus_over_ours_secure']:.0f}x ours (its deployment "
                   "engine starts a process for each message, and SecAgg+ sends four a round).")
    co = json.loads((res / "secagg-cost.json").read_text())
    row = next((r for r in co["rows"] if r["model"] == "policy" and r["agents"] == 10 and "bytes_per_agent" in r), None)
    if row is not None:
        b = row["bytes_per_agent"]
        out.append(f"- Bytes (`python -m benchmarks.system.secagg_cost`, 10 agents, the policy's {row['values']:,} values): "
                   f"an agent sends {b['secure_up'] / 1e3:.0f} KB a round and receives {b['secure_down'] / 1e3:.1f} "
                   f"KB more than its task, against its {b['plain_up'] / 1e3:.0f} KB float32 update "
                   f"({b['secure_up'] / b['plain_up']:.2f}x: 8 bytes a value in the ring).")
    return "\n".join(out)


def blocks() -> dict[str, str]:
    return {"secagg-cost": secagg_md(),
            "privacy-cost": table_md(load()) if load() else "Not measured yet: `python -m benchmarks.studies.privacy_cost run`."}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=("run", "status", "table", "render"))
    p.add_argument("--only", default="", help="comma-separated cell keys (default: every cell not done)")
    a = p.parse_args(argv)
    done = {r["key"] for r in load()}
    if a.what == "table":
        print(table_md(load()))
        return 0
    if a.what == "render":
        from benchmarks.common import replace_blocks

        PRIVACY_MD.write_text(replace_blocks(PRIVACY_MD.read_text(), blocks()))
        print(f"rendered {PRIVACY_MD}")
        return 0
    todo = [c for c in cells() if (not a.only or c["key"] in a.only.split(",")) and c["key"] not in done]
    if a.what == "status":
        for c in cells():
            state = "done" if c["key"] in done else (
                "started" if (WORK / c["key"] / "rounds.jsonl").exists() else "not started")
            print(f"{c['key']:<24} {state}")
        return 0
    unknown = set(filter(None, a.only.split(","))) - {c["key"] for c in cells()}
    if unknown:
        print(f"unknown cells: {', '.join(sorted(unknown))}", file=sys.stderr)
        return 2
    for c in todo:  # several workers may share the list: a cell done or taken meanwhile is skipped
        if (RESULTS / f"{c['key']}.json").exists() or not _claim(c["key"]):
            continue
        r = execute(c)
        print(f"{c['key']}: final {r['final_long']['score_mean'] if r.get('final_long') else r['final']['score_mean']:.1f}"
              f" in {r['wall_seconds']:.0f}s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
