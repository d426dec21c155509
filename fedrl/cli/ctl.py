"""``fedrl ctl ...``: talk to a running aggregator. Imports nothing that loads torch."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from fedrl.cli.settings import apply_sets, settings_file
from fedrl.common import argtypes


# What ``fedrl ctl start`` without --config runs: every agent joined now, the paper's 1,000 local
# steps per round (a CQL-based learner scores visibly above zero after the first round on
# Hopper data), 10 rounds, each evaluated. Each can be changed with --set.
CTL_START_DEFAULTS = {"rounds": 10, "local_steps": 1000, "eval_episodes": 10}


DEFAULT_PORT = 50051  # the aggregator's --port default
CTL_CONNECT_TIMEOUT = 10.0  # fedrl ctl's wait for an aggregator that does not answer yet, by default


def _target(text: str) -> str:
    """``HOST[:PORT]`` (an IPv6 address in brackets): the aggregator's default port when none is given."""
    text = text.strip()
    if not text:
        raise argparse.ArgumentTypeError("empty target: give HOST[:PORT]")
    host, sep, port = text.rpartition(":")
    if text.startswith("[") and text.endswith("]") or not sep or (host.count(":") and not host.endswith("]")):
        return f"{text}:{DEFAULT_PORT}"  # no port: a bare name, [v6], or a bare v6 address
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise argparse.ArgumentTypeError(f"{text!r}: the port must be a number in 1-65535")
    return text


def _connection_args(p: argparse.ArgumentParser, given_only: str | None = None) -> None:
    """ctl's own options (where the aggregator is, how to reach it, how to print). On the
    subcommands too, with ``given_only=argparse.SUPPRESS``: a value given there overrides one given
    before the command, and an absent one leaves it (or its default) alone."""
    def default(value):
        return value if given_only is None else given_only

    p.add_argument("--target", "--aggregator", dest="target", type=_target, default=default(f"127.0.0.1:{DEFAULT_PORT}"),
                   help=f"aggregator HOST[:PORT] (port {DEFAULT_PORT} when not given; default 127.0.0.1:{DEFAULT_PORT})")
    p.add_argument("--json", action="store_true", default=default(False),
                   help="print JSON (for scripts) instead of tables")
    p.add_argument("--connect-timeout", type=argtypes.positive_seconds, default=default(None),
                   help=f"seconds to wait for the aggregator to answer, also while nothing listens yet (e.g. "
                        f"while its pod starts). Default: {CTL_CONNECT_TIMEOUT:g} s, and a target where nothing "
                        f"listens (connection refused) is an error at once")
    from fedrl.wire.security import add_tls_arg
    add_tls_arg(p, default=default(None))


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("ctl", help="control a running aggregator: start, status, watch, runs, versions, fetch, stop")
    _connection_args(p)
    p.epilog = 'The admin token, when the aggregator requires tokens, is read from $FEDRL_ADMIN_TOKEN.'
    csub = p.add_subparsers(dest="ctl_cmd", required=True)
    st = csub.add_parser("start", help="start a run", description=(
        "Without --config: the agents joined now, " + ", ".join(f"{k}={v}" for k, v in CTL_START_DEFAULTS.items())
        + ", the rest the run config's defaults (algo drpo); --set changes any of them."))
    st.add_argument("--config", default=None, help="run config JSON file (default: see above)")
    st.add_argument("--set", action="append", default=[], metavar="KEY=JSON",
                    help="override a field, e.g. --set rounds=10 --set drpo.lambda1=0.2 --set 'drpo={\"lambda1\": 0.2}'")
    st.add_argument("--if-idle", action="store_true",
                    help="succeed without starting anything when a run is already active (idempotent jobs); "
                         "without it, the run starts beside the active ones (up to the aggregator's --max-runs)")
    s = csub.add_parser("status", help="a run's state, round, agents and last evaluation (without --run: every "
                                       "run the aggregator holds, and the newest one's details)")
    s.add_argument("--run", default="", help="run id (default: all)")
    w = csub.add_parser("watch", help="print round events until the run ends (without --run: of every run "
                                      "the aggregator holds, until all have ended), one line each")
    w.add_argument("--after-version", type=argtypes.integer, default=-1, help="skip events up to this version (default: all)")
    w.add_argument("--run", default="", help="run id (default: all)")
    r = csub.add_parser("runs", help="the runs in the aggregator's state directory, newest first")
    r.add_argument("--limit", type=argtypes.integer, default=20, help="at most this many (default %(default)s)")
    v = csub.add_parser("versions", help="a run's stored versions: round, time, size, checksum, evaluated score")
    v.add_argument("--run", default="", help="run id (default: the newest run)")
    f = csub.add_parser("fetch", help="save a global version as a policy file (for fedrl evaluate)")
    f.add_argument("--run", default="", help="run id (see `fedrl ctl runs`; default: the newest run)")
    f.add_argument("--version", type=argtypes.at_least(-1), default=-1, help="-1: the run's latest")
    f.add_argument("--out", required=True, help="the .safetensors file to write (an existing file is kept "
                                                "unless --force)")
    f.add_argument("--force", action="store_true", help="write over an existing --out file")
    sp = csub.add_parser("stop", help="stop a run")
    sp.add_argument("--reason", default="stopped by operator", help="recorded with the run (default: %(default)s)")
    sp.add_argument("--run", default="", help="run id (default: the only active run; required while several are)")
    for each in csub.choices.values():  # before or after the command: `ctl --target H status`, `ctl status --target H`
        _connection_args(each, argparse.SUPPRESS)
    p.set_defaults(func=_cmd_ctl)


def _cmd_ctl(a: argparse.Namespace) -> int:
    import os

    import grpc

    from fedrl.cli import show
    from fedrl.cli.client import ControlClient, dumps
    from fedrl.wire.security import SecurityConfigError, tls_from_args

    try:
        tls = tls_from_args(a.tls_dir)
    except SecurityConfigError as e:
        print(f"fedrl ctl: error: {e}", file=sys.stderr)
        return 2
    if a.ctl_cmd == "start":  # the settings are read before any connection: a bad file is named at once
        data = settings_file(a.config) if a.config else dict(CTL_START_DEFAULTS)
        data = apply_sets(data, a.set)
    from fedrl.wire.rpc import nothing_listens

    if a.connect_timeout is None and nothing_listens(a.target):
        print(f"fedrl ctl: error: nothing listens at {a.target} (connection refused): is the aggregator running? "
              "(--connect-timeout S waits for one that is starting)", file=sys.stderr)
        return 1
    try:
        with ControlClient(a.target, connect_timeout=a.connect_timeout or CTL_CONNECT_TIMEOUT, tls=tls,
                           token=os.environ.get("FEDRL_ADMIN_TOKEN") or None) as c:
            current = c.status() if a.ctl_cmd == "start" else None
            busy = current is not None and any(r["state"] in ("waiting_for_agents", "running")
                                               for r in current.get("runs") or [current])
            if busy and a.if_idle:
                print(dumps(current) if a.json else f"a run is already active\n{show.status(current)}")
            elif a.ctl_cmd == "start":
                if not a.config and "agents" not in data:
                    n = sum(x["connected"] for x in current["agents"])
                    if n == 0:
                        print("fedrl ctl: error: no agent has joined the aggregator; start agents first, or say how "
                              "many to wait for with --set agents=N", file=sys.stderr)
                        return 1
                    data["agents"] = n
                st = c.start(data)
                print(dumps(st) if a.json else show.started(st, data))
            elif a.ctl_cmd == "status":
                st = c.status(a.run)
                print(dumps(st) if a.json else show.status(st))
            elif a.ctl_cmd == "watch":
                if a.json:
                    for e in c.watch(a.after_version, run_id=a.run):
                        print(json.dumps(e), flush=True)
                else:
                    show.follow(c, a.after_version, run_id=a.run)
            elif a.ctl_cmd == "runs":
                rs = c.runs(a.limit)
                print(dumps(rs) if a.json else show.runs(rs))
            elif a.ctl_cmd == "versions":
                vs = c.versions(a.run)
                print(dumps(vs) if a.json else show.versions(vs))
            elif a.ctl_cmd == "stop":
                st = c.stop(a.reason, a.run)
                print(dumps(st) if a.json else show.status(st))
            elif a.ctl_cmd == "fetch":
                if Path(a.out).exists() and not a.force:
                    print(f"fedrl ctl: error: {a.out} exists; pass --force to write over it", file=sys.stderr)
                    return 1
                try:
                    meta = c.save_policy(a.out, a.version, a.run)
                except (ValueError, OSError) as e:  # no run yet; the file cannot be written
                    print(f"fedrl ctl: error: {e}", file=sys.stderr)
                    return 1
                import hashlib

                digest = hashlib.sha256(Path(a.out).read_bytes()).hexdigest()
                out = {"path": a.out, **{k: meta[k] for k in ("run_id", "version", "env_id", "algo")}, "sha256": digest}
                print(dumps(out) if a.json else f"saved version {out['version']} of run {out['run_id']} "
                      f"({out['algo']}, {out['env_id']}) to {a.out}: its policy alone, sha256 {digest[:16]} "
                      "(the same bytes at every fetch; `ctl versions` lists the stored version's own)")
    except grpc.RpcError as e:
        print(f"fedrl ctl: error: {e.code().name}: {e.details()}", file=sys.stderr)
        return 1
    except ConnectionError as e:
        print(f"fedrl ctl: error: {e}", file=sys.stderr)
        return 1
    return 0
