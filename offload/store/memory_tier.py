"""MemoryTier: a home in memory the store addresses (the cpu tier's pinned arena, the device tier's budget). A
HomeTier (home_tier.py) whose slot is a block: reading a home copy is a view of it, not a copy into a buffer.

Besides home blocks it lends blocks for working copies and staging buffers (take), from the same budget. What
home blocks hold is held for good: a request larger than what they leave free can never be served, and raises at
once (naming the setting) instead of waiting for a free that cannot come. Blocks have .view(dtype, numel),
.free(), .freed, .reserved (the arena's also .padded() and .span); a lent block frees itself (block.free()), a
home block goes back through free(block), which also gives back what it held for good.
"""
from __future__ import annotations

import threading

import torch

from .arena import ArenaFullError
from .home_tier import HomeTier
from .sizes import format_bytes
from .swap_file import page_bytes

__all__ = ["MemoryTier"]


class MemoryTier(HomeTier):
    """A budget of memory over `pool`: an allocator with alloc(nbytes, timeout[, slot]), capacity,
    bytes_in_use, peak_bytes and close() (arena.PinnedArena, budget.DeviceTier)."""

    def __init__(self, name: str, pool):
        self.name = name
        self.pool = pool
        self._held = 0  # bytes home blocks hold for good (page-rounded)
        self._lock = threading.Lock()

    @property
    def capacity(self) -> int:
        return self.pool.capacity

    @property
    def bytes_in_use(self) -> int:
        return self.pool.bytes_in_use

    @property
    def peak_bytes(self) -> int:
        return self.pool.peak_bytes

    def slot_for(self, nbytes: int) -> int | None:
        """The bytes a short-lived block of `nbytes` takes when not its own size (cpu_tier.py: a staging slot)."""
        return None

    def take(self, shard: object, nbytes: int, timeout: float | None, home: bool = False,
             short_lived: bool = False):
        """A block of `nbytes` for shard `shard`, waiting up to `timeout` for room (0: ArenaBusyError at once).
        home: held for good (reserve()); short_lived: a working copy or staging buffer, which may take a slot."""
        size = page_bytes(nbytes)
        slot = self.slot_for(nbytes) if short_lived else None
        with self._lock:
            held = self._held
            if (slot or size) <= self.capacity and (slot or size) > self.capacity - held:
                raise ArenaFullError(
                    f"shard {shard!r} ({format_bytes(nbytes)}"
                    f"{f', in a staging slot of {format_bytes(slot)}' if slot else ''}): can never fit in the "
                    f"{self.name} budget of {format_bytes(self.capacity)}: home shards hold {format_bytes(held)} of "
                    f"it for good; raise {self.name}_budget or give fewer shards a {self.name} home")
            if home:
                self._held += size
        try:
            return self.pool.alloc(nbytes, timeout, slot=slot) if slot else self.pool.alloc(nbytes, timeout)
        except BaseException as e:
            if home:
                with self._lock:
                    self._held -= size
            if isinstance(e, ArenaFullError):  # ArenaBusyError stays one: the caller may back off
                raise type(e)(f"shard {shard!r} ({format_bytes(nbytes)}): {e}") from None
            raise

    def reserve(self, shard: object, nbytes: int, tier_class: str, timeout: float | None = None):
        return self.take(shard, nbytes, timeout, home=True)

    def free(self, slot) -> None:
        slot.free()
        with self._lock:
            self._held -= page_bytes(slot.nbytes)

    def view(self, slot, dtype: torch.dtype, numel: int) -> torch.Tensor:
        """The home copy itself (the read of a memory tier: no I/O)."""
        return slot.view(dtype, numel)

    def where(self, slot) -> str:
        return f"a {self.name} tier block of {slot.reserved} bytes"

    def stats(self) -> dict:
        return {"capacity": self.capacity, "bytes_in_use": self.bytes_in_use, "peak_bytes": self.peak_bytes}

    def close(self) -> None:
        self.pool.close()
