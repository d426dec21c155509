"""What ``fedrl ctl`` prints for people: aligned tables and one line per event (``--json`` prints
the same data as JSON for scripts)."""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from typing import Any


def plural(n: int, noun: str) -> str:
    """``1 stored version``, ``2 stored versions``."""
    return f"{n} {noun}{'' if n == 1 else 's'}"


def table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """Columns left-aligned to their widest cell, two spaces apart."""
    cells = [[str(c) for c in header]] + [["" if c is None else str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in cells)


def when(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t)) if t else "-"


def size(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return str(n)


def evaluation(ev: dict[str, Any] | None) -> str:
    if not ev:
        return "not evaluated yet"
    n = len(ev.get("returns", []))
    return (f"version {ev.get('version', '?')}: return {ev.get('return_mean', 0):.1f} "
            f"± {ev.get('return_std', 0):.1f}, score {ev.get('score_mean', 0):.1f} ({plural(n, 'episode')})")


def adaptive(dp: dict[str, Any]) -> str:
    """How adaptive clipping moves the norm ('' under a fixed norm)."""
    if not dp.get("clip_quantile"):
        return ""
    return (f", adaptive towards the {dp['clip_quantile']:g} quantile of the update norms; count noise "
            f"{dp['count_noise']:g}, update noise multiplier {dp['update_noise_multiplier']:.4g}")


def status(st: dict[str, Any]) -> str:
    lines = []
    if not st.get("run_id"):
        lines.append("no run yet")
    else:
        cfg = json.loads(st["config_json"]) if st.get("config_json") else {}
        gathering = " (the agents' observation moments, by secure aggregation)" \
            if st["state"] == "running" and not st.get("round") else ""
        lines.append(f"run {st['run_id']}: {st['state']}, round {st.get('round', 0)} of {st.get('rounds', 0)}"
                     f"{gathering}, global version {st.get('global_version', 0)}")
        if cfg:
            env = st.get("env_id") or cfg.get("env_id") or "that of the agents' data"
            lines.append(f"{cfg.get('algo', '?')}, {cfg.get('agents', '?')} agents x {cfg.get('local_steps', '?')} "
                         f"local steps, env {env}")
        if st.get("message"):
            lines.append(f"message: {st['message']}")
        dp = st.get("privacy")
        if dp:
            budget = f", budget {dp['epsilon_budget']:g}" if dp.get("epsilon_budget") else ""
            lines.append(f"privacy spent: epsilon {dp['epsilon']:.3g} at delta {dp['delta']:g} after {dp['rounds']} "
                         f"rounds (noise multiplier {dp['noise_multiplier']:g}, clip {dp['clip']:.4g}{adaptive(dp)}{budget})")
        ended = st["state"] in ("finished", "stopped", "failed")
        lines.append(f"last evaluation: {evaluation(st.get('last_evaluation'))}" if st.get("last_evaluation") or not ended
                     else "last evaluation: none (no evaluator evaluated this run)")
    agents = st.get("agents", [])
    if agents:
        rows = []
        for a in agents:
            prog = f"{a.get('steps_done', 0)}/{a['steps_total']}" if a.get("steps_total") else "-"
            rows.append([a["agent_id"], a["agent_index"], a["num_samples"], "yes" if a["connected"] else "no",
                         a["rounds_submitted"], prog])
        lines.append("")
        lines.append(table(["agent", "index", "samples", "connected",
                            "rounds of this run" if st.get("run_id") else "rounds", "local steps"], rows))
    else:
        lines.append("no agents joined")
    held = st.get("runs", [])
    if len(held) > 1:
        rows = [[r["run_id"], r["state"], f"{r.get('round', 0)}/{r.get('rounds', 0)}", r.get("global_version", 0),
                 f"{r['last_evaluation'].get('score_mean', 0):.1f} (v{r['last_evaluation'].get('version', '?')})"
                 if r.get("last_evaluation") else "-", r.get("message", "")] for r in held]
        lines.append("")
        lines.append(f"{plural(len(held), 'run')} held (`--run RUN` for one; the details above are the newest's):")
        lines.append(table(["run", "state", "round", "version", "last score", "message"], rows))
    return "\n".join(lines)


def runs(rs: list[dict[str, Any]]) -> str:
    if not rs:
        return "no runs stored"
    rows = [[r["run_id"], r["state"], r["algo"], r["agents"], r["rounds"],
             r["latest_version"] if r["latest_version"] >= 0 else "-",
             f"{r['best_score']:.1f} (v{r['best_version']})" if r.get("best_score") is not None else "-",
             when(r["started_unix"]), r.get("message", "")] for r in rs]
    return table(["run", "state", "algo", "agents", "rounds", "latest version", "best score", "started",
                  "message"], rows)


def versions(v: dict[str, Any]) -> str:
    rows = [[x["version"], x["version"], when(x["time_unix"]), size(x["size_bytes"]), x["sha256"][:16],
             f"{x['score_mean']:.1f}" if x.get("score_mean") is not None else "-",
             f"{x['return_mean']:.1f}" if x.get("return_mean") is not None else "-"] for x in v["versions"]]
    head = (f"run {v['run_id']}: {plural(len(rows), 'stored version')} (version v is the model after round v; sha256 of the "
            "stored file, the whole global model as served: `ctl fetch` writes its policy alone, another file)")
    return head + "\n\n" + table(["version", "round", "stored", "size", "sha256 (first 16)", "score", "return"], rows)


def event(e: dict[str, Any]) -> str:
    """One line per round event."""
    t = time.strftime("%H:%M:%S", time.localtime(e.get("time_unix") or time.time()))
    k = e["kind"]
    if k == "ROUND_OPENED":
        what = f"round {e['round']} opened ({len(e.get('agents', []))} agents)"
    elif k == "ROUND_CLOSED":
        m = e.get("metrics", {})
        terms = ", ".join(f"{n}={m[n]:.3g}" for n in sorted(m)[:6])
        what = (f"round {e['round']} closed: version {e['version']} from {len(e.get('agents', []))} agents "
                f"in {e.get('seconds', 0):.1f}s" + (f"  [{terms}]" if terms else ""))
    elif k == "EVALUATED":
        what = evaluation(e.get("evaluation"))
    elif k == "NOT_EVALUATED":
        what = f"version {e['version']} not evaluated: {e.get('message', '')}"
    else:
        what = k.lower().replace("_", " ") + (f": {e['message']}" if e.get("message") else "")
    return f"{t}  {e.get('run_id', '')}  {what}"


def started(st: dict[str, Any], settings: dict[str, Any]) -> str:
    shown = ", ".join(f"{k}={settings[k]}" for k in ("algo", "agents", "rounds", "local_steps") if k in settings)
    return f"started run {st.get('run_id', '?')} ({shown}); follow it with: fedrl ctl watch\n" + status(st)


def progress_line(st: dict[str, Any]) -> str | None:
    """The agents' local steps in the round in progress, or None when none reported any."""
    parts = [f"{a['agent_id']} {a['steps_done']}/{a['steps_total']}" for a in st.get("agents", [])
             if a.get("steps_total")]
    if not parts or st.get("state") != "running":
        return None
    return f"{time.strftime('%H:%M:%S')}  {st.get('run_id', '')}  round {st.get('round')}: local steps " + \
        ", ".join(parts)


def progress_lines(client, run_id: str = "") -> list[str]:
    """The progress lines of ``run_id``, or without it of every running run the aggregator holds."""
    st = client.status(run_id)
    running = [r["run_id"] for r in st.get("runs", []) if r["state"] == "running"]
    if run_id or len(running) <= 1:
        return [x for x in [progress_line(st if not running or running[0] == st.get("run_id")
                                          else client.status(running[0]))] if x]
    return [x for x in (progress_line(client.status(r)) for r in running) if x]


def follow(client, after_version: int = -1, every: float = 10.0, out=None, run_id: str = "") -> None:
    """``ctl watch`` for people: each round event of ``run_id`` (empty: of every run) as one line,
    and between them, every ``every`` seconds, the agents' local steps in the round in progress
    (when they changed)."""
    import queue
    import sys
    import threading

    out = out or sys.stdout
    events: queue.Queue = queue.Queue()

    def pump() -> None:
        try:
            for e in client.watch(after_version, run_id=run_id):
                events.put(e)
        except BaseException as e:  # noqa: BLE001 - raised in the caller's thread below
            events.put(e)
        events.put(None)

    threading.Thread(target=pump, daemon=True).start()
    last: dict[str, str] = {}  # each run's last progress line printed
    while True:
        try:
            e = events.get(timeout=every)
        except queue.Empty:
            try:
                lines = progress_lines(client, run_id)
            except Exception:  # noqa: BLE001 - a missed progress line; the stream decides
                lines = []
            for line in lines:
                run, text = line.split("  ", 2)[1:]
                if last.get(run) != text:
                    last[run] = text
                    print(line, file=out, flush=True)
            continue
        if e is None:
            return
        if isinstance(e, BaseException):
            raise e
        print(event(e), file=out, flush=True)
