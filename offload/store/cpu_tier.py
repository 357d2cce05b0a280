"""The cpu tier: pinned host memory in one PinnedArena (arena.py) of the cpu budget, a MemoryTier
(memory_tier.py). Home cpu shards' blocks, working copies fetched to cpu, and the staging buffers every move
between nvme and the device goes through.

Short-lived buffers take one staging slot each when it is set (set_staging_slot: the largest of them); home
blocks and resident working copies take their own size: so the room a caller plans for its short-lived buffers,
free_staging_bytes(), is always usable, never split into pieces (arena.py says why).
"""
from __future__ import annotations

import contextlib

import torch

from . import numa
from .arena import PinnedArena
from .memory_tier import MemoryTier
from .residency import Tier
from .swap_file import page_bytes

__all__ = ["CpuMemoryTier"]


class CpuMemoryTier(MemoryTier):
    level = Tier.CPU

    def __init__(self, capacity: int, device: torch.device, lock_memory: bool | str = "auto",
                 numa_node: int | str | None = "auto"):
        """`capacity` bytes of the arena, locked as StoreConfig.lock_memory says, its pages preferring
        `numa_node` ("auto": the node of `device`, the compute device it feeds)."""
        with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
            # registered from this GPU's context (not the calling thread's current device's)
            node = numa.arena_node(device) if numa_node == "auto" else numa_node
            arena = PinnedArena(capacity, lock=lock_memory, name="cpu tier (pinned arena)", numa_node=node)
        super().__init__(Tier.CPU.value, arena)
        self.staging_slot = 0  # bytes every short-lived buffer takes (0: its own size, first fit)

    @property
    def arena(self) -> PinnedArena:
        return self.pool

    def slot_for(self, nbytes: int) -> int | None:
        return self.staging_slot if 0 < page_bytes(nbytes) <= self.staging_slot else None

    def set_staging_slot(self, nbytes: int) -> None:
        self.staging_slot = page_bytes(nbytes)

    def free_staging_bytes(self) -> int:
        if not self.staging_slot:
            return self.capacity - self.bytes_in_use
        return self.pool.free_slots(self.staging_slot) * self.staging_slot

    def staged_nbytes(self, nbytes: int) -> int:
        return self.slot_for(nbytes) or page_bytes(nbytes)

    def stats(self) -> dict:
        return {**super().stats(), "locked": self.pool.locked, "lock_kind": self.pool.lock_kind}

    def pinned(self) -> dict:
        a = self.pool
        return {"arena_bytes": a.capacity, "locked_bytes": a.capacity if a.locked else 0, "lock_kind": a.lock_kind,
                "numa_node": a.numa_node, "numa_error": a.numa_error,
                "pages_by_node": numa.nodes_of(a.base_ptr, a.capacity)}
