"""A storage tier: a home for shards' bytes outside the memory the store hands out (NVMe swap files; a second
drive, a remote or object store, GPUDirect Storage), and the registry of them by name.

The store's state machine (tiered_store.py, residency.py) is written once over this interface: a shard homed
in a storage tier is at rest in Residency.NVME (its level is Tier.NVME: below the cpu tier), is fetched by
reading its slot into a pinned cpu buffer and written back from one. What is the store's and not the tier's:
the order of moves, residency, the checksums of what was written (StoreConfig.checksums), a torn slot's refusal.

    class MyTier(StorageTier):                       # hold, read, write, free; its links and budget
        ...
    register_storage_tier("mine", MyTier.build)      # build(config: StoreConfig, settings: dict) -> MyTier
    TieredStore(StoreConfig(tiers={"mine": {...settings}})).register("x", n, home="mine")

The built-in nvme tier (nvme_tier.py) is the one the store builds from StoreConfig.nvme_path; how to add one:
docs/tiers.md. The memory tiers above (memory_tier.py) implement the same HomeTier (home_tier.py).
"""
from __future__ import annotations

import abc
import concurrent.futures as cf
from typing import Callable, Protocol

import torch

from .. import telemetry
from .home_tier import HomeTier
from .links import Link, TierLink
from .residency import Tier

__all__ = ["StorageTier", "IoHandle", "FutureHandle", "register_storage_tier", "build_storage_tier",
           "storage_tier_names"]


class IoHandle(Protocol):
    def wait(self) -> None:
        """Returns once the I/O is over; raises its error (an OSError for a failed read or write)."""


class FutureHandle:
    """An IoHandle over a concurrent.futures.Future (a tier that runs its I/O on a thread pool)."""

    def __init__(self, future: cf.Future):
        self.future = future

    def wait(self) -> None:
        self.future.result()


class StorageTier(HomeTier):
    """What a home tier below the cpu does (a HomeTier: home_tier.py says what every home does; capacity,
    bytes_in_use, where and close are its). Slots are the tier's own objects; the store only keeps them, hands
    them back, and exchanges two of one size and class (TieredStore.exchange_slots).

    Buffers passed to read/write are uint8 host tensors from the pinned arena, page-aligned, a whole number
    of pages (the shard's bytes, then padding): a slot takes page_bytes(nbytes) of the tier."""

    name: str  # the home name shards are registered with ("nvme")
    level = Tier.NVME  # every storage tier sits below the cpu tier
    read_link: Link | TierLink  # counted in stats()["moved"] / ["busy_s"] under its value ("nvme->cpu")
    write_link: Link | TierLink

    @staticmethod
    def links_of(name: str) -> tuple[TierLink, TierLink]:
        """(read, write) links named "<name>->cpu" / "cpu-><name>", drawn on the nvme lanes."""
        return (TierLink(f"{name}->cpu", telemetry.Lane.NVME_READ),
                TierLink(f"cpu->{name}", telemetry.Lane.NVME_WRITE))

    # ---- holding bytes
    @abc.abstractmethod
    def reserve(self, shard: object, nbytes: int, tier_class: str) -> object:
        """A slot for `nbytes` of shard `shard` (str() names it in messages) of class `tier_class`. Over the
        budget: a SwapSpaceError naming the setting to raise. Called under the store's lock: no I/O wait."""

    @abc.abstractmethod
    def free(self, slot: object) -> None:
        """The slot goes back to the budget (no move of it is in flight). Called under the store's lock."""

    def fresh_slot_reads_zero(self, tier_class: str) -> bool:
        """Whether the next slot reserve() hands out for `tier_class` reads back as zeros without a write
        (a new file's extent); False makes the store write the zeros a shard registered without init has."""
        return False

    # ---- moving bytes
    @abc.abstractmethod
    def read(self, slot: object, buf: torch.Tensor) -> IoHandle:
        """Starts reading the slot into `buf`; returns at once (the store's worker waits on the handle)."""

    @abc.abstractmethod
    def write(self, slot: object, buf: torch.Tensor) -> IoHandle:
        """Starts writing `buf` to the slot; `buf` does not change until the handle's wait() returns."""

    # ---- naming and life (where(slot) and close() are HomeTier's)
    def location(self, slot: object) -> tuple[int, int] | None:
        """(file descriptor, offset) of the slot where a reader may pread it directly, else None."""
        return None

    def paths(self) -> list[str]:
        """The files the tier holds (removed at close)."""
        return []


_FACTORIES: dict[str, Callable[..., StorageTier]] = {}
_MEMORY_TIERS = ("device", "cpu")


def register_storage_tier(name: str, build: Callable[..., StorageTier]) -> None:
    """Makes `name` a home: build(config: StoreConfig, settings: dict) -> StorageTier, called by each store whose
    StoreConfig.tiers names it (the nvme tier: whenever StoreConfig.nvme_path is set)."""
    if name in _MEMORY_TIERS or not name.replace("_", "").isalnum():
        raise ValueError(f"register_storage_tier: {name!r} is not a free tier name (letters, digits, '_'; not "
                         f"{' or '.join(_MEMORY_TIERS)})")
    _FACTORIES[name] = build


def storage_tier_names() -> list[str]:
    return list(_FACTORIES)


def build_storage_tier(name: str, config, settings: dict) -> StorageTier:
    build = _FACTORIES.get(name)
    if build is None:
        raise ValueError(f"StoreConfig.tiers: no storage tier named {name!r} is registered (known: "
                         f"{', '.join(_FACTORIES) or 'none'}); import the module that registers it first")
    tier = build(config, dict(settings))
    if tier.name != name:
        raise ValueError(f"storage tier {name!r}: its factory built a tier named {tier.name!r}")
    return tier


def run_every(steps) -> None:
    """Run every cleanup step even if an earlier one fails; raise the first failure at the end (a close that
    stops at its first error leaves files, threads or pinned memory behind)."""
    first: BaseException | None = None
    for step in steps:
        try:
            step()
        except BaseException as e:  # keep cleaning up; report the first failure
            first = first or e
    if first is not None:
        raise first
