"""Optimizers that run on offload's CPU kernels."""
from .adamw import AdamW, step_flat

__all__ = ["AdamW", "step_flat"]
