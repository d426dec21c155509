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


def apply_sets(data: dict, pairs: list[str]) -> dict:
    """``data`` (run settings) with each ``--set`` pair applied in turn, the same in ``fedrl up``,
    ``fedrl simulate`` and ``fedrl ctl start``: ``KEY=VALUE`` sets a field,
    ``drpo.FIELD=VALUE`` (or ``bc.FIELD``) one field of the learner's settings, and
    ``drpo={...}`` merges into the learner's settings already there. Returns ``data``."""
    for kv in pairs:
        ((k, value),) = set_pairs([kv]).items()
        head, dot, field = k.partition(".")
        if dot:
            if head not in ("drpo", "bc") or not field:
                raise ValueError(f"--set {kv!r}: only drpo.FIELD and bc.FIELD have parts")
            data.setdefault(head, {})
            if not isinstance(data[head], dict):
                raise ValueError(f"--set {kv!r}: {head} is not an object in the settings")
            data[head][field] = value
        elif k in ("drpo", "bc") and isinstance(value, dict) and isinstance(data.get(k), dict):
            data[k] = {**data[k], **value}
        else:
            data[k] = value
    return data
