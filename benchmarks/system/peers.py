"""This federation beside Flower on the same work, alternating, in one run.

    python -m benchmarks.system.peers [--clients 10] [--small-rounds 200] [--large-rounds 5] [--repeats 2]
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
(``start_server`` / ``start_client``, ``benchmarks/system/flower_side.py``) and through its current
deployment engine: one ``flower-superlink`` and N ``flower-supernode`` processes started here,
insecure, on 127.0.0.1, and ``flwr run`` submitting the Flower App in ``benchmarks/system/flower_app``
(FedAvg over echo ClientApps, rounds timed inside the ServerApp like the legacy side's). In Flower
1.42 that engine's Fleet, Control and runtime APIs are HTTP on one port, the ServerApp runs in a
subprocess of the SuperLink and each message to a node in a fresh ``flwr-clientapp`` process of
its SuperNode (the defaults); its CPU and memory are therefore measured over process trees: a
side's CPU seconds are those of every process under its roots (exited children included, through
the kernel's cutime/cstime), its peak RSS the largest sum of its processes' resident sets seen at
one poll (the SuperLink with its SuperExec and ServerApp; the largest SuperNode with its
children). Deployment rounds are slow, so
that path runs ``--deployment-rounds`` rounds per repeat (``0`` skips it).
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

from benchmarks.common import RESULTS, ROOT

HERE = Path(__file__).resolve().parent
VENV = ROOT / "benchmarks" / ".venv-flwr"
FLWR_PIN = "flwr==1.42.0"


def ensure_flower() -> Path:
    from benchmarks.common import ensure_venv

    return ensure_venv(VENV, "flwr, numpy", [FLWR_PIN, "numpy"], FLWR_PIN)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stat(pid: int) -> tuple[int, float, float] | None:
    """(parent pid, own CPU seconds, CPU seconds of its exited and reaped children) of a live process."""
    try:
        f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    tick = os.sysconf("SC_CLK_TCK")
    return int(f[1]), (int(f[11]) + int(f[12])) / tick, (int(f[13]) + int(f[14])) / tick


def _all_stats() -> dict[int, tuple[int, float, float]]:
    """:func:`_stat` of every live process."""
    return {int(d.name): st for d in Path("/proc").iterdir() if d.name.isdigit()
            for st in [_stat(int(d.name))] if st is not None}


def _hwm_mb(pid: int, field: str = "VmHWM:") -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


class Watch:
    """Polls the CPU seconds and peak RSS of processes while they live (both vanish at exit).

    With ``trees=True`` each process stands for its whole tree: CPU is the sum over the live
    processes under it of their own and their reaped children's seconds (a child that exits is
    counted once, in its parent's cutime/cstime), RSS the largest sum of the tree's processes'
    resident sets seen at one poll (its processes come and go: a ClientApp per message). CPU only
    grows, so its last reading stands when the tree is gone."""

    def __init__(self, procs: list[subprocess.Popen], trees: bool = False) -> None:
        self.procs = procs
        self.trees = trees
        self.cpu = {p.pid: 0.0 for p in procs}
        self.rss = {p.pid: 0.0 for p in procs}

    @staticmethod
    def _tree(root: int, parents: dict[int, int]) -> list[int]:
        out, todo = [], [root]
        while todo:
            pid = todo.pop()
            out.append(pid)
            todo.extend(c for c, pp in parents.items() if pp == pid)
        return out

    def poll(self) -> None:
        if not self.trees:
            for p in self.procs:
                st = _stat(p.pid)
                if st is not None:  # exited: its last readings stand
                    self.cpu[p.pid] = st[1]
                    self.rss[p.pid] = max(self.rss[p.pid], _hwm_mb(p.pid))
            return
        stats = _all_stats()
        parents = {pid: st[0] for pid, st in stats.items()}
        for p in self.procs:
            if p.pid not in stats:
                continue
            tree = self._tree(p.pid, parents)
            self.cpu[p.pid] = max(self.cpu[p.pid], sum(stats[q][1] + stats[q][2] for q in tree if q in stats))
            self.rss[p.pid] = max(self.rss[p.pid], sum(_hwm_mb(q, "VmRSS:") for q in tree))

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


APP = HERE / "flower_app"


def _wait_port(port: int, proc: subprocess.Popen, log: Path, limit: float = 120.0) -> None:
    end = time.monotonic() + limit
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"exited ({proc.returncode}) before listening on {port}: " + log.read_text()[-2000:])
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.2)
    raise RuntimeError(f"nothing listened on {port} within {limit:.0f} s: " + log.read_text()[-2000:])


def flower_deployment_rounds(py: Path, clients: int, rounds: int, n_params: int, tmp: Path, app: Path = APP,
                             config: str = "", round_timeout: int = 60) -> dict:
    """Flower's deployment engine: a SuperLink, ``clients`` SuperNodes and ``flwr run`` of ``app``
    (``benchmarks/system/flower_app``; ``config``: more of its run config); every process is a child of
    this one and is ended on the way out."""
    bin_dir = py.parent
    home = tmp / "flwr-home"  # Flower's config (the SuperLink connection) and app cache, not ~/.flwr
    home.mkdir()
    # The SuperLink keeps its state in memory (its default): with a SQLite file (``--database``)
    # ten nodes pushing replies at once hit "database is locked", the replies were lost and the
    # round waited for them until its timeout (seen here, 2026-11-26).
    link_port = _free_port()
    (home / "config.toml").write_text(f'[superlink]\ndefault = "bench"\n\n[superlink.bench]\n'
                                      f'address = "127.0.0.1:{link_port}"\ninsecure = true\n')
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "GRPC_VERBOSITY": "ERROR", "FLWR_HOME": str(home),
           "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"}  # it starts flower-superexec by name
    out = tmp / "flower-deployment.json"
    logs = {n: tmp / f"{n}.log" for n in ("superlink", "supernodes", "run")}
    files = {n: open(f, "w") for n, f in logs.items()}  # noqa: SIM115 - closed in finally
    procs: list[subprocess.Popen] = []
    try:
        link = subprocess.Popen([str(bin_dir / "flower-superlink"), "--insecure", "--host", "127.0.0.1",
                                 "--port", str(link_port), "--disable-runtime-dependency-installation"],
                                stdout=files["superlink"], stderr=subprocess.STDOUT, env=env, cwd=tmp)
        procs.append(link)
        _wait_port(link_port, link, logs["superlink"])
        nodes = [subprocess.Popen([str(bin_dir / "flower-supernode"), "--insecure", "--superlink",
                                   f"127.0.0.1:{link_port}", "--host", "127.0.0.1", "--port", str(_free_port())],
                                  stdout=files["supernodes"], stderr=subprocess.STDOUT, env=env, cwd=tmp)
                 for _ in range(clients)]
        procs.extend(nodes)
        cfg = (f"num-server-rounds={rounds} params={n_params} nodes={clients} round-timeout={round_timeout} "
               f"out='{out}' {config}").strip()
        run = subprocess.Popen([str(bin_dir / "flwr"), "run", str(app), "bench", "--stream", "--run-config", cfg],
                               stdout=files["run"], stderr=subprocess.STDOUT, env=env, cwd=tmp)
        procs.append(run)
        w = Watch([link, *nodes], trees=True)
        end = time.monotonic() + 120 + round_timeout * rounds  # the ServerApp gives up on a round then
        at_first = None
        while not out.exists():
            if run.poll() is not None and not out.exists():
                time.sleep(1.0)  # the file is written just before the run ends
                if not out.exists():
                    raise RuntimeError(f"flwr run ended ({run.returncode}) without results: "
                                       + logs["run"].read_text()[-3000:] + logs["superlink"].read_text()[-2000:])
            assert time.monotonic() < end, "Flower's deployment run did not end"
            w.poll()
            if at_first is None and Path(f"{out}.progress").exists():
                at_first = w.snapshot()
            time.sleep(0.1)
        w.poll()
    finally:
        parents = {pid: st[0] for pid, st in _all_stats().items()}
        family = {q for p in procs for q in Watch._tree(p.pid, parents)}  # SuperExecs, apps
        for p in procs:
            if p.poll() is None:
                p.terminate()
        for p in procs:
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()
        for pid in family - {p.pid for p in procs}:  # detached children that outlived their parents
            try:
                os.kill(pid, 9)
            except OSError:
                pass
        for f in files.values():
            f.close()
    res = json.loads(out.read_text())
    steady = rounds - 1
    base = at_first or {pid: 0.0 for pid in w.cpu}
    return {"round_seconds": res["round_seconds"], "flwr": res["flwr"], "path": res["path"],
            "cpu_ms_per_round": {"server": (w.cpu[link.pid] - base[link.pid]) / steady * 1e3,
                                 "clients_total": sum(w.cpu[n.pid] - base[n.pid] for n in nodes) / steady * 1e3},
            "peak_rss_mb": {"server": w.rss[link.pid], "client_max": max(w.rss[n.pid] for n in nodes)},
            "cpu_from": "after round 1" if at_first else "whole run (round 1 not seen)"}


def ours_rounds(clients: int, rounds: int, config: dict, tmp: Path) -> dict:
    from benchmarks.system.procs import WARMUP_ROUNDS
    from benchmarks.system.services import federation_rounds

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


SIDES = {"ours": "this federation", "flower": "Flower 1.42.0, legacy gRPC",
         "flower_deployment": "Flower 1.42.0, deployment engine (SuperLink + SuperNodes)"}


def table_md(res: dict) -> str:
    """The BENCHMARKS.md table of a results file (``python -m benchmarks.system.peers table``)."""
    head = ("| model | side | round ms (median) | p90 | MB/s moved | CPU ms/round server / clients "
            "| peak RSS MB server / client | rounds |")
    lines = [head, "|---|---|---|---|---|---|---|---|"]
    for name, r in res["sizes"].items():
        label = {"hopper_policy": "Hopper policy"}.get(name, name.replace("model_", "").replace("mb", " MB model"))
        for side, title in SIDES.items():
            if side not in r:
                continue
            x = r[side]
            lines.append(f"| {label} ({r['model_bytes'] / 1e6:.2f} MB) | {title} | {x['round_ms_median']:.1f} | "
                         f"{x['round_ms_p90']:.1f} | {x['mb_per_s']:.0f} | {x['cpu_ms_per_round']['server']:.0f} / "
                         f"{x['cpu_ms_per_round']['clients_total']:.0f} | {x['peak_rss_mb']['server']:.0f} / "
                         f"{x['peak_rss_mb']['client_max']:.0f} | {x['rounds_measured']} |")
    return "\n".join(lines) + "\n\n" + reading_md(res)


def reading_md(res: dict) -> str:
    """The table's reading, from the same file: our round time over Flower's fastest path's per
    size (target: at most 0.5x), the deployment engine's rounds and the machine's load."""
    parts, met = [], []
    for name, r in res["sizes"].items():
        label = "the Hopper policy" if name == "hopper_policy" else f"the {r['model_bytes'] / 1e6:.0f} MB model"
        x = 1 / r["fastest_flower_over_ours_round_time"]
        parts.append(f"{x:.2f}x" + (" the time of Flower's fastest path" if not parts else "") + f" with {label}")
        met.append(x <= 0.5 and min(v for k, v in r.items() if k.startswith("ours_over_")) >= 2)  # MB/s ratios
    text = (f"Reading ({res['date']}, {res['clients']} clients, {res['cores']} cores, 1-minute load "
            f"{res['machine_state_loadavg_at_start'][0]:.1f} at the start and "
            f"{res['machine_state_loadavg_at_end'][0]:.1f} at the end): our round takes "
            + " and ".join(parts) + "; the target (at most half of Flower's "
            "fastest path's round time, and twice its transfer, in the same run) is "
            + ("met for every size." if all(met) else "not met for every size."))
    dep = [r["flower_deployment"] for r in res["sizes"].values() if "flower_deployment" in r]
    if dep:
        secs = [d["round_ms_median"] / 1e3 for d in dep]
        cpu = [d["cpu_ms_per_round"]["clients_total"] / res["clients"] / 1e3 for d in dep]
        text += (f" The deployment engine starts a Python process per message ({min(cpu):.1f}-{max(cpu):.1f} s of "
                 f"CPU per node per round), so its round takes {min(secs):.1f}-{max(secs):.1f} s whatever the "
                 "model's size.")
    return text


def main(argv: list[str] | None = None) -> int:
    from benchmarks.system.services import HOPPER_POLICY_BYTES

    if argv is None:
        argv = sys.argv[1:]
    if argv[:1] == ["table"]:
        print(table_md(json.loads(Path(argv[1] if len(argv) > 1 else RESULTS / "peers.json").read_text())))
        return 0
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--clients", type=int, default=10)
    # 200: both sides' Hopper rounds still fall over their first ~30 (ours 18 -> 13 ms, Flower's
    # 37 -> 23 ms on 2026-11-27), so 30 rounds measured a warm-up; the median of 200 is steady
    p.add_argument("--small-rounds", type=int, default=200)
    p.add_argument("--large-rounds", type=int, default=5)
    p.add_argument("--deployment-rounds", type=int, default=4,
                   help="rounds per repeat on Flower's deployment engine (seconds each; 0 skips it)")
    p.add_argument("--mb", type=int, default=30)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--out", default=str(RESULTS / "peers.json"))
    a = p.parse_args(argv)
    py = ensure_flower()
    h = int((a.mb * 1e6 / 4) ** 0.5)  # fed-bc with hidden (h, h): ~mb MB (as benchmarks.system.services transfer)
    large_bytes = (11 * h + h + h * h + h + h * 6 + 6 + 22) * 4
    sizes = {"hopper_policy": (HOPPER_POLICY_BYTES, a.small_rounds, {"algo": "drpo"}),
             f"model_{a.mb}mb": (large_bytes, a.large_rounds, {"algo": "fed-bc", "bc": {"hidden": [h, h]}})}
    out = {"clients": a.clients, "date": time.strftime("%Y-%m-%d"), "cores": os.cpu_count(),
           "machine_state_loadavg_at_start": os.getloadavg(), "sizes": {}}
    for name, (nbytes, rounds, cfg) in sizes.items():
        if rounds < 1:  # --small-rounds 0 / --large-rounds 0: that size is left out
            continue
        runs: dict[str, list[dict]] = {"ours": [], "flower": [], "flower_deployment": []}
        for i in range(a.repeats):  # ours, legacy, deployment, ours, ...: the same moments of a shared machine
            with tempfile.TemporaryDirectory() as d:
                runs["ours"].append(ours_rounds(a.clients, rounds, cfg, Path(d)))
            with tempfile.TemporaryDirectory() as d:
                runs["flower"].append(flower_rounds(py, a.clients, rounds + 1, nbytes // 4, Path(d)))
            if a.deployment_rounds > 1:
                with tempfile.TemporaryDirectory() as d:
                    runs["flower_deployment"].append(
                        flower_deployment_rounds(py, a.clients, a.deployment_rounds, nbytes // 4, Path(d)))
            for side, rs in runs.items():
                if rs:
                    skip = 0 if side == "ours" else 1
                    print(f"{name} {side} #{i + 1}: median {np.median(rs[-1]['round_seconds'][skip:]) * 1e3:.1f} ms",
                          flush=True)
        r = {"model_bytes": nbytes}
        for side, rs in runs.items():
            if rs:
                r[side] = summarise(rs, nbytes, a.clients, 0 if side == "ours" else 1)
        fl = [s for s in ("flower", "flower_deployment") if s in r]
        fastest = min(fl, key=lambda s: r[s]["round_ms_median"])
        r |= {f"{s}_over_ours_round_time": r[s]["round_ms_median"] / r["ours"]["round_ms_median"] for s in fl}
        r |= {f"ours_over_{s}_mb_per_s": r["ours"]["mb_per_s"] / r[s]["mb_per_s"] for s in fl}
        r["flower_fastest_path"] = fastest
        r["fastest_flower_over_ours_round_time"] = r[f"{fastest}_over_ours_round_time"]
        out["sizes"][name] = r
        print(f"{name}: ours {r['ours']['round_ms_median']:.1f} ms; "
              + ", ".join(f"{s} {r[s]['round_ms_median']:.1f} ms ({r[f'{s}_over_ours_round_time']:.2f}x)" for s in fl),
              flush=True)
    out["machine_state_loadavg_at_end"] = os.getloadavg()
    out["flower"] = {"version": FLWR_PIN, "paths": {s: SIDES[s] for s in ("flower", "flower_deployment")
                                                    if any(s in r for r in out["sizes"].values())}}
    Path(a.out).write_text(json.dumps(out, indent=1))
    print(table_md(out))
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
