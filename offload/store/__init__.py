"""The tiered store: shards paged among device memory, pinned host RAM and NVMe, within byte budgets.
Knows nothing about modules or optimizers.

    TieredStore, StoreConfig   tiered_store.py  (the API is in its docstring)
    Lease, LeaseMode           lease.py         (one piece of work's claim on a shard's bytes)
    Link                       links.py         (bytes and busy time per link)
    Residency, Tier            residency.py     (where a shard's bytes are)
    PinnedArena                arena.py         (one page-locked allocation, exact sub-allocation)
    parse_size, format_bytes   sizes.py         ("60GiB")
    resolve_budget, ...        budget.py        ("auto" budgets, the swap rule, budgets vs the machine)
    HomeTier                   home_tier.py     (what every home tier does: a budget of slots; docs/tiers.md)
    MemoryTier                 memory_tier.py   (a home in memory: blocks, read as views; held-for-good accounting)
    CpuMemoryTier              cpu_tier.py      (the cpu tier, a MemoryTier: the pinned arena, staging slots)
    DeviceMemoryTier           device_tier.py   (the device tier, a MemoryTier: its budget, the cpu<->device copies)
    Moves                      moves.py         (each shard's moves in order, run by worker threads)
    StorageTier, register_storage_tier
                               storage_tier.py  (what a home tier below cpu does, and the registry)
    NvmeTier                   nvme_tier.py     (the nvme tier: swap files through the aio engine)
    SwapDir, SwapFile          swap_file.py     (preallocated swap files)
    AioEngine                  aio.py           (async O_DIRECT engine)
"""
from .arena import ArenaBlock, ArenaBusyError, ArenaFullError, PinnedArena
from .budget import (AUTO_FRACTION, check_fits_machine, host_memory, nvme_budget_bytes, ranks_on_this_node,
                     resolve_budget)
from .home_tier import HomeTier
from .lease import Lease, LeaseMode
from .links import Link
from .memory_tier import MemoryTier
from .residency import Residency, Tier
from .sizes import format_bytes, parse_size
from .storage_tier import StorageTier, register_storage_tier
from .swap_file import SwapSpaceError
from .tiered_store import ShardInfo, StoreConfig, StoreError, SwapCorruptError, TieredStore

__all__ = [
    "TieredStore", "StoreConfig", "StoreError", "SwapCorruptError", "ShardInfo", "Residency", "Tier",
    "PinnedArena", "ArenaBlock", "ArenaFullError", "ArenaBusyError", "SwapSpaceError", "Lease", "LeaseMode", "Link",
    "parse_size", "format_bytes", "resolve_budget", "AUTO_FRACTION", "nvme_budget_bytes", "host_memory",
    "check_fits_machine", "ranks_on_this_node", "HomeTier", "MemoryTier", "StorageTier", "register_storage_tier",
]
