"""The project's own files, for the tests that read the source tree: what git tracks, never a
virtualenv, cache or run folder a documented command leaves behind (``benchmarks/.venv-flwr``
holds numpy's own tests). Outside a git checkout (an unpacked archive), every file but those
under a hidden or ignored-by-convention folder."""

from __future__ import annotations

import functools
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_SKIP = {"runs", "node_modules", "__pycache__", "site-packages"}


@functools.cache
def _tracked() -> tuple[Path, ...] | None:
    try:
        out = subprocess.run(["git", "-C", str(ROOT), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                             capture_output=True, check=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return tuple(ROOT / p for p in out.decode().split("\0") if p)


def files(top: str | Path, pattern: str = "*.py") -> list[Path]:
    """The project's files under ``top`` (relative to the root) matching ``pattern``, sorted:
    tracked, or new and not ignored (a file being written counts); present on disk."""
    base = ROOT / top
    tracked = _tracked()
    if tracked is None:
        found = (p for p in base.rglob(pattern)
                 if not any(part.startswith(".") or part in _SKIP for part in p.relative_to(ROOT).parts[:-1]))
    else:
        found = (p for p in tracked if p.is_relative_to(base) and p.match(pattern) and p.is_file())
    return sorted(found)


def round_record_fields() -> dict[str, str]:
    """The fields of a ``rounds.jsonl`` record as docs/guides/simulate.md documents them
    (its ``round-record`` table): name -> what it holds."""
    text = (ROOT / "docs" / "guides" / "simulate.md").read_text()
    table = text.split("<!-- round-record -->", 1)[1].split("<!-- end:round-record -->", 1)[0]
    rows = [line.split("|")[1:3] for line in table.strip().splitlines()[2:]]
    return {name.strip().strip("`"): what.strip() for name, what in rows}


def check_round_record(rec: dict, producer: str) -> None:
    """``rec`` (a rounds.jsonl line of ``producer``, "up" or "simulate") holds only documented
    fields, every field both producers write, and, for nested ones, only documented names."""
    import re

    doc = round_record_fields()
    assert set(rec) <= set(doc), sorted(set(rec) - set(doc))
    assert {"round", "version", "seconds", "agents", "metrics"} <= set(rec), sorted(rec)
    assert ("train_seconds" in rec) == (producer == "simulate")
    if "eval" in rec:
        assert {"return_mean", "return_std", "score_mean", "score_std"} <= set(rec["eval"]), rec["eval"]
    for field in ("privacy", "secure_aggregation"):
        if field in rec:
            named = set(re.findall(r"`(\w+)`", doc[field]))
            extra = set(rec[field]) - named - ({"bound", "seconds"} if field == "secure_aggregation" else set())
            assert not extra, (field, sorted(extra))
