"""This federation beside Flower on the same work, alternating, in one run.

    python -m benchmarks.peers [--clients 10] [--small-rounds 30] [--large-rounds 5] [--repeats 2]
                               [--out benchmarks/results/peers.json]

The work: N client processes on 127.0.0.1, no local training (the federation's agents run zero
local steps; Flower's clients return the parameters they received), (a) the Hopper policy
(~280 KB) and (b) a ~30 MB model; each side's rounds after its first. Measured per side: round
time (median, p90), MB/s of weights moved (N downloads + N uploads per round), CPU seconds per
round of the server and of all clients (after the first round), peak RSS of the server and of
the largest client. Order: ours, Flower, ours, Flower, ... (``--repeats`` of each per size), so
both see the same moments of a shared machine.

Flower runs in its own virtual environment, made on first use at ``benchmarks/.venv-flwr``
(``flwr==1.42.0``: it needs protobuf < 7, this project pins 7), through its legacy gRPC path
(``start_server`` / ``start_client``, ``benchmarks/flower_side.py``). Its current deployment
engine (SuperLink + SuperNodes + ``flwr run``) is not measured here: see BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
VENV = HERE / ".venv-flwr"
FLWR_PIN = "flwr==1.42.0"
RESULTS = HERE / "results"


def ensure_flower() -> Path:
    from benchmarks.venvs import ensure_venv

    return ensure_venv(VENV, "flwr, numpy", [FLWR_PIN, "numpy"], FLWR_PIN)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Watch:
    """Polls the CPU seconds and peak RSS of processes while they live (both vanish at exit)."""

    def __init__(self, procs: list[subprocess.Popen]) -> None:
        self.procs = procs
        self.cpu = {p.pid: 0.0 for p in procs}
        self.rss = {p.pid: 0.0 for p in procs}

    def poll(self) -> None:
        tick = os.sysconf("SC_CLK_TCK")
        for p in self.procs:
            try:
                fields = Path(f"/proc/{p.pid}/stat").read_text().rsplit(")", 1)[1].split()
                self.cpu[p.pid] = (int(fields[11]) + int(fields[12])) / tick
                for line in Path(f"/proc/{p.pid}/status").read_text().splitlines():
                    if line.startswith("VmHWM:"):
                        self.rss[p.pid] = max(self.rss[p.pid], int(line.split()[1]) / 1024)
            except (OSError, IndexError, ValueError):
                pass  # exited: its last readings stand

    def snapshot(self) -> dict[int, float]:
        self.poll()
        return dict(self.cpu)


def flower_rounds(py: Path, clients: int, rounds: int, n_params: int, tmp: Path) -> dict:
    addr = f"127.0.0.1:{_free_port()}"
    out = tmp / "flower.json"
    side = str(HERE / "flower_side.py")
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "GRPC_VERBOSITY": "ERROR"}
    log = open(tmp / "flower.log", "w")  # noqa: SIM115 - the processes' shared log, closed in finally
    server = subprocess.Popen([str(py), side, "server", "--address", addr, "--rounds", str(rounds),
                               "--params", str(n_params), "--clients", str(clients), "--out", str(out)],
                              stdout=log, stderr=subprocess.STDOUT, env=env)
    time.sleep(2.0)  # the server binds before clients dial (they retry, but not forever)
    cl = [subprocess.Popen([str(py), side, "client", "--address", addr], stdout=log, stderr=subprocess.STDOUT,
                           env=env) for _ in range(clients)]
    w = Watch([server, *cl])
    try:
        end = time.monotonic() + 900
        at_first = None
        while server.poll() is None:
            assert time.monotonic() < end, "Flower's run did not end"
            w.poll()
            if at_first is None and (tmp / "flower.json.progress").exists():
                at_first = w.snapshot()
            time.sleep(0.1)
        for c in cl:
            c.wait(60)
    finally:
        for p in (server, *cl):
            if p.poll() is None:
                p.kill()
        log.close()
    if server.returncode != 0 or not out.exists():
        raise RuntimeError(f"Flower's server failed ({server.returncode}); see {tmp / 'flower.log'}: "
                           + (tmp / "flower.log").read_text()[-2000:])
    res = json.loads(out.read_text())
    steady = rounds - 1
    cpu_end = w.cpu
    base = at_first or {p: 0.0 for p in cpu_end}
    return {"round_seconds": res["round_seconds"], "flwr": res["flwr"], "path": res["path"],
            "cpu_ms_per_round": {"server": (cpu_end[server.pid] - base[server.pid]) / steady * 1e3,
                                 "clients_total": sum(cpu_end[c.pid] - base[c.pid] for c in cl) / steady * 1e3},
            "peak_rss_mb": {"server": w.rss[server.pid], "client_max": max(w.rss[c.pid] for c in cl)},
            "cpu_from": "after round 1" if at_first else "whole run (round 1 not seen)"}


def ours_rounds(clients: int, rounds: int, config: dict, tmp: Path) -> dict:
    from benchmarks.services import WARMUP_ROUNDS, federation_rounds

    r = federation_rounds(clients, rounds + WARMUP_ROUNDS, config, tmp)
    return {"round_seconds": r["per_round_seconds"][WARMUP_ROUNDS:],  # the first rounds set up connections
            "cpu_ms_per_round": {"server": r["cpu_ms_per_round_steady"].get("aggregator"),
                                 "clients_total": r["cpu_ms_per_round_steady"].get("agents_total")},
            "peak_rss_mb": {"server": r["peak_rss_mb"]["aggregator"], "client_max": r["peak_rss_mb"]["agent_max"]},
            "cpu_from": f"after round {WARMUP_ROUNDS}"}


def summarise(runs: list[dict], model_bytes: int, clients: int, skip: int) -> dict:
    s = np.array([x for r in runs for x in r["round_seconds"][skip:]])
    med = float(np.median(s))
    return {"rounds_measured": len(s), "round_ms_median": med * 1e3, "round_ms_p90": float(np.percentile(s, 90)) * 1e3,
            "mb_per_s": 2 * clients * model_bytes / med / 1e6,
            "cpu_ms_per_round": {k: float(np.mean([r["cpu_ms_per_round"][k] for r in runs]))
                                 for k in ("server", "clients_total")},
            "peak_rss_mb": {k: float(max(r["peak_rss_mb"][k] for r in runs)) for k in ("server", "client_max")},
            "runs": runs}


def main(argv: list[str] | None = None) -> int:
    from benchmarks.services import HOPPER_POLICY_BYTES

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--clients", type=int, default=10)
    p.add_argument("--small-rounds", type=int, default=30)
    p.add_argument("--large-rounds", type=int, default=5)
    p.add_argument("--mb", type=int, default=30)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--out", default=str(RESULTS / "peers.json"))
    a = p.parse_args(argv)
    py = ensure_flower()
    h = int((a.mb * 1e6 / 4) ** 0.5)  # fed-bc with hidden (h, h): ~mb MB (as benchmarks.services transfer)
    large_bytes = (11 * h + h + h * h + h + h * 6 + 6 + 22) * 4
    sizes = {"hopper_policy": (HOPPER_POLICY_BYTES, a.small_rounds, {"algo": "drpo"}),
             f"model_{a.mb}mb": (large_bytes, a.large_rounds, {"algo": "fed-bc", "bc": {"hidden": [h, h]}})}
    out = {"clients": a.clients, "date": time.strftime("%Y-%m-%d"), "cores": os.cpu_count(),
           "machine_state": os.getloadavg(), "sizes": {}}
    for name, (nbytes, rounds, cfg) in sizes.items():
        ours, flower = [], []
        for i in range(a.repeats):
            with tempfile.TemporaryDirectory() as d:
                ours.append(ours_rounds(a.clients, rounds, cfg, Path(d)))
                print(f"{name} ours #{i + 1}: median {np.median(ours[-1]['round_seconds']) * 1e3:.1f} ms", flush=True)
            with tempfile.TemporaryDirectory() as d:
                flower.append(flower_rounds(py, a.clients, rounds + 1, nbytes // 4, Path(d)))
                print(f"{name} Flower #{i + 1}: median {np.median(flower[-1]['round_seconds'][1:]) * 1e3:.1f} ms",
                      flush=True)
        o, f = summarise(ours, nbytes, a.clients, 0), summarise(flower, nbytes, a.clients, 1)
        out["sizes"][name] = {"model_bytes": nbytes, "ours": o, "flower": f,
                              "flower_over_ours_round_time": f["round_ms_median"] / o["round_ms_median"],
                              "ours_over_flower_mb_per_s": o["mb_per_s"] / f["mb_per_s"]}
        print(f"{name}: ours {o['round_ms_median']:.1f} ms, Flower {f['round_ms_median']:.1f} ms "
              f"({out['sizes'][name]['flower_over_ours_round_time']:.2f}x)", flush=True)
    out["flower"] = {"version": FLWR_PIN, "path": "legacy gRPC (start_server/start_client)",
                     "not_measured": "the SuperLink/SuperNode deployment engine (see BENCHMARKS.md)"}
    Path(a.out).write_text(json.dumps(out, indent=1))
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
