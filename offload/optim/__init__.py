"""Optimizers that run on offload's CPU kernels, each a state schema (schema.py) the runtime steps sharded."""
from .adamw import ADAMW, AdamW, step_flat
from .schema import LogicalState, Schema, StoredState, register

__all__ = ["AdamW", "AdamW8bit", "Lion", "step_flat", "Schema", "StoredState", "LogicalState", "register", "ADAMW"]


def __getattr__(name: str):
    # AdamW8bit imports the 8-bit kernel's codebooks: load it when asked for
    if name == "AdamW8bit":
        from .adamw8bit import AdamW8bit
        return AdamW8bit
    if name == "Lion":
        from .lion import Lion
        return Lion
    raise AttributeError(f"module 'offload.optim' has no attribute {name!r}")
