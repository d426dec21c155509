"""argparse types the services' command lines share: a bad number is refused by name at parse
time (exit 2), not passed on to fail later or, worse, work differently (gRPC binds port 99999 as
34463, 99999 mod 65536)."""

from __future__ import annotations

import argparse
from collections.abc import Callable

# the devices a command may name (``cuda:N`` too): here, so that a command's options load no torch
DEVICE_CHOICES = ("auto", "cpu", "cuda")


def port(text: str) -> int:
    """A TCP port, 0-65535 (0: a free one)."""
    n = _int(text)
    if not 0 <= n <= 65535:
        raise argparse.ArgumentTypeError(f"a port is 0-65535, got {n}")
    return n


def at_least(low: int) -> Callable[[str], int]:
    """An integer >= ``low``."""
    def parse(text: str) -> int:
        n = _int(text)
        if n < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {n}")
        return n
    parse.__name__ = f"integer >= {low}"  # argparse names the type in its "invalid ..." message
    return parse


def seconds(text: str) -> float:
    """A finite duration >= 0."""
    x = _float(text)
    if not 0 <= x < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number of seconds >= 0, got {text}")
    return x


def positive_seconds(text: str) -> float:
    """A finite duration > 0."""
    x = _float(text)
    if not 0 < x < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text}")
    return x


def _float(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, got {text!r}") from None


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None


def integer(text: str) -> int:
    """An integer, refused in the words a run setting's wrong type gets (``expected an integer``)."""
    return _int(text)


class DefaultsHelp(argparse.RawDescriptionHelpFormatter):
    """Help that shows each option's real default, ``(default: X)``, unless it has none (None,
    False for a switch), is required, or its help already says it."""

    @staticmethod
    def _shows_default(action) -> bool:
        d, h = action.default, action.help or ""
        return not (d is None or d is argparse.SUPPRESS or d is False or action.required or "default" in h.lower()
                    or not action.option_strings or isinstance(d, list) and not d
                    or h == argparse.SUPPRESS)

    def _format_action(self, action):
        if action.help is None and self._shows_default(action):  # no help text: the default alone
            action.help = "(default: %(default)s)"
        return super()._format_action(action)

    def _get_help_string(self, action):
        h = action.help or ""
        if not self._shows_default(action) or h.startswith("(default: "):
            return h
        return h + (" " if h else "") + "(default: %(default)s)"


def defaults_help(sub) -> None:
    """Make ``sub`` (an add_subparsers() action) give its parsers :class:`DefaultsHelp` unless
    they name another formatter."""
    add = sub.add_parser

    def add_parser(name, **kw):
        kw.setdefault("formatter_class", DefaultsHelp)
        p = add(name, **kw)
        inner = p.add_subparsers

        def add_subparsers(**kw2):
            s = inner(**kw2)
            defaults_help(s)
            return s
        p.add_subparsers = add_subparsers
        return p
    sub.add_parser = add_parser
