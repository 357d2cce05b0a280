"""Checkpoints of a training run: offload.checkpoint.files (safe, atomic, checksummed files) and the
runtime's save/load (offload/zero/checkpoint.py: rt.save_checkpoint / rt.load_checkpoint)."""
from .files import CheckpointError

__all__ = ["CheckpointError"]
