"""``fedrl up``: the whole federation on this machine as real processes on 127.0.0.1.

Starts the aggregator, the evaluator and N agents (each its own OS process, free ports),
starts the run through the Control API, prints round-by-round progress and writes a run folder:

    <out>/run_config.json      the validated run configuration
    <out>/rounds.jsonl, .csv   one row per round: losses, seconds, evaluation
    <out>/learning_curve.png   evaluated return per round
    <out>/global_policy.safetensors   the final global policy (``fedrl evaluate`` reads it)
    <out>/summary.json
    <out>/state/               the aggregator's state directory (every global version)
    <out>/logs/*.log           each process's log
    <out>/metrics_targets.json every process's Prometheus endpoint
    <out>/prometheus/          with --prometheus: the local Prometheus's config, rules and data

With ``linger`` > 0 every process (and Prometheus) stays up that long after the run, so its
metrics can be looked at; Ctrl-C ends the wait early without changing the exit status.

Exit status: 0 when the run finished and every process behaved; 1 if the run failed or a
process died; 130 on Ctrl-C (every child is stopped first).
"""

from __future__ import annotations

import csv
import json
import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from fedrl.common.lifetime import die_with_parent
from fedrl.federation.runconfig import RunConfig
from fedrl.ops.local_prometheus import PrometheusError
from fedrl.ops.endpoint import METRICS_TOKEN_ENV

STARTUP_TIMEOUT = 120.0

@dataclass
class UpConfig:
    run: RunConfig
    datasets: tuple[str, ...]
    trajectories: int = 5
    out: Path = Path("runs/up")
    device: str = "auto"
    agent_threads: int = 1
    eval_num_envs: int = 10
    python: str = sys.executable
    extra_env: dict[str, str] = field(default_factory=dict)
    prometheus: bool = False
    prometheus_bin: str | None = None
    linger: float = 0.0
    secure: bool = False
    transitions: int = 0  # with > 0, whole trajectories per agent until it holds this many transitions


class ChildFailed(RuntimeError):
    pass


class Launcher:
    def __init__(self, cfg: UpConfig, log: Callable[[str], None] = print, progress: bool = False) -> None:
        self.progress = progress  # a bar with an ETA (a terminal) or a line every 10 s (a pipe)
        self.cfg, self.log = cfg, log
        self.out = Path(cfg.out)
        self.children: dict[str, subprocess.Popen] = {}
        self.logs: list = []
        self.metrics_ports: dict[str, int] = {}
        self.prometheus = None
        self.child_env: dict[str, dict[str, str]] = {}
        self.client_tls = None
        self.data_return: float | None = None  # the agents' data's mean episode return, for the plot
        self.admin_token: str | None = None
        # the local Prometheus's credential on every metrics endpoint: its scrapes come first
        self.metrics_token = secrets.token_urlsafe(24)

    # -- processes ---------------------------------------------------------------------------
    def _port_file(self, name: str) -> Path:
        f = self.out / "ports" / name
        f.unlink(missing_ok=True)
        return f

    def _spawn(self, name: str, module: str, *args: str) -> subprocess.Popen:
        logf = open(self.out / "logs" / f"{name}.log", "w")
        self.logs.append(logf)
        env = {**os.environ, "PYTHONUNBUFFERED": "1", METRICS_TOKEN_ENV: self.metrics_token, **self.cfg.extra_env,
               **self.child_env.get(name, {})}
        metrics = ["--metrics-port", "0", "--metrics-port-file", str(self._port_file(f"{name}.metrics"))]
        p = subprocess.Popen([self.cfg.python, "-m", module, *args, *metrics], stdout=logf,
                             stderr=subprocess.STDOUT, env=env, start_new_session=True,
                             preexec_fn=die_with_parent)
        self.children[name] = p
        return p

    def _wait_port(self, name: str, port_file: Path) -> int:
        end = time.monotonic() + STARTUP_TIMEOUT
        while time.monotonic() < end:
            if port_file.exists():
                return int(port_file.read_text())
            self._check_children()
            time.sleep(0.05)
        raise ChildFailed(f"{name} did not start within {STARTUP_TIMEOUT:.0f}s; see {self.out / 'logs' / name}.log")

    def _check_children(self) -> None:
        for name, p in self.children.items():
            rc = p.poll()
            if rc is not None:
                tail = (self.out / "logs" / f"{name}.log").read_text().strip().splitlines()[-5:]
                raise ChildFailed(f"{name} exited with status {rc}:\n    " + "\n    ".join(tail))

    def stop_children(self, grace: float = 10.0) -> None:
        if self.prometheus is not None:
            self.prometheus.stop()
        for p in self.children.values():
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        end = time.monotonic() + grace
        for p in self.children.values():
            try:
                p.wait(max(0.1, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(5)
        for f in self.logs:
            f.close()

    # -- the run -----------------------------------------------------------------------------
    def run(self) -> int:
        from fedrl.cli.client import ControlClient
        from fedrl.common.device import resolve_device
        from fedrl.data.registry import check_one_env, resolve
        from fedrl.federation.shards import load_shards, parse_source
        from fedrl.federation.simulate import refuse_a_used_folder

        cfg = self.cfg
        # its results would be overwritten and its state directory mixed with this run's
        refuse_a_used_folder(self.out, ("run_config.json", "summary.json", "state"))
        resolve_device(cfg.device)  # the agents run here: a device this machine lacks fails now
        # Make or find the data once, before agents start (they would race to make it).
        check_one_env([parse_source(spec, cfg.run.agents)[0] for spec in cfg.datasets])
        datasets = []
        for spec in cfg.datasets:
            path, n = parse_source(spec, cfg.run.agents)
            datasets.append(f"{resolve(path, progress=self.log)}:{n}")
        n_agents = sum(int(d.rpartition(":")[2]) for d in datasets)
        if n_agents != cfg.run.agents:
            raise ValueError(f"the datasets give {n_agents} agents but the run config says {cfg.run.agents}")
        # The agents' own checks (environment, dimensions, finite values, enough trajectories),
        # once here: bad data is refused before any process starts, not by every agent after.
        shards, _ = load_shards(datasets, cfg.run.agents, cfg.trajectories, cfg.run.seed, cfg.run.env,
                                lambda m: None, cfg.transitions)
        from fedrl.ops.plotting import episode_return_mean
        self.data_return = sum(episode_return_mean(s.transitions.rewards, s.transitions.episode)
                               for s in shards) / len(shards)
        (self.out / "logs").mkdir(parents=True, exist_ok=True)
        (self.out / "ports").mkdir(exist_ok=True)
        (self.out / "run_config.json").write_text(json.dumps(json.loads(cfg.run.to_json()), indent=2))

        tls_args = self._secure(n_agents) if cfg.secure else {}
        agg_port = self._port_file("aggregator")
        self._spawn("aggregator", "aggregator_service", "--port", "0", "--port-file", str(agg_port),
                    "--state-dir", str(self.out / "state"), *tls_args.get("aggregator", ()))
        target = f"127.0.0.1:{self._wait_port('aggregator', agg_port)}"
        ev_port = self._port_file("evaluator")
        if cfg.run.eval_episodes:
            self._spawn("evaluator", "evaluator_service", "--aggregator", target, "--port", "0",
                        "--port-file", str(ev_port), "--seed", str(cfg.run.seed),
                        "--num-envs", str(cfg.eval_num_envs), "--threads", "1", *tls_args.get("evaluator", ()))
        for i in range(n_agents):
            args = ["--aggregator", target, "--shard", str(i), "--trajectories", str(cfg.trajectories),
                    "--transitions", str(cfg.transitions),
                    "--seed", str(cfg.run.seed), "--device", cfg.device, "--threads", str(cfg.agent_threads)]
            for d in datasets:
                args += ["--dataset", d]
            if cfg.run.secagg_threshold:  # the moments too are summed under the masks, never sent
                args.append("--private-moments")
            self._spawn(f"agent-{i}", "agent_service", *args, *tls_args.get(f"agent-{i}", ()))
        self.log(f"aggregator on {target}; {n_agents} agents and "
                 f"{'an evaluator' if cfg.run.eval_episodes else 'no evaluator'} starting (logs in {self.out / 'logs'})")
        self._metrics_endpoints()

        t_run = time.monotonic()
        with ControlClient(target, tls=self.client_tls, token=self.admin_token) as client:
            if cfg.run.eval_episodes:  # every version evaluated: the evaluator follows before round 1
                end = time.monotonic() + STARTUP_TIMEOUT
                while client.status().get("evaluators_following", 0) < 1:
                    self._check_children()
                    if time.monotonic() > end:
                        raise RuntimeError(f"the evaluator did not follow the aggregator within {STARTUP_TIMEOUT:.0f}s")
                    time.sleep(0.1)
            st = client.start(cfg.run)
            self.log(f"run {st['run_id']}: {cfg.run.algo}, {cfg.run.rounds} rounds x {cfg.run.local_steps} local steps"
                     + private_rounds(cfg.run))
            rounds = self._follow(client, st["run_id"])
            final = client.status()
            # a run that stopped at its privacy budget did what it was asked to
            ok = final["state"] == "finished" or (final["state"] == "stopped"
                                                  and final.get("message", "").startswith("privacy budget"))
            if final["global_version"] > 0:
                client.save_policy(self.out / "global_policy.safetensors", final["global_version"])
        summary = self._write_results(rounds, final)
        if not ok:
            self.log(f"run {final.get('run_id')} {final['state']}: {final.get('message', '')}")
        scores = scores_said(summary["best"], summary["final"], max(rounds, default=0))
        dp = final.get("privacy")
        spent = (f"privacy spent: epsilon {dp['epsilon']:.3g} at delta {dp['delta']:g} over {dp['rounds']} rounds; "
                 if dp else "")
        self.log(f"run {final.get('run_id')} {final['state']} in {time.monotonic() - t_run:.0f}s: {scores}{spent}"
                 f"run folder {self.out}")
        return 0 if ok else 1

    def _secure(self, n_agents: int) -> dict[str, tuple[str, ...]]:
        """A throwaway CA and fresh tokens: mutual TLS and bearer tokens between every process."""
        import secrets

        from fedrl.wire.devca import make_dev_ca
        from fedrl.wire.security import TLSFiles

        agents = [f"agent-{i}" for i in range(n_agents)]
        tls = make_dev_ca(self.out / "tls", clients=("admin", "evaluator", *agents), days=2)
        tok = {name: secrets.token_urlsafe(24) for name in ("admin", "evaluator", *agents)}
        self.child_env["aggregator"] = {
            "FEDRL_ADMIN_TOKEN": tok["admin"], "FEDRL_EVALUATOR_TOKEN": tok["evaluator"],
            "FEDRL_AGENT_TOKENS": ",".join(f"{a}={tok[a]}" for a in agents)}
        self.child_env["evaluator"] = {"FEDRL_ADMIN_TOKEN": tok["admin"], "FEDRL_EVALUATOR_TOKEN": tok["evaluator"]}
        for a in agents:
            self.child_env[a] = {"FEDRL_AGENT_TOKEN": tok[a]}
        self.client_tls, self.admin_token = TLSFiles.from_dir(tls / "admin"), tok["admin"]
        self.log(f"secure: mutual TLS (throwaway CA in {tls}) and a bearer token per process")
        return {"aggregator": ("--tls-dir", str(tls / "aggregator")), "evaluator": ("--tls-dir", str(tls / "evaluator")),
                **{a: ("--tls-dir", str(tls / a)) for a in agents}}

    def _metrics_endpoints(self) -> None:
        """Wait for every process's metrics port; record them; start Prometheus if asked."""
        for name in self.children:
            self.metrics_ports[name] = self._wait_port(name, self.out / "ports" / f"{name}.metrics")
        scheme = "https" if self.cfg.secure else "http"
        (self.out / "metrics_targets.json").write_text(json.dumps(
            {n: f"{scheme}://127.0.0.1:{p}/metrics" for n, p in self.metrics_ports.items()}, indent=2))
        if not self.cfg.prometheus:
            return
        from fedrl.ops.local_prometheus import RULES_FILE, LocalPrometheus, write_config

        jobs: dict[str, list[tuple[str, str]]] = {}
        for name, port in self.metrics_ports.items():
            job = "fedrl-agent" if name.startswith("agent-") else f"fedrl-{name}"
            jobs.setdefault(job, []).append((f"127.0.0.1:{port}", name))
        folder = self.out / "prometheus"
        config = write_config(folder, jobs, tls_dir=self.out / "tls" / "admin" if self.cfg.secure else None,
                              token=self.metrics_token)
        if not (folder / "rules.yml").exists():
            self.log(f"warning: alert rules not loaded: {RULES_FILE} is not here (it ships in the "
                     "source checkout's deploy/, not in an installed wheel); metrics are scraped without them")
        logf = open(self.out / "logs" / "prometheus.log", "w")
        self.logs.append(logf)
        self.prometheus = LocalPrometheus(folder, config, self.cfg.prometheus_bin, logf, preexec_fn=die_with_parent)
        self.prometheus.wait_ready()
        self.log(f"prometheus on {self.prometheus.url} (try the query fedrl_aggregator_rounds_completed_total)")

    def _follow(self, client, run_id: str) -> dict[int, dict[str, Any]]:
        import threading

        rounds: dict[int, dict[str, Any]] = {}
        errors: list[BaseException] = []
        events: list[dict] = []
        done = threading.Event()

        def pump() -> None:
            try:
                for e in client.watch():
                    events.append(e)
            except BaseException as e:  # surfaced below
                errors.append(e)
            finally:
                done.set()

        threading.Thread(target=pump, daemon=True).start()
        from fedrl.common.progress import Progress

        run = self.cfg.run
        per_round = run.agents * run.local_steps
        bar = Progress(run.rounds * per_round, f"run {run_id}", "steps", stream=sys.stdout,
                       enabled=self.progress)
        say = bar.write if bar.enabled else self.log
        seen, polled, ending = 0, 0.0, ""
        while not done.is_set() or seen < len(events):
            if seen == len(events):
                done.wait(0.2)
                self._check_children()
                if bar.enabled and time.monotonic() - polled > 1.0:  # the agents' steps inside the round
                    polled = time.monotonic()
                    try:
                        st = client.status()
                    except Exception:  # noqa: BLE001 - the bar is a nicety; the watch stream decides
                        continue
                    if st.get("run_id") == run_id and st.get("round", 0) >= 1:
                        inside = sum(a.get("steps_done", 0) for a in st["agents"] if a.get("steps_total"))
                        bar.set((st["round"] - 1) * per_round + inside)
                        bar.note(f"round {st['round']}/{run.rounds}")
                continue
            e = events[seen]
            seen += 1
            if e["kind"] == "ROUND_CLOSED":
                rounds[e["version"]] = round_record(e, self.cfg.run)
                bar.set(e["round"] * per_round)
                if not self.cfg.run.eval_episodes:
                    say(round_line(rounds[e["version"]], self.cfg.run))
            elif e["kind"] == "EVALUATED" and e["version"] in rounds:
                ev = e["evaluation"]
                rounds[e["version"]]["eval"] = {k: ev[k] for k in ("return_mean", "return_std", "score_mean", "score_std")}
                say(round_line(rounds[e["version"]], self.cfg.run))
            elif e["kind"] == "NOT_EVALUATED" and e["version"] in rounds:  # its record keeps no eval
                say(round_line(rounds[e["version"]], self.cfg.run) + f"  not evaluated: {e.get('message', '')}")
            elif e["kind"] in ("RUN_FAILED", "RUN_STOPPED"):  # said once the last rounds' evaluations are in
                ending = f"run {e['kind'].split('_')[1].lower()}: {e.get('message', '')}"
        bar.close()
        if ending:
            self.log(ending)
        if errors:
            self._check_children()  # a dead aggregator explains a broken stream best
            raise errors[0]
        return rounds

    def _write_results(self, rounds: dict[int, dict[str, Any]], final: dict) -> None:
        rows = [rounds[v] for v in sorted(rounds)]
        with open(self.out / "rounds.jsonl", "w") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
        flat = [flat_row(r) for r in rows]
        keys = list(dict.fromkeys(k for r in flat for k in r))
        with open(self.out / "rounds.csv", "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=keys, extrasaction="ignore")
            w.writeheader()
            w.writerows(flat)
        curve = [{"round": r["round"], **r["eval"]} for r in rows if "eval" in r]
        env = final.get("env_id", "")
        if curve and env:
            from fedrl.envs import env_info
            from fedrl.federation.shards import parse_source
            from fedrl.ops.plotting import learning_curve
            run = self.cfg.run
            names = ", ".join(Path(parse_source(d, run.agents)[0]).name for d in self.cfg.datasets)
            learning_curve(curve, self.out / "learning_curve.png",
                           f"{run.algo} on {names}: {run.agents} agents x {run.local_steps} local steps",
                           env_info(env).key, self.data_return)
        summary = {"run_id": final.get("run_id"), "state": final["state"], "message": final.get("message", ""),
                   "env_id": env, "rounds": len(rows), "final": curve[-1] if curve else None,
                   "best": max(curve, key=lambda c: c["return_mean"]) if curve else None}
        if final.get("privacy"):
            summary["privacy"] = final["privacy"]
        (self.out / "summary.json").write_text(json.dumps(summary, indent=2))
        return summary


# ROUND_CLOSED's metrics that are differential privacy's (the record's ``privacy``), by their name there
def _privacy_metrics() -> dict[str, str]:
    from fedrl.federation.privacy import ADAPTIVE_RECORD, PRIVACY_EPSILON

    return {PRIVACY_EPSILON: "epsilon", **ADAPTIVE_RECORD}


def round_record(e: dict[str, Any], run: RunConfig) -> dict[str, Any]:
    """A round's line of ``rounds.jsonl`` from its ROUND_CLOSED event, in the schema ``fedrl
    simulate`` writes (docs/guides/simulate.md): the agents' mean metrics (what the aggregator
    saw; none under secure aggregation) under ``metrics``, privacy under ``privacy``, the survivors
    of secure aggregation under ``secure_aggregation``; ``eval`` is added once evaluated."""
    from fedrl.federation.privacy import privacy_spent

    names = _privacy_metrics()
    m = dict(e["metrics"])
    rec: dict[str, Any] = {"round": e["round"], "version": e["version"], "seconds": e["seconds"],
                           "agents": [{"agent": a} for a in e["agents"]],
                           "metrics": {k: v for k, v in m.items() if k not in names}}
    if run.dp_clip:
        rec["privacy"] = privacy_spent(run, e["round"], m.get("dp_clip")) | {
            names[k]: v for k, v in m.items() if k in names}
        if "clipped" in m:
            rec["privacy"]["clipped_fraction"] = m["clipped"]
    if run.secagg_threshold:
        rec["secure_aggregation"] = {"threshold": run.secagg_threshold, "agents": run.agents,
                                     "survivors": len(e["agents"]), "dropped": run.agents - len(e["agents"])}
    return rec


def flat_row(r: dict[str, Any]) -> dict[str, Any]:
    """A ``rounds.jsonl`` record as one ``rounds.csv`` row: its scalars, its metrics and its
    evaluation by their own names, privacy's as ``privacy_<name>``, the agents as their number."""
    out = {k: v for k, v in r.items() if not isinstance(v, (dict, list))}
    out["agents"] = len(r.get("agents", ()))
    out |= r.get("metrics", {}) | r.get("eval", {})
    out |= {f"privacy_{k}": v for k, v in r.get("privacy", {}).items()}
    return out


def private_rounds(run: RunConfig) -> str:
    """What the run start's line adds for private updates: secure aggregation, DP, or nothing."""
    parts = []
    if run.secagg_threshold:
        parts.append(f"updates by secure aggregation (the aggregator sees only their sum; any "
                     f"{run.secagg_threshold} of {run.agents} agents recover it)")
    if run.dp_clip:
        noise = f"noise multiplier {run.dp_noise:g}" if run.dp_noise else "no noise (no privacy guarantee)"
        clip = (f"adaptive clipping from {run.dp_clip:g} to the {run.dp_clip_quantile:g} quantile"
                if run.dp_clip_quantile else f"clip {run.dp_clip:g}")
        budget = f", budget epsilon {run.dp_epsilon_budget:g}" if run.dp_epsilon_budget else ""
        parts.append(f"differential privacy: {clip}, {noise}{budget} at delta {run.dp_delta:g}")
    return "; " + "; ".join(parts) if parts else ""


def scores_said(best: dict[str, Any] | None, last: dict[str, Any] | None, stored: int) -> str:
    """The last line's scores: the best round's and the final one's, which is the last round
    evaluated; when that is not the last round ``stored`` (its version was not evaluated), it
    says so."""
    if not best or not last:
        return ""
    late = f" (round {last['round']}, the last evaluated)" if last["round"] != stored else ""
    return f"best score {best['score_mean']:.1f} (round {best['round']}), final {last['score_mean']:.1f}{late}; "


def round_line(r: dict[str, Any], run: RunConfig) -> str:
    """One round as ``fedrl up`` prints it: the evaluation (once it exists), the mean losses, how
    many agents' updates made the round when fewer than the run's (a quorum at the deadline, or the
    survivors of secure aggregation), and under DP the budget spent and the clipping norm."""
    ev = r.get("eval")
    shown = (f"return {ev['return_mean']:8.1f} ± {ev['return_std']:6.1f}  score {ev['score_mean']:6.1f}"
             if ev else "")
    losses = "  ".join(f"{k}={v:.3g}" for k, v in r.get("metrics", {}).items()
                       if k in ("critic_td", "cql_penalty", "reg_data", "bc_loss"))
    n = len(r.get("agents") or ())
    if run.secagg_threshold:  # every secure round says how many agents' masked updates its sum holds
        short = f"  {n} of {run.agents} agents survived" if n else ""
    else:
        short = f"  {n} of {run.agents} agents" if 0 < n < run.agents else ""
    dp = r.get("privacy") or {}
    spent = f"  epsilon {dp['epsilon']:.3g} (delta {dp['delta']:g})" if "epsilon" in dp else ""
    if "clip_next" in dp:  # adaptive clipping: the norm this round clipped to, and the next
        spent += f"  clip {dp['clip']:.3g} -> {dp['clip_next']:.3g}"
    return f"round {r['round']:3d}/{run.rounds}  {shown}{'  ' + losses if losses else ''}{short}{spent}  [{r['seconds']:.1f}s]"


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def up(cfg: UpConfig, log: Callable[[str], None] = print, progress: bool = False) -> int:
    # Ctrl-C and SIGTERM both stop every child. Installed explicitly: a process started from a
    # non-interactive shell's background job inherits SIGINT ignored, and Python then never
    # raises KeyboardInterrupt.
    previous = {s: signal.signal(s, _interrupt) for s in (signal.SIGINT, signal.SIGTERM)}
    launcher = Launcher(cfg, log, progress)
    try:
        rc = launcher.run()
        if cfg.linger > 0:
            extra = f"; Prometheus: {launcher.prometheus.url}" if launcher.prometheus else ""
            log(f"run over: every process stays up {cfg.linger:.0f}s for inspection (Ctrl-C stops them now)"
                f"; metrics endpoints in {launcher.out / 'metrics_targets.json'}{extra}")
            try:
                time.sleep(cfg.linger)
            except KeyboardInterrupt:
                pass
        return rc
    except (ChildFailed, PrometheusError) as e:
        log(f"fedrl up: {e}")
        return 1
    except grpc.RpcError as e:
        log(f"fedrl up: lost the aggregator: {e.code().name}: {e.details()} "
            f"(logs in {launcher.out / 'logs'})")
        return 1
    except KeyboardInterrupt:
        log("fedrl up: interrupted; stopping every process")
        return 130
    finally:
        # A second Ctrl-C (or SIGTERM) must not cut the clean-up short: it is bounded (a grace
        # period, then SIGKILL), and children it never reached would only learn of it on exit.
        for s in previous:
            signal.signal(s, signal.SIG_IGN)
        try:
            launcher.stop_children()
        finally:
            for s, handler in previous.items():
                signal.signal(s, signal.SIG_DFL if handler is None else handler)
