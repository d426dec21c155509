"""The aggregator service (see README.md)."""
