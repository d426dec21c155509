"""The ``fedrl`` command line: ``up``, ``ctl``, ``simulate``, ``evaluate``, ``data ...``; with the
one-machine launcher (``launcher``).

Layer 8, the top of the core: may import every layer below it."""

from __future__ import annotations

import argparse
import os
import sys

from fedrl.common import argtypes
from fedrl.data.errors import DatasetError


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The whole command line; ``only="ctl"``: just ``fedrl ctl``, whose commands talk to an
    aggregator and never need torch (building the other commands' options loads it: ~1.2 s)."""
    p = argparse.ArgumentParser(prog="fedrl", description="Federated offline RL (DRPO)")
    import fedrl

    p.add_argument("--version", action="version", version=f"fedrl {fedrl.__version__}")
    sub = p.add_subparsers(dest="cmd", required=True)
    argtypes.defaults_help(sub)  # every command's help shows the real defaults
    from fedrl.cli import ctl

    if only == "ctl":
        ctl.add_parser(sub)
        return p
    from fedrl.cli import certs, data, evaluate, simulate, up

    for command in (simulate, evaluate, data, up, ctl, certs):
        command.add_parser(sub)
    return p


def _given(parser: argparse.ArgumentParser, argv: list[str]) -> set[str]:
    """The options of ``parser`` that ``argv`` sets (not their defaults)."""
    saved = [(act, act.default) for act in parser._actions]
    try:
        for act, _ in saved:
            act.default = argparse.SUPPRESS
        ns, _ = parser.parse_known_args(argv)
    finally:
        for act, d in saved:
            act.default = d
    return set(vars(ns))


def _chosen_parser(parser: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.ArgumentParser:
    """The deepest (sub)command parser ``args`` went through: ``fedrl ctl status`` -> its own."""
    while True:
        subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        name = getattr(args, subs[0].dest, None) if subs else None
        if name is None or name not in subs[0].choices:
            return parser
        parser = subs[0].choices[name]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser(only="ctl" if argv[:1] == ["ctl"] else None)
    args, extra = parser.parse_known_args(argv)
    if extra:  # named by the subcommand they were given to, with its usage (not fedrl's)
        _chosen_parser(parser, args).error(f"unrecognized arguments: {' '.join(extra)}")
    if argv[:1] == ["simulate"]:  # which flags were given (over --config): simulate's settings
        args.given = _given(_chosen_parser(parser, args), argv[1:])
    prog = _chosen_parser(parser, args).prog.split()
    prog = " ".join(prog[:2])  # "fedrl ctl", "fedrl data", "fedrl up": every error of a command the same way
    try:
        rc = args.func(args)
        sys.stdout.flush()  # a reader that went away is found here, not in the interpreter's exit
        return rc
    except (DatasetError, ValueError, KeyError, FileNotFoundError) as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("fedrl: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader went away (``fedrl data info x | head``): stop quietly, as cat does
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # nothing left to flush at exit
        return 141
