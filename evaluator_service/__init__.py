"""The evaluator service (see README.md)."""
