"""Leaf helpers for every layer: torch devices and seeds, command-line argument types, progress
lines, thread counts, and child processes that end with their parent.

Layer 0: may import nothing from ``fedrl``."""
