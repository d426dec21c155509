"""`fedrl --version` and every command's `--help` load no torch (issue 86: they took 15-18 s at
load 8 when they did; torch alone is ~1.2 s idle): checked in a fresh interpreter, every
(sub)command's help in turn."""

from __future__ import annotations

import subprocess
import sys

PROBE = r"""
import argparse, contextlib, io, sys
from fedrl.cli import build_parser, main

def commands(parser, prefix=()):
    yield prefix
    for act in parser._actions:
        if isinstance(act, argparse._SubParsersAction):
            for name, sub in act.choices.items():
                yield from commands(sub, (*prefix, name))

names = list(commands(build_parser()))
for argv in [["--version"], *([*c, "--help"] for c in names)]:
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        try:
            main(argv)
        except SystemExit:
            pass
    if "torch" in sys.modules:
        print("torch loaded by: fedrl " + " ".join(argv))
        sys.exit(1)
print(len(names))
"""


def test_the_version_and_every_commands_help_load_no_torch():
    p = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    assert int(p.stdout.split()[-1]) >= 15  # the walk found the commands (fedrl, up, ctl start, ...)
