"""A Flower App for ``benchmarks.system.peers``: FedAvg over echo clients, rounds timed by the server."""
