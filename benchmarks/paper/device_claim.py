"""The claim preset's cells on a GPU machine lent for a few minutes: measure, choose, run, pack.

    python -m benchmarks.paper.device_claim --budget 540 --out DIR [--cells K1,K2,...] [--device cuda]

A lent GPU machine (DEVELOPERS.md) gives one session ~10 minutes of one command. A claim cell is
50,000 gradient steps (5 agents x 10 rounds x 1,000 local steps); this script:

1. measures DRPO and BC update steps per second on the device with 1 process, and DRPO's with
   several processes sharing the GPU at once (each process times the same wall-clock window), with
   and without CUDA MPS when its control daemon can be started (``--no-mps`` skips it);
2. from those rates, picks the longest prefix of ``--cells`` (priority order: every method's seed 0,
   then seed 1, then seed 2, hopper-medium first) that should finish inside the budget, all at once,
   one process each;
3. runs them with ``python -m benchmarks.paper run --preset claim --only ... --device cuda``, stopped
   at the budget's end whatever state they are in (every round is checkpointed and its evaluation
   written to ``rounds.jsonl`` as it closes);
4. packs the finished results, every cell's ``rounds.jsonl``/``progress.log``, the rates and the
   machine's description into ``DIR/claim-device.tgz`` and ``DIR/device.json``.

Unpack here with ``python -m benchmarks.paper.device_claim unpack FILE.tgz``: finished cells go to
``benchmarks/results/paper-claim/table/`` (their config says ``device: cuda`` and they carry the
GPU's name); unfinished cells' per-round rows go to ``benchmarks/results/paper-claim/partial-device/``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

from benchmarks.common import ROOT

# a cell's update cost relative to a DRPO step (BC's update is the actor's alone); BC's is measured
COST = {"drpo": 1.0, "fed-cql": 1.0, "cql": 1.0}


def default_cells() -> list[str]:
    methods = ("drpo", "fed-cql", "cql", "fed-bc", "fed-bc-3e-4")
    return [f"{m}-{d}-s{s}" for d in ("medium", "medium-replay") for s in (0, 1, 2) for m in methods]


def log(msg: str) -> None:
    print(f"{time.strftime('%H:%M:%S')} {msg}", flush=True)


# -- measuring -------------------------------------------------------------------------------
def worker(algo: str, device: str, start: float, seconds: float) -> None:
    """Warm up, then count update steps in the wall-clock window [start, start + seconds]."""
    import numpy as np
    import torch

    from benchmarks.common import synthetic_transitions
    from fedrl.algos import BCConfig, DRPOConfig
    from fedrl.data.buffer import TensorBuffer
    from fedrl.federation.round import build_learner, returns_gamma

    torch.set_num_threads(1)
    dev = torch.device(device)
    cfg = DRPOConfig() if algo == "drpo" else BCConfig()
    learner = build_learner(cfg, 11, 3, dev, 0, 0)
    buf = TensorBuffer(synthetic_transitions(11, 3), np.zeros(11, np.float32), np.ones(11, np.float32), dev,
                       returns_gamma(cfg))
    learner.begin_round(learner.shared_state())
    while True:  # warm until the window opens (at least 20 steps)
        for _ in range(20):
            learner.update(buf.sample(cfg.batch_size, learner.gen))
        torch.cuda.synchronize(dev) if dev.type == "cuda" else None
        if time.time() >= start:
            break
    n, t0 = 0, time.time()
    while time.time() < start + seconds:
        for _ in range(10):
            learner.update(buf.sample(cfg.batch_size, learner.gen))
        n += 10
    torch.cuda.synchronize(dev) if dev.type == "cuda" else None
    print(json.dumps({"steps": n, "seconds": time.time() - t0}), flush=True)


def rate(procs: int, algo: str, device: str, seconds: float = 6.0, lead: float = 12.0) -> float:
    """Aggregate update steps/s of ``procs`` processes sharing the device in one window."""
    start = time.time() + lead  # every process starts CUDA and warms up before the window
    ps = [subprocess.Popen([sys.executable, "-m", "benchmarks.paper.device_claim", "worker", "--algo", algo,
                            "--device", device, "--start", str(start), "--seconds", str(seconds)],
                           cwd=ROOT, stdout=subprocess.PIPE, text=True) for _ in range(procs)]
    total = 0.0
    for p in ps:
        out, _ = p.communicate(timeout=lead + seconds + 120)
        if p.returncode != 0:
            raise RuntimeError(f"probe worker failed ({p.returncode})")
        r = json.loads(out.strip().splitlines()[-1])
        total += r["steps"] / r["seconds"]
    return total


def start_mps() -> bool:
    exe = shutil.which("nvidia-cuda-mps-control")
    if exe is None:
        return False
    try:
        return subprocess.run([exe, "-d"], timeout=20, check=False).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def mps_client_works(device: str) -> bool:
    """Whether a fresh process can put work on ``device`` through the MPS daemon just started: a
    daemon that starts but refuses its clients would otherwise fail every cell at its first tensor."""
    try:
        return subprocess.run([sys.executable, "-c", f"import torch; torch.ones(2, device={device!r}).sum().item()"],
                              timeout=90, check=False, capture_output=True).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def rates_no_mps_top(info: dict) -> float:
    """The most DRPO steps per second measured without MPS, all processes together."""
    return max(float(v) for v in info["rates_no_mps"].values())


def stop_mps() -> None:
    exe = shutil.which("nvidia-cuda-mps-control")
    if exe:
        try:
            subprocess.run([exe], input="quit\n", text=True, timeout=20, check=False)
        except (OSError, subprocess.TimeoutExpired):
            pass
        time.sleep(1)


def method_of(key: str) -> str:
    """``fed-bc-3e-4-medium-replay-s1`` -> ``fed-bc-3e-4``."""
    return key.split("-medium")[0].split("-expert")[0]


def estimate(cells: list[str], rates: dict[int, float], bc_ratio: float, steps_per_cell: int) -> float:
    """Seconds for ``cells`` run at once: their work at the measured aggregate rate (interpolated
    between measured process counts), plus 15% and a minute for data, evaluation and start."""
    j = len(cells)
    ks = sorted(rates)
    lo = max([k for k in ks if k <= j], default=ks[0])
    hi = min([k for k in ks if k >= j], default=ks[-1])
    agg = rates[lo] if hi == lo else rates[lo] + (rates[hi] - rates[lo]) * (j - lo) / (hi - lo)
    per_proc = min(rates[ks[0]] / ks[0], agg / j)  # no process runs faster than one alone
    work = sum(COST.get(method_of(c), bc_ratio) for c in cells) * steps_per_cell
    slowest = steps_per_cell / per_proc
    return max(work / agg, slowest) * 1.15 + 60


def main_run(a) -> int:
    t_start = time.time()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    info: dict = {"started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "budget_s": a.budget}
    try:
        info["nvidia_smi"] = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version",
                                             "--format=csv,noheader"], capture_output=True, text=True,
                                            timeout=20, check=False).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        info["nvidia_smi"] = "unavailable"
    import torch

    info["torch"] = torch.__version__
    info["cpus"] = os.cpu_count()
    log(f"device: {info['nvidia_smi']}, torch {info['torch']}, {info['cpus']} CPUs")
    from benchmarks.paper import cells as runs, presets

    pre = presets.PRESETS[a.preset]
    if a.cells:
        cells = a.cells.split(",")
    elif a.experiment == "table":
        cells = default_cells()
    else:  # the experiment's own order (the paper harness's: every setting at seed 0 first)
        cells = [r.key for r in presets.plan(pre, a.experiment, pre.seeds)]
    done = Path(a.results) / f"paper-{a.preset}" / a.experiment
    cells = [c for c in cells if not (done / f"{c}.json").exists()]  # finished ones are committed
    use_mps = False
    if a.rates:  # a previous run's measurements: the minutes go to the cells
        prev = json.loads(Path(a.rates).read_text())
        rates = {int(k): v for k, v in (prev.get("rate_mps") if prev.get("mps") else prev["rates_no_mps"]).items()}
        rates[1] = prev["rates_no_mps"]["1"]
        r1, bc1 = rates[1], prev["bc_steps_per_s_1proc"]
        info.update(rates_from=a.rates, rates_no_mps=prev["rates_no_mps"], bc_steps_per_s_1proc=bc1)
        if prev.get("mps") and a.mps:
            use_mps = start_mps() and mps_client_works(a.device)
            if not use_mps:
                stop_mps()
            info["rate_mps"] = prev.get("rate_mps")
        log(f"rates from {a.rates}: {rates}, MPS {use_mps}")
    else:
        r1 = rate(1, "drpo", a.device)
        bc1 = rate(1, "bc", a.device)
        rates = {1: r1}
        log(f"1 process: DRPO {r1:.0f} steps/s, BC {bc1:.0f} steps/s")
        for n in a.probe:
            rates[n] = rate(n, "drpo", a.device)
            log(f"{n} processes: DRPO {rates[n]:.0f} steps/s together")
        info["rates_no_mps"] = dict(rates)
        info["bc_steps_per_s_1proc"] = bc1
    mps_ok = False
    if a.mps and not a.rates and start_mps():
        mps_ok = mps_client_works(a.device)
        if not mps_ok:
            stop_mps()
            log("MPS daemon started but a client could not use the GPU through it: without MPS")
    if mps_ok:
        try:
            top = max(a.probe)
            with_mps = rate(top, "drpo", a.device)
            info["rate_mps"] = {top: with_mps}
            log(f"{top} processes with MPS: DRPO {with_mps:.0f} steps/s together")
            if with_mps > rates[top] * 1.1:
                use_mps = True
                rates = {1: r1, top: with_mps}
        except (RuntimeError, subprocess.TimeoutExpired) as e:
            log(f"MPS probe failed: {e}")
        if not use_mps:
            stop_mps()
    info["mps"] = use_mps
    bc_ratio = r1 / bc1  # a BC step's cost in DRPO steps
    by_key = {r.key: r for r in presets.plan(pre, a.experiment, pre.seeds)}
    unknown = [c for c in cells if c not in by_key]
    if unknown:
        raise SystemExit(f"not cells of the {a.preset} preset's {a.experiment}: {', '.join(unknown)}")
    info["experiment"] = a.experiment
    steps_per_cell = pre.agents * pre.rounds * pre.local_steps
    left = a.budget - (time.time() - t_start) - 30  # packing
    chosen: list[str] = []
    if a.at_once:  # the operator's count, from an earlier run's round times (see the module's doc)
        n = a.at_once if use_mps else max(1, int(rates_no_mps_top(info) / r1))
        chosen = cells[:n]
        log(f"--at-once {a.at_once}: {len(chosen)} cells" + ("" if use_mps else " (no MPS: what one GPU time-slices at full speed)"))
    else:
        for j in range(min(len(cells), a.max_procs), 0, -1):
            if estimate(cells[:j], rates, bc_ratio, steps_per_cell) <= left:
                chosen = cells[:j]
                break
    if not chosen:
        chosen = cells[: min(3, len(cells))]
        log(f"no prefix fits {left:.0f}s by the estimate; running {len(chosen)} cells for their partial rows")
    info["chosen"] = chosen
    info["estimated_s"] = estimate(chosen, rates, bc_ratio, steps_per_cell)
    log(f"running {len(chosen)} cells at once (estimated {info['estimated_s']:.0f}s of {left:.0f}s left): "
        + ", ".join(chosen))
    cmd = [sys.executable, "-m", "benchmarks.paper", "run", "--preset", a.preset, "--experiment", a.experiment,
           "--only", ",".join(chosen), "--jobs", str(len(chosen)), "--device", a.device, "--results", str(a.results)]
    left = a.budget - (time.time() - t_start) - 25
    t0 = time.time()
    p = subprocess.Popen(cmd, cwd=ROOT, start_new_session=True)
    try:
        info["returncode"] = p.wait(timeout=max(10, left))
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, 9)
        p.wait()
        info["returncode"] = "stopped at the budget"
    info["run_seconds"] = round(time.time() - t0, 1)
    log(f"cells ended: {info['returncode']} after {info['run_seconds']}s")
    (out / "device.json").write_text(json.dumps(info, indent=1))
    with tarfile.open(out / "claim-device.tgz", "w:gz") as tar:
        res = Path(a.results) / f"paper-{a.preset}" / a.experiment
        packed_ck = 0
        for k in chosen:
            f = res / f"{k}.json"
            if f.exists() and f.stat().st_mtime >= t_start:  # finished in this run
                tar.add(f, f"results/{k}.json")
            work = runs.work_dir(pre, by_key[k], Path(a.results))
            names = ["rounds.jsonl", "progress.log", "config.json"]
            ck = work / "checkpoint.safetensors"  # an unfinished cell resumes from it on a GPU later
            if ck.exists() and packed_ck + ck.stat().st_size < 12 << 20:  # a returned file's limit is 16 MiB
                names.append("checkpoint.safetensors")
                packed_ck += ck.stat().st_size
            for name in names:
                if (work / name).exists():
                    tar.add(work / name, f"work/{k}/{name}")
        tar.add(out / "device.json", "device.json")
    if use_mps:
        stop_mps()
    return 0


def main_unpack(a) -> int:
    """Put a packed device run's results where render reads them."""
    res = Path(a.results) / "paper-claim"
    with tarfile.open(a.file) as tar:
        names = tar.getnames()
        dev = json.load(tar.extractfile("device.json"))
        exp = dev.get("experiment", "table")
        (res / "device").mkdir(parents=True, exist_ok=True)
        name = "device.json" if exp == "table" else f"device-{exp}.json"  # the table's holds the rates --rates reads
        (res / "device" / name).write_text(json.dumps(dev, indent=1))
        for n in names:
            if n.startswith("results/"):
                dst = res / exp / Path(n).name
                dst.parent.mkdir(parents=True, exist_ok=True)
                dst.write_bytes(tar.extractfile(n).read())
                print(f"finished: {dst}")
        for n in names:
            if n.startswith("work/") and n.endswith("rounds.jsonl"):
                key = n.split("/")[1]
                if (res / exp / f"{key}.json").exists():
                    continue
                dst = res / "partial-device" / f"{key}.rounds.jsonl"
                dst.parent.mkdir(parents=True, exist_ok=True)
                dst.write_bytes(tar.extractfile(n).read())
                print(f"unfinished, rows kept: {dst}")
                ck = f"work/{key}/checkpoint.safetensors"
                if ck in names:  # the work folder a later --device cuda run resumes from (carry runs/)
                    work = Path(a.runs) / "paper-claim" / exp / key
                    work.mkdir(parents=True, exist_ok=True)
                    for f in ("config.json", "rounds.jsonl", "progress.log", "checkpoint.safetensors"):
                        if f"work/{key}/{f}" in names:
                            (work / f).write_bytes(tar.extractfile(f"work/{key}/{f}").read())
                    print(f"  resumable on a GPU from {work}")
    return 0


def main_check_cpu(a) -> int:
    """Rerun the first rounds of a finished GPU cell on this machine's CPU, the same configuration
    but the device, and set the two side by side: not bit-identical (other kernels, and the
    minibatch sampler's generator lives on the device), so the question is whether the per-round
    losses and scores agree as two seeds would, or a device-specific path moved them."""
    import dataclasses
    import tempfile

    import torch

    from benchmarks.common import code_revision, device_name
    from benchmarks.paper import cells as runs, presets
    from fedrl.federation.simulate import run as simulate

    res = Path(a.results) / f"paper-{a.preset}"
    gpu = json.loads((res / a.experiment / f"{a.key}.json").read_text())
    if gpu["config"].get("device", "cpu") == "cpu":
        raise SystemExit(f"{a.key} ran on the CPU: nothing to check")
    pre = presets.PRESETS[a.preset]
    spec = {r.key: r for r in presets.plan(pre, a.experiment, pre.seeds)}[a.key]
    cfg = dataclasses.replace(presets.sim_config(pre, spec, "cpu"), rounds=a.rounds)
    torch.set_num_threads(1)
    t0 = time.time()
    with tempfile.TemporaryDirectory() as d:
        summary = simulate(cfg, Path(d), log=lambda m: log(m), checkpoint=False)
        cpu_losses = runs.round_losses(Path(d) / "rounds.jsonl")  # as the result files compute them
    rows = [{"round": i + 1, "score_cpu": summary["curve"][i]["score_mean"], "score_gpu": gpu["curve"][i]["score_mean"],
             "losses_cpu": {k: v[i] for k, v in cpu_losses.items() if k in gpu["losses_per_round"]},
             "losses_gpu": {k: v[i] for k, v in gpu["losses_per_round"].items()}}
            for i in range(a.rounds)]
    out = {"key": a.key, "gpu_device_name": gpu.get("device_name"), "gpu_code_revision": gpu.get("code_revision"),
           "cpu_code_revision": code_revision(), "cpu_device_name": device_name("cpu"),
           "rounds": rows, "cpu_wall_seconds": round(time.time() - t0, 1)}
    dst = res / "device" / f"cpu-check-{a.key}.json"
    dst.parent.mkdir(parents=True, exist_ok=True)
    dst.write_text(json.dumps(out, indent=1))
    for r in rows:
        print(f"round {r['round']}: score CPU {r['score_cpu']:.1f}, GPU {r['score_gpu']:.1f}")
        for k in r["losses_gpu"]:
            if k in r["losses_cpu"]:
                print(f"  {k:14s} CPU {r['losses_cpu'][k]:9.3f}  GPU {r['losses_gpu'][k]:9.3f}")
    print(f"wrote {dst}")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.paper.device_claim", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--budget", type=float, default=540, help="seconds for everything, packing included")
    ap.add_argument("--out", default="device-out")
    ap.add_argument("--cells", default=None, help="comma-separated cells of the experiment, in priority order")
    ap.add_argument("--experiment", default="table", choices=("table", "lambdas"),
                    help="the claim preset's experiment whose cells run (lambdas: the heterogeneous lambda2 sweep)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--preset", default="claim", help="benchmarks.paper preset (smoke: to try this script)")
    ap.add_argument("--results", default=str(ROOT / "benchmarks" / "results"))
    ap.add_argument("--probe", type=lambda s: [int(x) for x in s.split(",")], default=[6, 15],
                    help="process counts whose shared rate is measured (default 6,15)")
    ap.add_argument("--max-procs", type=int, default=15)
    ap.add_argument("--at-once", type=int, default=0,
                    help="run the first N unfinished cells at once under MPS, skipping the estimate (which "
                         "ignores that a process below the GPU's saturation keeps its own rate); without MPS, "
                         "only as many as the measured time-sliced rate runs at full speed")
    ap.add_argument("--rates", default=None,
                    help="a previous run's device.json: use its measured rates instead of probing "
                         "(benchmarks/results/paper-claim/device/device.json)")
    ap.add_argument("--no-mps", dest="mps", action="store_false")
    sub = ap.add_subparsers(dest="cmd")
    w = sub.add_parser("worker")
    w.add_argument("--algo", default="drpo")
    w.add_argument("--device", default="cuda")
    w.add_argument("--start", type=float, required=True)
    w.add_argument("--seconds", type=float, default=6.0)
    u = sub.add_parser("unpack")
    u.add_argument("file")
    u.add_argument("--runs", default=str(ROOT / "runs"), help="where resumable work folders go")
    c = sub.add_parser("check-cpu", help="rerun a GPU cell's first rounds on the CPU and compare")
    c.add_argument("key")
    c.add_argument("--rounds", type=int, default=1)
    c.add_argument("--experiment", default="table", choices=("table", "lambdas"))
    a = ap.parse_args(argv)
    if a.cmd == "worker":
        worker(a.algo, a.device, a.start, a.seconds)
        return 0
    if a.cmd == "unpack":
        return main_unpack(a)
    if a.cmd == "check-cpu":
        return main_check_cpu(a)
    return main_run(a)


if __name__ == "__main__":
    sys.exit(main())
