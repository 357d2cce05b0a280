"""The nvme tier: shards' bytes in preallocated swap files, one per tier class (swap_file.py), read and written
by the async O_DIRECT engine (aio.py), within the nvme budget (budget.py's rule). A StorageTier
(storage_tier.py); the store builds it when StoreConfig.nvme_path is set. A second drive is one more of them
under another name:

    register_storage_tier("nvme2", NvmeTier.on_path("nvme2"))
    StoreConfig(nvme_path="/nvme0/run", tiers={"nvme2": {"path": "/nvme1/run", "budget": "500GiB"}})
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .aio import AioEngine
from .budget import resolve_budget
from .links import Link
from .sizes import format_bytes
from .storage_tier import StorageTier, register_storage_tier, run_every
from .swap_file import SwapDir, SwapFile, SwapSpaceError, page_bytes

__all__ = ["NvmeTier", "NvmeSlot"]


@dataclass
class NvmeSlot:
    file: SwapFile
    offset: int
    nbytes: int


class _Read:
    """The engine's read handle; a failed read first checks the file was not cut short (clearer than ENODATA)."""

    def __init__(self, handle, slot: NvmeSlot, end: int):
        self.handle, self.slot, self.end = handle, slot, end

    def wait(self) -> None:
        try:
            self.handle.wait()
        except OSError:
            self.slot.file.check_intact(self.end)
            raise


class NvmeTier(StorageTier):
    def __init__(self, config, name: str = "nvme", path: str | None = None, budget: int | str | None = None):
        """The tier of StoreConfig.nvme_path and nvme_budget, or (`name` other than "nvme") of `path` and
        `budget` ("auto": the nvme rule on that drive), with the store's aio settings."""
        self.name = name
        if name == "nvme":
            self.read_link, self.write_link = Link.NVME_TO_CPU, Link.CPU_TO_NVME
            path, budget = config.nvme_path, config.nvme_budget
        else:
            self.read_link, self.write_link = self.links_of(name)
        self.rank = config.rank
        self._capacity = resolve_budget(budget, "nvme", nvme_path=path)
        self._used = 0
        self.files: dict[str, SwapFile] = {}
        self.engine: AioEngine | None = None
        self.dir = SwapDir(path)
        try:
            self.engine = AioEngine(config.aio_block_size, config.aio_queue_depth, config.aio_workers,
                                    config.aio_backend)
        except BaseException:
            self.dir.close()
            raise

    @classmethod
    def build(cls, config, settings: dict) -> "NvmeTier":
        if settings:
            raise ValueError(f"StoreConfig.tiers['nvme']: the nvme tier takes no settings ({sorted(settings)}); "
                             "give nvme_path, nvme_budget and aio_* in StoreConfig")
        return cls(config)

    @classmethod
    def on_path(cls, name: str):
        """A factory for register_storage_tier: an nvme tier `name` on its own drive, settings {"path": the swap
        directory, "budget": a size or "auto"}."""
        def build(config, settings: dict) -> "NvmeTier":
            if "path" not in settings or set(settings) - {"path", "budget"}:
                raise ValueError(f"StoreConfig.tiers[{name!r}]: give 'path' (the swap directory) and optionally "
                                 f"'budget' (a size or 'auto'), not {sorted(settings)}")
            return cls(config, name, settings["path"], settings.get("budget", "auto"))
        return build

    @property
    def _setting(self) -> str:
        return "nvme_budget" if self.name == "nvme" else f"StoreConfig.tiers[{self.name!r}]['budget']"

    @property
    def capacity(self) -> int:
        return self._capacity

    @property
    def bytes_in_use(self) -> int:
        return self._used

    def _file(self, tier_class: str) -> SwapFile:
        f = self.files.get(tier_class)
        if f is None:
            f = self.files[tier_class] = SwapFile(self.engine, self.dir, tier_class, self.rank)
        return f

    def fresh_slot_reads_zero(self, tier_class: str) -> bool:
        return not self._file(tier_class).free_bytes_in_file  # a freed slot holds another shard's bytes

    def reserve(self, shard: object, nbytes: int, tier_class: str) -> NvmeSlot:
        swap, slot_bytes = self._file(tier_class), page_bytes(nbytes)
        if self._used + slot_bytes > self._capacity:
            raise SwapSpaceError(
                28,  # ENOSPC
                f"shard {shard!r} needs {slot_bytes} bytes of swap but the {self.name} budget of "
                f"{format_bytes(self._capacity)} has {self._capacity - self._used} bytes left; "
                f"raise {self._setting}",
            )
        # the budget bounds the disk the files take, not only the live slots: freed space that no slot fits in
        # still takes its blocks
        files, grow = sum(f.size for f in self.files.values()), swap.growth(nbytes)
        if files + grow > self._capacity:
            raise SwapSpaceError(
                28,  # ENOSPC
                f"shard {shard!r} needs {slot_bytes} bytes of swap; the {self.name} budget of "
                f"{format_bytes(self._capacity)} holds the live shards' {format_bytes(self._used)}, but the swap "
                f"files take {format_bytes(files)} and this slot would grow them by {format_bytes(grow)} (freed "
                f"slots too small or scattered to hold it); raise {self._setting}",
            )
        slot = NvmeSlot(swap, swap.reserve(nbytes), nbytes)
        self._used += slot_bytes
        return slot

    def free(self, slot: NvmeSlot) -> None:
        slot.file.free(slot.offset, slot.nbytes)
        self._used -= page_bytes(slot.nbytes)

    def read(self, slot: NvmeSlot, buf: torch.Tensor) -> _Read:
        return _Read(self.engine.read(slot.file.file, slot.offset, buf), slot, slot.offset + buf.numel())

    def write(self, slot: NvmeSlot, buf: torch.Tensor):
        return self.engine.write(slot.file.file, slot.offset, buf)

    def where(self, slot: NvmeSlot) -> str:
        return f"{slot.file.path} at offset {slot.offset}"

    def location(self, slot: NvmeSlot) -> tuple[int, int]:
        return slot.file.file.fd, slot.offset

    def paths(self) -> list[str]:
        return [f.path for f in self.files.values()]

    def close(self) -> None:
        """Removes the swap files, closes the engine (its workers) and the swap directory; every step runs, the
        first failure is raised at the end."""
        steps = [*[(lambda f=f: f.close(remove=True)) for f in list(self.files.values())],
                 lambda: self.engine and self.engine.close(),
                 lambda: self.dir.close()]
        try:
            run_every(steps)
        finally:
            self.files.clear()


register_storage_tier("nvme", NvmeTier.build)
