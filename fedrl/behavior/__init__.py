"""Behaviour policies: online SAC training and the checkpoints datasets are made from."""
