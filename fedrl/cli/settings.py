"""Run settings from a JSON file and ``--set KEY=JSON`` pairs, as simulate, up and ctl read them."""

from __future__ import annotations

import json
from pathlib import Path


def settings_file(path: str | None) -> dict:
    """A JSON object of run settings read from ``path`` ({} without one); a ValueError that
    names the file when it is missing, unreadable, not JSON or not an object."""
    if not path:
        return {}
    try:
        data = json.loads(Path(path).read_text())
    except OSError as e:
        raise ValueError(f"{path}: cannot read the run settings ({e.strerror or e})") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object of run settings, got {type(data).__name__}")
    return data


def set_pairs(pairs: list[str]) -> dict:
    """``--set KEY=VALUE`` pairs: each VALUE as JSON, else as the string it is."""
    out = {}
    for kv in pairs:
        k, sep, v = kv.partition("=")
        if not sep or not k:
            raise ValueError(f"--set {kv!r}: expected KEY=VALUE")
        try:
            out[k] = json.loads(v)
        except json.JSONDecodeError:
            out[k] = v
    return out
