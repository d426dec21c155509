"""The agent service (see README.md)."""
