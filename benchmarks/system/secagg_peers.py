"""Secure aggregation beside Flower's SecAgg+ (issue 64), in one run: 10 clients, the Hopper
policy's size, no local training, each side's round with and without its protocol.

    python -m benchmarks.system.secagg_peers [--clients 10] [--rounds 30] [--flower-rounds 4] [--repeats 2]

- **Ours:** the real processes (``benchmarks.system.services.federation_rounds``: an aggregator and
  ``--clients`` agent processes on Session streams), plain and with ``secagg_threshold``
  ceil(2n/3) (Bonawitz et al. 2017 over every pair of agents).
- **Flower 1.42.0:** its deployment engine (a SuperLink, ``--clients`` SuperNodes, ``flwr run``
  of ``benchmarks/system/flower_secagg_app``) through the legacy workflow, plain and with
  ``SecAggPlusWorkflow`` at ``num_shares`` = every client and the same reconstruction threshold
  (SecAgg+ with every client as a neighbour is the full protocol, as ours). Flower's legacy
  gRPC path (``start_server``) has no SecAgg+.

Reported: each side's median round time with and without, the protocol's ratio on each side,
and Flower's SecAgg+ round over ours (``benchmarks/results/secagg-peers.json``). Run time: about
10 minutes at the defaults (a Flower SecAgg+ round is seconds: a process per message).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.system.peers import RESULTS, ensure_flower, flower_deployment_rounds, ours_rounds

SECAGG_APP = Path(__file__).resolve().parent / "flower_secagg_app"


def main(argv: list[str] | None = None) -> int:
    from benchmarks.system.services import HOPPER_POLICY_BYTES

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--clients", type=int, default=10)
    p.add_argument("--rounds", type=int, default=30, help="our rounds per run (after the warm-up)")
    p.add_argument("--flower-rounds", type=int, default=4, help="Flower's rounds per run (the first is dropped)")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--out", default=str(RESULTS / "secagg-peers.json"))
    a = p.parse_args(argv)
    py = ensure_flower()
    t = -(-2 * a.clients // 3)
    n_params = HOPPER_POLICY_BYTES // 4
    sides = {"ours_plain": [], "ours_secure": [], "flower_plain": [], "flower_secaggplus": []}
    load_start = os.getloadavg()
    for i in range(a.repeats):  # interleaved: each pair meets the same moments of a shared machine
        for name, cfg in (("ours_plain", {"algo": "drpo"}), ("ours_secure", {"algo": "drpo", "secagg_threshold": t})):
            with tempfile.TemporaryDirectory() as d:
                sides[name].append(ours_rounds(a.clients, a.rounds, cfg, Path(d))["round_seconds"])
        for name, flag in (("flower_plain", 0), ("flower_secaggplus", 1)):
            with tempfile.TemporaryDirectory() as d:
                r = flower_deployment_rounds(py, a.clients, a.flower_rounds, n_params, Path(d), app=SECAGG_APP,
                                             config=f"secagg={flag} num-shares={a.clients} "
                                                    f"reconstruction-threshold={t}", round_timeout=180)
                sides[name].append(r["round_seconds"][1:])  # the first round starts the apps' processes
        print(f"#{i + 1}: " + ", ".join(f"{k} {np.median(v[-1]) * 1e3:.0f} ms" for k, v in sides.items()), flush=True)
    med = {k: float(np.median(np.concatenate(v))) * 1e3 for k, v in sides.items()}
    out = {"command": "python -m benchmarks.system.secagg_peers " + " ".join(argv if argv is not None else sys.argv[1:]),
           "date": time.strftime("%Y-%m-%d"), "cores": os.cpu_count(), "clients": a.clients, "threshold": t,
           "model_bytes": HOPPER_POLICY_BYTES, "flower": "flwr==1.42.0, deployment engine, legacy workflow",
           "loadavg_at_start": load_start, "loadavg_at_end": os.getloadavg(),
           "round_ms_median": med, "rounds_measured": {k: sum(len(x) for x in v) for k, v in sides.items()},
           "ours_secure_over_plain": med["ours_secure"] / med["ours_plain"],
           "flower_secaggplus_over_plain": med["flower_secaggplus"] / med["flower_plain"],
           "flower_secaggplus_over_ours_secure": med["flower_secaggplus"] / med["ours_secure"]}
    Path(a.out).write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
