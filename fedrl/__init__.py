"""fedrl: federated offline RL (DRPO) as a system: shared core used by every service."""

__version__ = "0.1.0"
