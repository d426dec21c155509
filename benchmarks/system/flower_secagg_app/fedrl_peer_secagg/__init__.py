"""Flower's side of ``python -m benchmarks.system.secagg_peers``: FedAvg of echo clients through
Flower's legacy workflow, with SecAgg+ (``secagg=1``) or without."""
