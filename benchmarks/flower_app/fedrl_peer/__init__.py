"""A Flower App for ``benchmarks.peers``: FedAvg over echo clients, rounds timed by the server."""
