"""The services' round overhead at two commits, alternated in one invocation (a change's cost).

    python -m benchmarks.system.ab_rounds BEFORE [AFTER] [--repeats 3] [--rounds 100] [--out PATH]

Each commit (AFTER: the working tree's HEAD by default) is checked out in a temporary worktree,
and ``python -m benchmarks.system.services federation`` (one aggregator and 10 agent processes,
the Hopper policy, zero local steps) runs there, the two alternating ``--repeats`` times (ABBA: each
goes first as often) so that the machine's load falls on both alike. Writes benchmarks/results/ab-rounds.json unless ``--out``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import RESULTS

ROOT = Path(__file__).resolve().parents[2]


def _rev(ref: str) -> str:
    return subprocess.run(["git", "rev-parse", ref], cwd=ROOT, capture_output=True, text=True,
                          check=True).stdout.strip()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.system.ab_rounds", description=__doc__.split("\n\n")[0])
    p.add_argument("before")
    p.add_argument("after", nargs="?", default="HEAD")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--rounds", type=int, default=100)
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    commits = {"before": _rev(a.before), "after": _rev(a.after)}
    runs: dict[str, list[dict]] = {"before": [], "after": []}
    with tempfile.TemporaryDirectory() as d:
        trees = {}
        for side, commit in commits.items():
            trees[side] = Path(d) / side
            subprocess.run(["git", "worktree", "add", "--detach", str(trees[side]), commit], cwd=ROOT,
                           capture_output=True, check=True)
        try:
            for k in range(a.repeats):
                for side in ("before", "after") if k % 2 == 0 else ("after", "before"):  # ABBA: no side always second
                    out = subprocess.run([sys.executable, "-m", "benchmarks.system.services", "federation",
                                          "--rounds", str(a.rounds)], cwd=trees[side], capture_output=True,
                                         text=True, check=True).stdout
                    runs[side].append(json.loads(out.strip().splitlines()[-1]))
                    print(side, runs[side][-1]["round_ms_median"], flush=True)
        finally:
            for t in trees.values():
                subprocess.run(["git", "worktree", "remove", "--force", str(t)], cwd=ROOT, capture_output=True)
    med = {s: statistics.median(r["round_ms_median"] for r in rs) for s, rs in runs.items()}
    res = {"command": "python -m benchmarks.system.ab_rounds " + " ".join(argv if argv is not None else sys.argv[1:]),
           "date": time.strftime("%Y-%m-%d"), "commits": commits, "runs": runs,
           "round_ms_median": med, "after_to_before": round(med["after"] / med["before"], 3)}
    path = Path(a.out) if a.out else RESULTS / "ab-rounds.json"
    path.write_text(json.dumps(res, indent=2) + "\n")
    print(json.dumps({k: res[k] for k in ("commits", "round_ms_median", "after_to_before")}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
