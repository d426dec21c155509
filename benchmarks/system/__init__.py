"""The system's speed and cost: the services' rounds and transfer (``services``, ``grpc_patterns``,
``inplace``, ``version_write``), the learners' throughput (``throughput``), the peers (Flower:
``peers``, ``flower_side``, ``secagg_peers``), secure aggregation's bytes (``secagg_cost``), the
container image (``image``) and the README's measured lines (``readme``)."""
