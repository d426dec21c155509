"""A global version's policy as a policy file, without torch: what ``fedrl ctl fetch`` writes.

The same bytes as :func:`fedrl.algos.policy_io.save_policy` of the policy rebuilt from the version
(``tests/service/test_ctl_and_stubs.py`` compares them): the version's ``policy.*`` tensors as
float32, the metadata as JSON strings with the log-std bounds, the header's keys sorted. Read and
written with ``safetensors.numpy``, so a command that only moves a file loads no torch."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

POLICY = "policy"


def sorted_header(raw: bytes) -> bytes:
    """A safetensors file with its JSON header's keys sorted: the library writes the metadata in
    a hash map's order, which changes from process to process, so the same policy saved twice
    differed byte-wise. The header keeps its length (the library pads it with spaces), so the
    tensors' offsets stay as they are."""
    n = int.from_bytes(raw[:8], "little")
    header = json.dumps(json.loads(raw[8:8 + n]), sort_keys=True, separators=(",", ":")).encode()
    if len(header) > n:  # cannot happen (the same keys, compactly); keep the library's file
        return raw
    return raw[:8] + header + b" " * (n - len(header)) + raw[8 + n:]


def policy_tensors(payload: bytes) -> dict[str, np.ndarray]:
    """The ``policy.*`` tensors of a version's safetensors ``payload`` (floating ones as float32);
    ValueError when it holds none, or a tensor numpy cannot hold."""
    from safetensors import SafetensorError
    from safetensors.numpy import load

    try:
        state = load(bytes(payload))
    except (SafetensorError, TypeError, ValueError) as e:
        raise ValueError(f"the version's tensors cannot be read without torch: {e}") from None
    out = {k: (v.astype(np.float32) if np.issubdtype(v.dtype, np.floating) else v)
           for k, v in state.items() if k.startswith(POLICY + ".")}
    if f"{POLICY}.obs_mean" not in out or f"{POLICY}.head.bias" not in out:
        raise ValueError("not a policy: the version holds no policy.obs_mean or policy.head.bias")
    bad = sorted(k for k, v in out.items() if np.issubdtype(v.dtype, np.floating) and not np.isfinite(v).all())
    if bad:
        raise ValueError(f"the version's policy holds NaN or Inf ({', '.join(bad[:3])})")
    return out


def write_policy_file(tensors: Mapping[str, np.ndarray], path: str | Path, metadata: Mapping[str, Any],
                      log_std_bounds: tuple[float, float]) -> Path:
    """Write ``tensors`` as a policy file at ``path`` (atomically), as ``save_policy`` does."""
    from safetensors.numpy import save

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    meta = {k: json.dumps(v) for k, v in metadata.items()}
    meta["log_std_bounds"] = json.dumps(list(log_std_bounds))
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(sorted_header(save(dict(tensors), metadata=meta)))
    os.replace(tmp, path)
    return path
