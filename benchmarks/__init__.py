"""Every number the project publishes comes from a command here (benchmarks/README.md lists them, with their run times)."""
