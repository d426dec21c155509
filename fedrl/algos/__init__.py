"""The learning layer: networks, pure losses plus one update step each (DRPO, CQL = DRPO without
regularisers, BC), and policy files.

The settings (``ALGOS``, :class:`DRPOConfig`, :class:`BCConfig`) load without torch, so a
program that only reads or checks run settings (``fedrl ctl``) never imports it; the learners
load on first use.

Layer 1: may import ``fedrl.common``."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from fedrl.algos.config import BCConfig, DRPOConfig, cql_config

ALGOS = ("drpo", "fed-cql", "fed-bc", "cql")

# the names that need torch: the module each comes from, imported when first asked for
_LAZY = {"Batch": "fedrl.algos.base", "Learner": "fedrl.algos.base", "BCLearner": "fedrl.algos.bc",
         "DRPOLearner": "fedrl.algos.drpo"}

if TYPE_CHECKING:
    from fedrl.algos.base import Batch, Learner
    from fedrl.algos.bc import BCLearner
    from fedrl.algos.drpo import DRPOLearner


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'fedrl.algos' has no attribute {name!r}")


__all__ = ["ALGOS", "Batch", "Learner", "BCLearner", "BCConfig", "DRPOConfig", "DRPOLearner",
           "cql_config"]
