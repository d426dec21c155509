"""Leaf helpers for every layer: torch devices and seeds, command-line argument types.

Layer 0: may import nothing from ``fedrl``."""
