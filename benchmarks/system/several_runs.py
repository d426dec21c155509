"""Several runs on one federation: three runs started together on one fleet of agents, beside the
same three runs one after another on the same fleet, measured in one invocation.

    python -m benchmarks.system.several_runs [--agents 10] [--runs 3] [--rounds 10] [--local-steps 20]
                                             [--runs-at-once 1] [--out PATH]

Real processes on loopback: one aggregator and ``--agents`` agents (Hopper data, the default
DRPO learner, one torch thread each), started once. Each run has its own seed. "One after
another": each run is started when the one before has finished; "together": all are started at
once and the agents take their tasks in turn (or ``--runs-at-once`` at a time). Wall time is
from the first start to the last finish, as the aggregator's events stamp them. Writes
benchmarks/results/several-runs.json unless ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import RESULTS
from benchmarks.system.procs import aggregator_target, dataset, start_agents


def _runs_wall(c, store: Path, ids: list[str]) -> float:
    """Seconds from the first run's start to the last one's finish (the aggregator's clock)."""
    starts, ends = [], []
    for i in ids:
        events = [json.loads(x) for x in (store / "runs" / i / "events.jsonl").read_text().splitlines()]
        starts.append(next(e["time_unix"] for e in events if e["kind"] == "RUN_STARTED"))
        ends.append(next(e["time_unix"] for e in events if e["kind"] == "RUN_FINISHED"))
    return max(ends) - min(starts)


def _wait_finished(c, ids: list[str], limit: float) -> None:
    end = time.monotonic() + limit
    while True:
        states = [c.status(i)["state"] for i in ids]
        if all(s == "finished" for s in states):
            return
        bad = [(i, s) for i, s in zip(ids, states) if s in ("failed", "stopped")]
        assert not bad, f"runs ended without finishing: {bad}"
        assert time.monotonic() < end, f"runs did not finish within {limit:.0f}s: {states}"
        time.sleep(0.2)


def measure(agents: int, runs: int, rounds: int, local_steps: int, runs_at_once: int, tmp: Path) -> dict:
    from fedrl.cli.client import ControlClient

    data = dataset(tmp)
    port_file, state = tmp / "agg.port", tmp / "state"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    procs = [subprocess.Popen([sys.executable, "-m", "aggregator_service", "--port", "0", "--port-file",
                               str(port_file), "--state-dir", str(state), "--log-level", "WARNING"], env=env)]
    try:
        target = aggregator_target(port_file, procs[0])
        procs += start_agents(target, data, agents, env, "--runs-at-once", str(runs_at_once))
        cfg = {"agents": agents, "rounds": rounds, "local_steps": local_steps, "eval_episodes": 0,
               "round_timeout": 600, "join_timeout": 300}
        limit = 600 + 60 * rounds * runs * max(1, local_steps) / 10
        with ControlClient(target) as c:
            end = time.monotonic() + 120
            while sum(a["connected"] for a in c.status()["agents"]) < agents:
                assert time.monotonic() < end, "agents did not join"
                time.sleep(0.1)
            # a warm-up run (processes' first round: imports, pools, heaps), not measured
            warm = c.start({**cfg, "rounds": 2, "seed": 99})["run_id"]
            _wait_finished(c, [warm], limit)
            seq = []
            for k in range(runs):
                seq.append(c.start({**cfg, "seed": k})["run_id"])
                _wait_finished(c, seq[-1:], limit)
            together = [c.start({**cfg, "seed": k})["run_id"] for k in range(runs)]
            _wait_finished(c, together, limit)
            one_after_another, at_once = _runs_wall(c, state, seq), _runs_wall(c, state, together)
        return {"one_after_another_seconds": round(one_after_another, 2), "together_seconds": round(at_once, 2),
                "speedup": round(one_after_another / at_once, 3)}
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(20)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.system.several_runs", description=__doc__.split("\n\n")[0])
    p.add_argument("--agents", type=int, default=10)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--local-steps", type=int, default=20)
    p.add_argument("--runs-at-once", type=int, default=1)
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as d:
        res = measure(a.agents, a.runs, a.rounds, a.local_steps, a.runs_at_once, Path(d))
    out = {"command": "python -m benchmarks.system.several_runs " + " ".join(argv if argv is not None else sys.argv[1:]),
           "agents": a.agents, "runs": a.runs, "rounds": a.rounds, "local_steps": a.local_steps,
           "runs_at_once": a.runs_at_once, "cpus": os.cpu_count(), "machine": platform.machine(),
           "date": time.strftime("%Y-%m-%d"), **res}
    path = Path(a.out) if a.out else RESULTS / "several-runs.json"
    path.write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
