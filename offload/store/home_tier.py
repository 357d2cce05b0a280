"""HomeTier: what every tier a shard can live in does, memory or storage. The store's state machine
(tiered_store.py) holds a shard's home as (tier, slot) and speaks to every home through this interface.

Two kinds implement it:
    MemoryTier   memory_tier.py  (cpu_tier.py, device_tier.py): the store addresses its bytes. A slot is a block;
                 reading it is a view (no I/O), and the tier also lends blocks for working copies and staging.
    StorageTier  storage_tier.py (nvme_tier.py, or one registered): the store does not address its bytes. A slot
                 is the tier's own object, read into and written from a pinned cpu buffer.
"""
from __future__ import annotations

import abc

from .residency import Tier

__all__ = ["HomeTier"]


class HomeTier(abc.ABC):
    """A home: a budget of bytes holding shards' home copies in slots. Slots are the tier's own objects; the
    store keeps them, hands them back to free(), and names them with where()."""

    name: str  # the home name shards are registered with ("device", "cpu", "nvme", ...)
    level: Tier  # its place in the order of tiers: DEVICE, CPU, or NVME (every storage tier)

    # ---- budget
    @property
    @abc.abstractmethod
    def capacity(self) -> int:
        """The tier's budget in bytes."""

    @property
    @abc.abstractmethod
    def bytes_in_use(self) -> int:
        """Bytes its live slots (and, in memory, lent blocks) take."""

    # ---- holding bytes
    @abc.abstractmethod
    def reserve(self, shard: object, nbytes: int, tier_class: str) -> object:
        """A home slot for `nbytes` of shard `shard` (str() names it in messages) of class `tier_class`. A request
        the budget can never hold raises, naming the setting to raise (MemoryTier may also wait for room: it takes
        a `timeout`; a StorageTier is called under the store's lock and does not wait)."""

    @abc.abstractmethod
    def free(self, slot: object) -> None:
        """The home slot goes back to the budget (no move of it is in flight)."""

    # ---- naming and life
    @abc.abstractmethod
    def where(self, slot: object) -> str:
        """The slot in words, for messages."""

    def stats(self) -> dict:
        """Its line in TieredStore.stats(): capacity, bytes_in_use, peak_bytes (and what else the tier tells)."""
        used = self.bytes_in_use
        return {"capacity": self.capacity, "bytes_in_use": used, "peak_bytes": used}

    @abc.abstractmethod
    def close(self) -> None:
        """Frees what the tier holds (memory, files, threads). Runs once, after every move is over."""
