"""argparse types the services' command lines share: a bad number is refused by name at parse
time (exit 2), not passed on to fail later or, worse, work differently (gRPC binds port 99999 as
34463, 99999 mod 65536)."""

from __future__ import annotations

import argparse
from collections.abc import Callable


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
