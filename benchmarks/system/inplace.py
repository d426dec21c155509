"""Where a federation round's CPU goes inside the real processes: thread CPU per piece, in place.

    python -m benchmarks.system.inplace [--rounds 400] [--model hopper|30mb] [--out FILE]

Timed alone (timeit, one warm thread) the pieces of a Hopper-size round cost a quarter or less
of what they cost inside the federation, where ten agents and the aggregator share two cores and
every piece runs with cold caches. This runs the real federation (``benchmarks.system.services
federation_rounds``: an aggregator and N agent processes, no local training) with each process's
pieces wrapped in a timer of its own thread's CPU (``time.thread_time_ns``): the wrappers are
installed by a ``sitecustomize`` module put on the services' ``PYTHONPATH`` by this command only
(the services themselves have no such hook). Each process writes its timings when it exits.

Printed per piece: the median thread CPU of one call in microseconds (the first
``--skip`` calls left out: a trainer's construction, first-touch of buffers), and the calls per
round; for the agents, the median over agents of their medians. The timers add ~1 us a call,
and the round with them is a little slower than without (the federation command gives that).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

from benchmarks.common import ROOT

SITECUSTOMIZE = r'''
import atexit, collections, json, os, sys, time

_OUT = os.environ.get("FEDRL_INPLACE_OUT")
if _OUT:
    _acc = collections.defaultdict(list)

    def _timed(owner, name, label):
        f = getattr(owner, name, None)
        if f is None:  # an older tree (timed for comparison) without this piece
            return

        def timed(*a, **k):
            t = time.thread_time_ns()
            try:
                return f(*a, **k)
            finally:
                _acc[label].append(time.thread_time_ns() - t)
        setattr(owner, name, timed)

    def _install():
        import agent_service.client as client
        import aggregator_service.coordinator as coord
        import aggregator_service.rounds as rounds
        import aggregator_service.servicer as servicer
        import aggregator_service.store as store
        import fedrl.algos.bc as bc
        import fedrl.algos.drpo as drpo
        import fedrl.federation.round as round_
        import fedrl.wire.codec as codec

        for name in ("manifest_from_proto", "check_manifest_matches", "assemble", "encode",
                     "manifest_to_proto", "session_update", "read_task"):
            _timed(client, name, "agent: " + name)
        _timed(client.Agent, "_train", "agent: _train (all of the above but session_update, read_task)")
        _timed(client.Agent, "_session_stream", "agent: main thread, whole run (per round)")
        _timed(round_.LocalTrainer, "train_round", "agent: train_round")
        _timed(drpo.DRPOLearner, "begin_round", "agent: begin_round (drpo)")
        _timed(bc.BCLearner, "begin_round", "agent: begin_round (bc)")
        _timed(codec.Assembler, "add", "both: Assembler.add")
        _timed(codec.Assembler, "finish", "both: Assembler.finish")
        _timed(servicer.FederationServicer, "_submit", "aggregator: _submit (one update, and the close in the last)")
        _timed(servicer.FederationServicer, "_task", "aggregator: _task")
        _timed(coord.Coordinator, "_close_round", "aggregator: _close_round (journal and version write included)")
        _timed(rounds.Rounds, "_close_round", "aggregator: _close_round (journal and version write included)")
        _timed(rounds, "aggregate", "aggregator: aggregate")  # a tree from before the rounds' machine
        try:
            import fedrl.federation.machine as machine
        except ImportError:
            machine = None
        _timed(machine, "aggregate", "aggregator: aggregate")
        _timed(coord.Coordinator, "_encode", "aggregator: encode the new version")
        _timed(store.Store, "save_version", "aggregator: save_version (write, fsync, directory fsync)")
        _timed(store.Store, "append_event", "aggregator: append_event (a journal line; a close's is fsynced)")

    def _dump():
        main = os.path.basename(os.path.dirname(os.path.abspath(sys.argv[0]))) if sys.argv and sys.argv[0] else "?"
        with open(os.path.join(_OUT, f"{main}-{os.getpid()}.json"), "w") as f:
            json.dump(_acc, f)

    _install()
    atexit.register(_dump)
'''


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=400)
    p.add_argument("--agents", type=int, default=10)
    p.add_argument("--model", choices=("hopper", "30mb"), default="hopper")
    p.add_argument("--skip", type=int, default=10, help="first calls of each piece left out")
    p.add_argument("--out", help="write the results here (JSON)")
    a = p.parse_args(argv)
    from benchmarks.system.services import federation_rounds

    h = 2738  # fed-bc with hidden (h, h): ~30 MB, as `benchmarks.system.services transfer`
    config = {"algo": "drpo"} if a.model == "hopper" else {"algo": "fed-bc", "bc": {"hidden": [h, h]}}
    with tempfile.TemporaryDirectory() as d:
        site, out = Path(d, "site"), Path(d, "out")
        site.mkdir()
        out.mkdir()
        (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
        saved = {k: os.environ.get(k) for k in ("PYTHONPATH", "FEDRL_INPLACE_OUT")}
        root = str(ROOT)
        os.environ["PYTHONPATH"] = os.pathsep.join(x for x in (str(site), root, saved["PYTHONPATH"]) if x)
        os.environ["FEDRL_INPLACE_OUT"] = str(out)
        try:
            r = federation_rounds(a.agents, a.rounds, config, Path(d, "run"))
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        files = sorted(out.glob("*.json"))
        procs = {f.name: json.loads(f.read_text()) for f in files}
    if not any(name.startswith("agent_service") for name in procs) or not any(
            name.startswith("aggregator_service") for name in procs):
        print(f"error: timings came back from {sorted(procs)} only", file=sys.stderr)
        return 1
    pieces: dict[str, list[tuple[float, float]]] = {}
    for name, acc in procs.items():
        side = "agent" if name.startswith("agent_service") else "aggregator"
        for label, ns in acc.items():
            if not label.startswith(side) and not label.startswith("both"):
                continue
            kept = ns[a.skip:] or ns
            pieces.setdefault(f"{side} | {label}", []).append((statistics.median(kept) / 1e3, len(ns) / a.rounds))
    for k, v in pieces.items():  # a whole run's main thread: per round
        if "whole run" in k:
            pieces[k] = [(x / a.rounds, 1.0) for x, _ in v]
    rows = {k: {"us_per_call_median": round(statistics.median(x for x, _ in v), 1),
                "calls_per_round": round(statistics.median(c for _, c in v), 2), "processes": len(v)}
            for k, v in sorted(pieces.items())}
    res = {"model": a.model, "agents": a.agents, "rounds": a.rounds,
           "round_ms_median": round(float(statistics.median(r["per_round_seconds"][3:])) * 1e3, 2),
           "cpu_ms_per_round_steady": r["cpu_ms_per_round_steady"], "pieces": rows}
    width = max(map(len, rows))
    for k, v in rows.items():
        print(f"{k:{width}s} {v['us_per_call_median']:10.1f} us x {v['calls_per_round']:g}/round")
    print(json.dumps({k: res[k] for k in ("model", "round_ms_median", "cpu_ms_per_round_steady")}))
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
