"""Residency of a shard: where its bytes are, and which moves are in flight.

Only TieredStore._transition writes a shard's residency, and it asserts the move is one of
TRANSITIONS from the state the caller expects (a wrong state is a bug in the store, not a user error).
"""
from __future__ import annotations

import enum

__all__ = ["Residency", "Tier", "TRANSITIONS"]


class Tier(str, enum.Enum):
    """The levels of the tiers, fastest first (HomeTier.level): DEVICE and CPU are the memory tiers' (cpu_tier.py,
    device_tier.py), NVME is also the level of every storage tier (storage_tier.py). On a machine
    without a GPU the device tier is a budgeted region of host memory and the compute device is
    torch.device("cpu")."""

    DEVICE = "device"
    CPU = "cpu"
    NVME = "nvme"

    @property
    def rank(self) -> int:  # smaller is faster
        return ("device", "cpu", "nvme").index(self.value)


class Residency(enum.Enum):
    """Where a shard's bytes are.

    The *working copy* is the one fetch() returned; the *home copy* (the shard's home tier: swap-file
    slot, home cpu buffer or home device buffer) holds the bytes of the last writeback.

    NVME       home in a storage tier (nvme, or one registered: storage_tier.py), nothing fetched: the bytes
               are only in its slot (below, "swap-file slot" and "nvme" stand for any storage tier's).
    (fetch(read=False) goes straight to CPU or DEVICE: a working copy whose bytes are undefined until the
    caller has written them, made without reading anything.)
    READING    swap-file slot -> cpu staging buffer in flight; the staging buffer holds nothing valid yet.
    CPU        the working copy is in a cpu (arena) buffer: the home buffer (home cpu) or a staging buffer
               (home nvme, fetched to cpu).
    TO_DEVICE  cpu buffer -> device buffer copy in flight; the cpu buffer is valid and must not change,
               the device buffer is not valid yet.
    DEVICE     the working copy is in a device buffer (home device, or fetched to the device).
    TO_CPU     device buffer -> cpu buffer copy in flight (a writeback, or a fetch down to cpu); the device
               copy is valid, the cpu buffer is not yet.
    WRITING    cpu buffer -> swap-file slot in flight; the cpu buffer is valid and must not change, the
               slot is torn until the write completes (a device working copy, if any, stays valid).
    """

    NVME = "nvme"
    READING = "reading"
    CPU = "cpu"
    TO_DEVICE = "to_device"
    DEVICE = "device"
    TO_CPU = "to_cpu"
    WRITING = "writing"


R = Residency
# Every allowed move. A failed move goes back to where it started (the *_IN_FLIGHT -> start edges).
TRANSITIONS: frozenset[tuple[Residency, Residency]] = frozenset(
    {
        (R.NVME, R.READING), (R.READING, R.CPU), (R.READING, R.NVME),          # fetch nvme -> cpu
        (R.CPU, R.TO_DEVICE), (R.TO_DEVICE, R.DEVICE), (R.TO_DEVICE, R.CPU),   # fetch cpu -> device
        (R.DEVICE, R.TO_CPU), (R.TO_CPU, R.CPU), (R.TO_CPU, R.DEVICE),         # device -> cpu (fetch / writeback)
        (R.CPU, R.WRITING), (R.WRITING, R.CPU),                                # writeback of a cpu copy
        (R.TO_CPU, R.WRITING), (R.WRITING, R.DEVICE),                          # writeback of a device copy
        (R.CPU, R.NVME), (R.DEVICE, R.CPU), (R.DEVICE, R.NVME),                # release
        (R.NVME, R.CPU), (R.NVME, R.DEVICE), (R.CPU, R.DEVICE),                # fetch(read=False): a working
    }                                                                          # copy the caller overwrites
)
