"""Optimizers that run on offload's CPU kernels, each a state schema (schema.py) the runtime steps sharded.
Importing the package registers the built-in families (schema.py's registry knows none of them by name)."""
from .adamw import ADAMW, AdamW, step_flat
from .adamw8bit import AdamW8bit
from .lion import Lion
from .schema import LogicalState, Schema, StoredState, register

__all__ = ["AdamW", "AdamW8bit", "Lion", "step_flat", "Schema", "StoredState", "LogicalState", "register", "ADAMW"]
