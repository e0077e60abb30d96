"""Trainer loop, checkpoints, lifecycle hooks and metrics."""
