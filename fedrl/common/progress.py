"""Progress of long jobs with an ETA: a tqdm bar on a terminal, a plain line every ``every``
seconds (and at the end) when the output is a file or a pipe (logs, CI, ``nohup``).

    with Progress(total=200_000, desc="making hopper-medium-v2", unit="steps") as p:
        for ...:
            p.update(1)
            p.note("episode 12")   # shown beside the bar / at the end of the next line
"""

from __future__ import annotations

import sys
import time
from typing import TextIO


def _fmt(seconds: float) -> str:
    seconds = max(0, int(seconds))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m:02d}:{s:02d}"


class Progress:
    def __init__(self, total: float, desc: str = "", unit: str = "it", *, initial: float = 0,
                 stream: TextIO | None = None, every: float = 10.0, tty: bool | None = None,
                 enabled: bool = True) -> None:
        self.total, self.desc, self.unit, self.every = total, desc, unit, every
        self.stream = stream if stream is not None else sys.stderr
        self.n, self.start_n, self.noted = initial, initial, ""
        self.t0 = self._last = time.monotonic()
        self.enabled = enabled and total > 0
        tty = self.stream.isatty() if tty is None else tty
        self._bar = None
        if self.enabled and tty:
            from tqdm import tqdm

            self._bar = tqdm(total=total, initial=initial, desc=desc, unit=unit, file=self.stream,
                             dynamic_ncols=True, smoothing=0.1)

    # -- the numbers --------------------------------------------------------------------------
    def rate(self) -> float:
        dt = time.monotonic() - self.t0
        return (self.n - self.start_n) / dt if dt > 0 else 0.0

    def eta(self) -> float | None:
        r = self.rate()
        return (self.total - self.n) / r if r > 0 else None

    def line(self) -> str:
        pct = 100.0 * self.n / self.total if self.total else 100.0
        eta = self.eta()
        parts = [f"{self.desc}: {self.n:,.0f}/{self.total:,.0f} {self.unit} ({pct:.0f}%)",
                 f"{_fmt(time.monotonic() - self.t0)} elapsed",
                 f"ETA {_fmt(eta)}" if eta is not None and self.n < self.total else None]
        s = ", ".join(p for p in parts if p)
        return s + (f"  {self.noted}" if self.noted else "")

    # -- updates ------------------------------------------------------------------------------
    def update(self, n: float = 1) -> None:
        if not self.enabled:
            return
        self.n += n
        if self._bar is not None:
            self._bar.update(n)
        elif time.monotonic() - self._last >= self.every:
            self._print()

    def set(self, n: float) -> None:
        """Move to ``n`` done (a count read from elsewhere, e.g. a server's status)."""
        if n > self.n:
            self.update(n - self.n)

    def write(self, text: str) -> None:
        """A line of output that does not break the bar."""
        if self._bar is not None:
            self._bar.write(text, file=self.stream)
        else:
            print(text, file=self.stream, flush=True)

    def note(self, text: str) -> None:
        self.noted = text
        if self._bar is not None:
            self._bar.set_postfix_str(text, refresh=False)

    def _print(self) -> None:
        self._last = time.monotonic()
        print(self.line(), file=self.stream, flush=True)

    def close(self) -> None:
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        else:
            self._print()
        self.enabled = False

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
