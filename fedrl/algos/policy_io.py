"""Policies on disk: one safetensors file with ``policy.*`` tensors and JSON metadata.

The same format serves run outputs (``global_policy.safetensors``), behaviour checkpoints and
(later) the weights the services stream. No pickle anywhere.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save

from fedrl.algos.base import POLICY, load_prefixed, prefixed_state
from fedrl.algos.nets import TanhGaussianPolicy
from fedrl.algos.policy_file import sorted_header


def save_policy(policy: TanhGaussianPolicy, path: str | Path, metadata: Mapping[str, Any] | None = None,
                dtype: torch.dtype = torch.float32) -> Path:
    """Write ``policy`` atomically; ``metadata`` values are stored as JSON strings."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    state = {k: v.to(dtype) if v.is_floating_point() else v
             for k, v in prefixed_state(POLICY, policy).items()}
    meta = {k: json.dumps(v) for k, v in (metadata or {}).items()}
    meta["log_std_bounds"] = json.dumps([policy.log_std_min, policy.log_std_max])
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(sorted_header(save(state, metadata=meta)))
    os.replace(tmp, path)
    return path


def policy_from_state(state: Mapping[str, torch.Tensor], log_std_min: float = -5.0,
                      log_std_max: float = 2.0) -> TanhGaussianPolicy:
    """Rebuild a float32 policy from ``policy.*`` tensors (widths read from the tensors)."""
    try:
        obs_dim = state[f"{POLICY}.obs_mean"].shape[0]
        act_dim = state[f"{POLICY}.head.bias"].shape[0] // 2
    except KeyError as e:
        raise ValueError(f"not a policy: missing tensor {e.args[0]!r}") from None
    biases = [k for k in state if k.startswith(f"{POLICY}.trunk.") and k.endswith(".bias")]
    hidden = [state[k].shape[0] for k in sorted(biases, key=lambda k: int(k.split(".")[2]))]
    pol = TanhGaussianPolicy(obs_dim, act_dim, hidden, log_std_min, log_std_max)
    load_prefixed(pol, {k: v.float() for k, v in state.items()}, POLICY)
    return pol


def load_policy(path: str | Path) -> tuple[TanhGaussianPolicy, dict[str, Any]]:
    """A policy file written by :func:`save_policy` (or a run); returns the policy and metadata."""
    try:
        with safe_open(str(path), "pt") as f:
            raw_meta = f.metadata() or {}
            state = {k: f.get_tensor(k) for k in f.keys()}
    except (SafetensorError, OSError) as e:
        raise ValueError(f"{path}: not a readable safetensors policy file ({e})") from None
    meta: dict[str, Any] = {}
    for k, v in raw_meta.items():
        try:
            meta[k] = json.loads(v)
        except json.JSONDecodeError:
            meta[k] = v
    lo, hi = meta.get("log_std_bounds") or [-5.0, 2.0]
    hp = meta.get("hparams") if isinstance(meta.get("hparams"), dict) else {}
    lo, hi = hp.get("log_std_min", lo), hp.get("log_std_max", hi)
    try:
        return policy_from_state(state, lo, hi), meta
    except (ValueError, RuntimeError) as e:
        raise ValueError(f"{path}: {e}") from None
