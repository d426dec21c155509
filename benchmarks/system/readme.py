"""The README's times and returns, measured by commands and rendered from committed results.

    python -m benchmarks.system.readme measure up            fedrl up as the README gives it (data made first, then again)
    python -m benchmarks.system.readme measure by-hand       the services started by hand with default flags vs fedrl up
    python -m benchmarks.system.readme measure suite         the README's test command from a fresh clone: once as
                                                             the machine is, then 3 times beside 2 CPU burners
    python -m benchmarks.system.readme render                write the README's generated blocks

Each ``measure`` writes ``benchmarks/results/readme/<name>.json`` with the machine's load (1-minute
load average before and after, CPU count) beside the numbers: a time on this shared machine means
little without it. ``render`` fills the README's ``<!-- generated:readme-* -->`` blocks from those
files only; ``tests/integration/test_readme_numbers.py`` fails when a block is stale.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.common import ROOT

RESULTS = ROOT / "benchmarks" / "results" / "readme"
README = ROOT / "README.md"
PERFORMANCE = ROOT / "docs" / "performance.md"
BENCHMARKS = ROOT / "BENCHMARKS.md"
# the small-settings run the README's "services by hand" example starts (about a minute here)
BY_HAND = {"agents": 2, "rounds": 3, "local_steps": 200, "eval_episodes": 0}  # the README's command, word for word


def machine() -> dict[str, Any]:
    return {"cpus": os.cpu_count(), "loadavg_1min": round(os.getloadavg()[0], 2), "date": time.strftime("%Y-%m-%d %H:%M")}


def _write(name: str, data: dict[str, Any]) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(data, indent=1) + "\n")
    print(f"wrote {path}")
    return path


def _up(out: Path, env: dict[str, str], *flags: str) -> dict[str, Any]:
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-m", "fedrl.cli", "up", "--out", str(out), *flags], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=3600)
    wall = time.monotonic() - t0
    if p.returncode != 0:
        raise SystemExit(f"fedrl up failed ({p.returncode}):\n{p.stdout[-2000:]}\n{p.stderr[-2000:]}")
    rounds = [json.loads(x) for x in (out / "rounds.jsonl").read_text().splitlines()]
    return {"wall_seconds": round(wall, 1), "returns": [round(r["return_mean"], 1) for r in rounds if "return_mean" in r],
            "round_seconds": [round(r.get("seconds", 0.0), 2) for r in rounds]}


def measure_up() -> int:
    """``fedrl up`` with the README's defaults in a fresh cache (the dataset is made first), then
    again with the data in place: the README's two times and its returns."""
    with tempfile.TemporaryDirectory(prefix="fedrl-readme-") as d:
        env = {**os.environ, "FEDRL_CACHE_DIR": str(Path(d) / "cache"), "D4RL_DATASET_DIR": str(Path(d) / "d4rl")}
        before = machine()
        t0 = time.monotonic()
        subprocess.run([sys.executable, "-m", "fedrl.cli", "data", "info", "hopper-medium-v2"], cwd=ROOT, env=env,
                       check=True, capture_output=True, timeout=1200)
        making = time.monotonic() - t0
        shutil.rmtree(Path(d) / "cache")
        first = _up(Path(d) / "first", env)
        RESULTS.mkdir(parents=True, exist_ok=True)
        shutil.copy(Path(d) / "first" / "learning_curve.png", RESULTS / "learning_curve.png")  # the README shows it
        again = _up(Path(d) / "again", env)
    return 0 if _write("up", {"command": "fedrl up", "first_run": first, "data_ready": again,
                              "data_making_seconds": round(making, 1), "machine_before": before,
                              "machine_after": machine()}) else 1


def _wait_file(path: Path, proc: subprocess.Popen, what: str, timeout: float = 120) -> str:
    end = time.monotonic() + timeout
    while not (path.exists() and path.read_text().strip()):
        if proc.poll() is not None or time.monotonic() > end:
            raise SystemExit(f"{what} did not start (exit status {proc.poll()})")
        time.sleep(0.05)
    return path.read_text().strip()


def measure_by_hand() -> int:
    """The README's *services by hand* steps with default flags (an aggregator, two agents, ``fedrl
    ctl start`` with :data:`BY_HAND`), their rounds' seconds beside ``fedrl up``'s for the same run."""
    before = machine()
    with tempfile.TemporaryDirectory(prefix="fedrl-byhand-") as d:
        d = Path(d)
        py = sys.executable
        procs = []
        try:
            logs = open(d / "services.log", "w")
            agg = subprocess.Popen([py, "-m", "aggregator_service", "--state-dir", str(d / "state"), "--port", "0",
                                    "--port-file", str(d / "port")], cwd=ROOT, stdout=logs, stderr=subprocess.STDOUT)
            procs.append(agg)
            try:
                target = f"127.0.0.1:{_wait_file(d / 'port', agg, 'the aggregator')}"
            except SystemExit as e:
                logs.flush()
                raise SystemExit(f"{e}: {(d / 'services.log').read_text()[-2000:]}") from None
            for i in range(2):
                procs.append(subprocess.Popen([py, "-m", "agent_service", "--aggregator", target, "--dataset",
                                               "hopper-medium-v2", "--shard", str(i), "--shards", "2"], cwd=ROOT,
                                              stdout=logs, stderr=subprocess.STDOUT))
            sets = [x for k, v in BY_HAND.items() for x in ("--set", f"{k}={v}")]
            t0 = time.monotonic()
            end = t0 + 300
            while subprocess.run([py, "-m", "fedrl.cli", "ctl", "--target", target, "start", *sets], cwd=ROOT,
                                 capture_output=True).returncode != 0:
                if time.monotonic() > end:
                    raise SystemExit("the run could not be started")
                time.sleep(1.0)
            w = subprocess.run([py, "-m", "fedrl.cli", "ctl", "--target", target, "--json", "watch"], cwd=ROOT,
                               capture_output=True, text=True, timeout=1800)
            wall = time.monotonic() - t0
            events = [json.loads(x) for x in w.stdout.splitlines() if x.strip()]
        finally:
            for p in procs:
                p.terminate()
            for p in procs:
                p.wait(30)
        opened = {e["round"]: e["time_unix"] for e in events if e["kind"] == "ROUND_OPENED"}
        by_hand = [round(e["time_unix"] - opened[e["round"]], 2) for e in events if e["kind"] == "ROUND_CLOSED"]
        up = _up(d / "up", dict(os.environ), "--agents", "2", "--rounds", str(BY_HAND["rounds"]), "--local-steps",
                 str(BY_HAND["local_steps"]), "--eval-episodes", "0")
    return 0 if _write("by-hand", {"settings": BY_HAND, "by_hand_round_seconds": by_hand,
                                   "by_hand_wall_seconds": round(wall, 1), "up_round_seconds": up["round_seconds"],
                                   "ratio_of_medians": round(sorted(by_hand)[len(by_hand) // 2]
                                                             / sorted(up["round_seconds"])[len(up["round_seconds"]) // 2], 2),
                                   "machine_before": before, "machine_after": machine()}) else 1


# The one test that reads this measurement's own result (the README's rendered blocks): it cannot
# pass before the result it checks exists, so the measured run leaves it out, and says so.
SELF_CHECK = "tests/test_docs.py::test_every_rendered_number_matches_its_committed_result"


SLOWEST = 40  # the slowest phases (setup, call, teardown) recorded with the suite's time


def slowest_tests(lines: list[str]) -> list[dict]:
    """pytest's ``--durations`` report (``12.34s call     tests/x.py::test_y``) as records, slowest first."""
    out = []
    for line in lines:
        head, _, rest = line.partition("s ")
        parts = rest.split(None, 1)
        try:
            seconds = float(head)
        except ValueError:
            continue
        if len(parts) == 2 and parts[0] in ("setup", "call", "teardown") and "::" in parts[1]:
            out.append({"seconds": seconds, "phase": parts[0], "test": parts[1].strip()})
    return sorted(out, key=lambda r: -r["seconds"])


BURN = "while True: pass"  # one CPU burner: a busy loop, at the tests' own priority


def _fresh_clone(where: Path) -> Path:
    """The committed HEAD cloned into ``where`` with the README's set-up command run in a new
    virtualenv there: what a new user has. Returns the clone's python."""
    clone = where / "clone"
    subprocess.run(["git", "clone", "--quiet", str(ROOT), str(clone)], check=True)
    subprocess.run([sys.executable, "-m", "venv", str(where / "venv")], check=True)
    py = where / "venv" / "bin" / "python"
    subprocess.run([str(py), "-m", "pip", "install", "-q", "torch==2.13.0", "-e", ".[test]"], cwd=clone, check=True)
    return py


def _suite_run(py: Path, clone: Path, burners: int, beside: str = "") -> dict[str, Any]:
    """The README's test command once in ``clone`` beside ``burners`` busy loops (and ``beside``:
    what else loads the machine, in words)."""
    procs = [subprocess.Popen([sys.executable, "-c", BURN]) for _ in range(burners)]
    try:
        before = machine()
        t0 = time.monotonic()
        p = subprocess.run([str(py), "-m", "pytest", "-q", "-p", "no:cacheprovider", "--deselect", SELF_CHECK,
                            f"--durations={SLOWEST}", "--durations-min=1"], cwd=clone, capture_output=True, text=True)
        wall = time.monotonic() - t0
        after = machine()
    finally:
        for b in procs:
            b.kill()
            b.wait()
    lines = p.stdout.strip().splitlines()
    failed = [x.split(" ", 1)[1].split(" - ")[0] for x in lines if x.startswith(("FAILED ", "ERROR "))]
    if p.returncode:  # which tests, and why: the run's own report, not only its count
        print(p.stdout[-20000:] + p.stderr[-4000:], file=sys.stderr)
    return {"burners": burners, **({"beside": beside} if beside else {}), "commit": _head(clone),
            "wall_seconds": round(wall, 1), "summary": lines[-1] if lines else "",
            **({"failed": failed} if failed else {}), "returncode": p.returncode, "slowest": slowest_tests(lines),
            "machine_before": before, "machine_after": after}


def _head(where: Path = ROOT) -> str:
    return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=where, capture_output=True, text=True,
                          check=True).stdout.strip()


def measure_suite(loaded_runs: int = 3, burners: int = 2, beside: str = "", after_idle: str = "",
                  keep_loaded: bool = False) -> int:
    """The README's test command from a fresh clone: once on the machine as it is (run this on an
    idle machine; with ``loaded_runs`` 0 the file keeps the loaded runs it had, each with its
    commit), then ``loaded_runs`` times beside ``burners`` CPU burners (a busy loop each),
    or beside other work (``beside`` says what, in words; ``after_idle``: a shell command run
    between the idle run and the loaded ones, e.g. to resume that work; ``keep_loaded``: the new
    loaded runs are added to those the file has, not put in their place)."""
    with tempfile.TemporaryDirectory(prefix="fedrl-suite-") as tmp:
        head = _head()
        py = _fresh_clone(Path(tmp))
        runs = [_suite_run(py, Path(tmp) / "clone", 0)]
        kept = []
        if (keep_loaded or not loaded_runs) and (RESULTS / "suite.json").exists():  # earlier loaded runs stay
            kept = json.loads((RESULTS / "suite.json").read_text()).get("loaded", [])
        if after_idle:
            subprocess.run(after_idle, shell=True, check=False)
        for i in range(loaded_runs + 1):  # written after each run: a stopped measurement keeps its runs
            if i:
                runs.append(_suite_run(py, Path(tmp) / "clone", burners, beside))
            idle, loaded = runs[0], runs[1:]
            _write("suite", {"command": f"python -m pytest --deselect {SELF_CHECK}", "commit": head, **idle,
                             "loaded": kept + [{k: v for k, v in r.items() if k != "slowest"} for r in loaded]})
    return 0 if all(r["returncode"] == 0 for r in runs) else 1


def _mmss(seconds: float) -> str:
    m, s = divmod(int(round(seconds)), 60)
    return f"{m} min {s:02d} s" if m else f"{s} s"


def _load(r: dict) -> str:
    return (f"{r['machine_before']['cpus']} CPUs, load {r['machine_before']['loadavg_1min']:.1f}"
            f" before / {r['machine_after']['loadavg_1min']:.1f} after, {r['machine_before']['date'][:10]}")


def blocks(results: Path = RESULTS) -> dict[str, str]:
    """The README's generated blocks, from the committed results only."""
    out = {}
    up = json.loads((results / "up.json").read_text())
    rets = ", ".join(f"{x:.0f}" for x in up["first_run"]["returns"])
    out["readme-up"] = (f"Measured ({_load(up)}; `python -m benchmarks.system.readme measure up`): "
                        f"{_mmss(up['first_run']['wall_seconds'])} the first time, making the dataset included "
                        f"({_mmss(up['data_making_seconds'])} of it, once), {_mmss(up['data_ready']['wall_seconds'])} "
                        f"once the data exists; evaluated return by round: {rets}.")
    suite = json.loads((results / "suite.json").read_text())
    loaded = suite.get("loaded", [])
    groups: dict[str, list[dict]] = {}
    for r in loaded:
        groups.setdefault(r.get("beside") or f"{r['burners']} CPU burners (a busy loop per core)", []).append(r)
    beside = "".join(
        f" Beside {what}, {len(rs)} more {'run' if len(rs) == 1 else 'runs'}: "
        + ", ".join(f"{_mmss(r['wall_seconds'])} ({'green' if r['returncode'] == 0 else 'failed'}, load "
                    f"{r['machine_after']['loadavg_1min']:.1f} after"
                    + (f", commit {r['commit']}" if r.get("commit", suite["commit"]) != suite["commit"] else "") + ")"
                    for r in rs) + "."
        for what, rs in groups.items())
    out["readme-suite"] = (f"Measured from a fresh clone (commit {suite['commit']}): {_mmss(suite['wall_seconds'])}, `{suite['summary']}` (the "
                           f"deselected one is the test of these measured lines; {_load(suite)}).{beside} "
                           "`python -m benchmarks.system.readme measure suite`.")
    bh = json.loads((results / "by-hand.json").read_text())
    med = sorted(bh["by_hand_round_seconds"])[len(bh["by_hand_round_seconds"]) // 2]
    upm = sorted(bh["up_round_seconds"])[len(bh["up_round_seconds"]) // 2]
    out["readme-by-hand"] = (f"Measured ({_load(bh)}; `python -m benchmarks.system.readme measure by-hand`): the run "
                             f"these commands start took {_mmss(bh['by_hand_wall_seconds'])}; a round took {med:.1f} s started by "
                             f"hand with default flags and {upm:.1f} s under `fedrl up` "
                             f"({bh['ratio_of_medians']:.2f}x).")
    return out


def system_md(root: Path = RESULTS) -> str:
    """The system-speed table, from benchmarks/results/{throughput,services}-cpu.json."""
    rows = ["| measure | result | beside | target |", "| --- | --- | --- | --- |"]
    tp, sv = Path(root) / "throughput-cpu.json", Path(root) / "services-cpu.json"
    if tp.exists():
        t = json.loads(tp.read_text())
        for r in t["rows"]:
            rows.append(f"| {r['update'].upper()} local update, paper sizes, {t['threads']} threads | "
                        f"{r['steps_per_s']:.1f} steps/s | {100 * r['fraction_of_peak_ceiling']:.0f}% of the "
                        f"FLOP ceiling at peak GEMM ({t['matmul_gflops']:.0f} GFLOP/s; its own GEMMs alone run "
                        f"at {100 * r['shape_gflops'] / t['matmul_gflops']:.0f}% of that peak), "
                        f"{100 * r['fraction_of_shapes_ceiling']:.0f}% at its own GEMM shapes | "
                        f"{'>= 80% (DRPO)' if r['update'] == 'drpo' else ''} |")
    if sv.exists():
        s = json.loads(sv.read_text())
        o, tr, ev = s["overhead"], s["transfer"], s["evaluator"]
        cpu = o.get("cpu_ms_per_round_steady") or {}
        rows.append(f"| round overhead, {o['agents']} agent processes, zero local steps | "
                    f"{o['round_ms_median']:.0f} ms median (p90 {o['round_ms_p90']:.0f}) | CPU per round: "
                    f"aggregator {cpu.get('aggregator', float('nan')):.0f} ms, agents {cpu.get('agents_total', float('nan')):.0f} ms"
                    f" on {o.get('cores', '?')} cores | < {o['target_ms']:.0f} ms |")
        calls = o.get("calls_transport")
        if calls:
            cc = calls.get("cpu_ms_per_round_steady") or {}
            rows.append(f"| the same round with a call per task (`--transport calls`), same run | "
                        f"{calls['round_ms_median']:.0f} ms median (p90 {calls['round_ms_p90']:.0f}) | CPU per "
                        f"round: aggregator {cc.get('aggregator', float('nan')):.0f} ms, agents "
                        f"{cc.get('agents_total', float('nan')):.0f} ms; the Session stream's round is "
                        f"{o['session_to_calls_ratio']:.2f}x this | |")
        floor = o.get("bare_grpc_floor")
        if floor:
            srv = np.median([r["server_cpu_ms_per_round"] for r in floor["runs"]])
            cli = np.median([r["clients_cpu_ms_per_round"] for r in floor["runs"]])
            rows.append(f"| the same round in bare gRPC (same messages and processes, no work) | "
                        f"{floor['round_ms_median']:.0f} ms median | CPU per round: server {srv:.0f} ms, "
                        f"clients {cli:.0f} ms; the federation's round is {o['ratio_to_floor']:.1f}x this floor | |")
        runs = tr["raw_grpc"].get("runs")  # measured before and after the federation (since 2026-11-25)
        each = " and ".join(f"{r['mb_per_s']:.0f}" for r in runs or ())
        raw = (f"raw gRPC {tr['raw_grpc']['mb_per_s']:.0f} MB/s (mean of {each}, before and after)" if runs
               else f"raw gRPC {tr['raw_grpc']['mb_per_s']:.0f} MB/s")
        cpu = tr.get("cpu_per_round")
        cpu = (f"; CPU per round {cpu['federation_ms'] / 1e3:.2f} s vs raw's {cpu['raw_ms'] / 1e3:.2f} s"
               if cpu else "")
        cycle = ("" if "ratio_to_raw_cycle" not in tr else  # reported since 2026-11-25 (evening)
                 f" ({tr['federation']['mb_per_s_cycle']:.0f} MB/s and {100 * tr['ratio_to_raw_cycle']:.0f}% "
                 f"over the whole cycle, the version's fsynced write included)")
        rows.append(f"| transfer, {tr['federation']['model_mb']:.0f} MB model, {tr['agents']} agents | "
                    f"{tr['federation']['mb_per_s']:.0f} MB/s | {raw}: {100 * tr['ratio_to_raw']:.0f}%{cycle}{cpu} | "
                    f">= {100 * tr['target_ratio']:.0f}% |")
        rows.append(f"| evaluator, {ev['env']}, {ev['num_envs']} envs | {ev['policy_steps_per_s']:.0f} steps/s | "
                    f"random actions {ev['raw_steps_per_s']:.0f} steps/s: {100 * ev['ratio_to_raw']:.0f}% | "
                    f">= {100 * ev['target_ratio']:.0f}% |")
        for name, mb in (s.get("peak_rss_mb") or {}).items():
            rows.append(f"| peak memory (RSS), {name} | {mb:.0f} MB | | |")
    return "\n".join(rows)


def batched_md(path: Path) -> str:
    """The batched-learner throughput table of a ``benchmarks.system.throughput --batched`` result."""
    t = json.loads(path.read_text())
    rows = [f"| L (learners in one model) | agent-steps/s | vs one learner ({t['single']['steps_per_s']:.1f} steps/s) "
            f"| of the FP32 ceiling ({t['matmul_gflops']:.0f} GFLOP/s) |", "| --- | --- | --- | --- |"]
    for r in t["batched"]:
        rows.append(f"| {r['members']} | {r['agent_steps_per_s']:.1f} | {r['vs_single']:.2f}x | "
                    f"{100 * r['fraction_of_peak']:.1f}% |")
    return (f"{t['device_name'] or t['device']}, {t['threads']} torch thread(s), torch {t['torch']}, {t['date']} "
            f"(`{path.relative_to(ROOT)}`):\n\n" + "\n".join(rows))


def performance_blocks(results: Path = RESULTS) -> dict[str, str]:
    """docs/performance.md's generated blocks, from the committed results only."""
    from benchmarks.system.peers import table_md

    root = results.parent
    out = {"perf-system": system_md(root), "perf-peers": table_md(json.loads((root / "peers.json").read_text())),
           "perf-batched-cpu": batched_md(root / "throughput-batched-cpu.json")}
    rows = ["| run | date | federation MB/s | raw gRPC MB/s | of raw | round (median) |", "| --- | --- | --- | --- | --- | --- |"]
    for f in sorted(root.glob("transfer-*.json")):
        t = json.loads(f.read_text())
        tr = t["transfer"]
        rows.append(f"| `{f.name}` | {t['date']} | {tr['federation']['mb_per_s']:.0f} | {tr['raw_grpc']['mb_per_s']:.0f} | "
                    f"{100 * tr['ratio_to_raw']:.1f}% | {tr['federation']['round_seconds_median']:.2f} s |")
    out["perf-transfer"] = "\n".join(rows)
    from benchmarks.system.subnormals import table_md as subnormals_md

    out["perf-subnormals"] = subnormals_md(root / "subnormals.json")
    gpu = root / "throughput-batched-cuda.json"
    out["perf-batched-gpu"] = batched_md(gpu) if gpu.exists() else \
        "Not measured yet: it needs a GPU (`python -m benchmarks.system.throughput --batched L1,L2,... --device cuda`)."
    return out


def benchmarks_blocks(results: Path = RESULTS) -> dict[str, str]:
    """BENCHMARKS.md's blocks this command renders (the rest are ``benchmarks.paper``'s)."""
    from benchmarks.system.peers import table_md as peers_md

    return {"system": system_md(results.parent),
            "batched-throughput": batched_md(results.parent / "throughput-batched-cpu.json"),
            "peers": peers_md(json.loads((results.parent / "peers.json").read_text())),
            "several-runs": several_runs_md(results.parent / "several-runs.json")}


def several_runs_md(path: Path) -> str:
    """The several-runs measurement (``benchmarks.system.several_runs``): runs together beside the
    same runs one after another, on one fleet, in one invocation."""
    if not path.exists():
        return "Not measured yet: `python -m benchmarks.system.several_runs`."
    t = json.loads(path.read_text())
    return (f"{t['runs']} runs of {t['rounds']} rounds x {t['local_steps']} local steps (DRPO, Hopper data), "
            f"{t['agents']} agent processes, {t['cpus']} CPUs, agents taking "
            + ("the runs' tasks in turn" if t["runs_at_once"] == 1 else f"up to {t['runs_at_once']} runs at once")
            + f", {t['date']} (`{path.relative_to(ROOT)}`):\n\n"
            "| the runs | wall time, first start to last finish |\n| --- | --- |\n"
            f"| one after another | {t['one_after_another_seconds']:.1f} s |\n"
            f"| together on one federation | {t['together_seconds']:.1f} s ({t['speedup']:.2f}x faster) |")


def replace_blocks(text: str, blocks_: dict[str, str]) -> str:
    from benchmarks.common import replace_blocks as fill

    return fill(text, blocks_)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.system.readme", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("measure")
    m.add_argument("what", choices=("up", "by-hand", "suite"))
    m.add_argument("--loaded-runs", type=int, default=3, help="suite: runs beside the burners after the idle one")
    m.add_argument("--burners", type=int, default=2, help="suite: CPU burners (busy loops) beside those runs")
    m.add_argument("--beside", default="", help="suite: what else loads the machine in the loaded runs, in words "
                                                "(e.g. other jobs at the tests' priority, with --burners 0)")
    m.add_argument("--after-idle", default="", help="suite: a shell command run after the idle run (e.g. resuming "
                                                    "those jobs)")
    m.add_argument("--keep-loaded", action="store_true",
                   help="suite: add the new loaded runs to those the results file has (each keeps its commit)")
    sub.add_parser("render")
    a = ap.parse_args(argv)
    if a.cmd == "measure":
        if a.what == "suite":
            return measure_suite(a.loaded_runs, a.burners, a.beside, a.after_idle, a.keep_loaded)
        return {"up": measure_up, "by-hand": measure_by_hand}[a.what]()
    README.write_text(replace_blocks(README.read_text(), blocks()))
    PERFORMANCE.write_text(replace_blocks(PERFORMANCE.read_text(), performance_blocks()))
    BENCHMARKS.write_text(replace_blocks(BENCHMARKS.read_text(), benchmarks_blocks()))
    print(f"updated {README}, {PERFORMANCE} and {BENCHMARKS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
