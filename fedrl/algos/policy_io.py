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


MAX_LAYERS = 64  # trunk layers a policy's tensors may describe (a run's networks have at most 8)


def policy_from_state(state: Mapping[str, torch.Tensor], log_std_min: float = -5.0,
                      log_std_max: float = 2.0) -> TanhGaussianPolicy:
    """Rebuild a float32 policy from ``policy.*`` tensors (widths read from the tensors).

    Every ``policy.*`` name and shape is checked against the architecture the tensors imply
    before a parameter is allocated, so the policy built holds exactly the values given: a few
    bias vectors cannot declare layers gigabytes wide. Tensors that do not make a policy raise
    ValueError, naming them."""
    head = f"{POLICY}."
    given = {k[len(head):]: tuple(v.shape) for k, v in state.items() if k.startswith(head)}
    for name in ("obs_mean", "head.bias"):
        if name not in given:
            raise ValueError(f"not a policy: missing tensor {head + name!r}")
        if len(given[name]) != 1:
            raise ValueError(f"not a policy: {head + name} has shape {list(given[name])}, not a vector")
    layers: dict[int, int] = {}
    for k, shape in given.items():
        parts = k.split(".")
        if parts[0] == "trunk" and parts[-1] == "bias":
            if len(parts) != 3 or not parts[1].isdigit() or len(shape) != 1:
                raise ValueError(f"not a policy: tensor {head + k!r} of shape {list(shape)} is no trunk layer's bias")
            layers[int(parts[1])] = shape[0]
    if not layers or len(layers) > MAX_LAYERS:
        raise ValueError(f"not a policy: {len(layers)} trunk layers (a policy has 1 to {MAX_LAYERS})")
    hidden = [layers[i] for i in sorted(layers)]
    obs_dim, act_dim = given["obs_mean"][0], given["head.bias"][0] // 2
    with torch.device("meta"):  # shapes only: nothing allocated
        want = {k: tuple(v.shape) for k, v in TanhGaussianPolicy(obs_dim, act_dim, hidden).state_dict().items()}
    if given != want:
        missing = sorted(want.keys() - given.keys())
        extra = sorted(given.keys() - want.keys())
        wrong = [f"{head + k} is {list(given[k])}, not {list(want[k])}" for k in sorted(want.keys() & given.keys())
                 if given[k] != want[k]]
        said = ([f"missing {', '.join(head + k for k in missing[:4])}"] if missing else []) + \
            ([f"unexpected {', '.join(head + k for k in extra[:4])}"] if extra else []) + wrong[:4]
        raise ValueError(f"not a policy of {obs_dim} observations, {act_dim} actions and hidden layers "
                         f"{hidden}: {'; '.join(said)}")
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
