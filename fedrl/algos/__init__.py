"""The learning layer: networks, pure losses plus one update step each (DRPO, CQL = DRPO without
regularisers, BC), and policy files.

Layer 1: may import ``fedrl.common``."""

from fedrl.algos.base import Batch, Learner
from fedrl.algos.bc import BCLearner
from fedrl.algos.config import BCConfig, DRPOConfig, cql_config
from fedrl.algos.drpo import DRPOLearner

ALGOS = ("drpo", "fed-cql", "fed-bc", "cql")

__all__ = ["ALGOS", "Batch", "Learner", "BCLearner", "BCConfig", "DRPOConfig", "DRPOLearner",
           "cql_config"]
