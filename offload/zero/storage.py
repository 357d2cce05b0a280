"""The runtime's view of the tiered store (offload/store): a unit's shards by name, borrowed for one
piece of work and given back.

    storage.create(name, tier, tier_class, init=t | numel=n, dtype=...)  # home copy in tier
    t = storage.acquire(name)        # host tensor: the home copy (device/cpu homes on a CPU machine), or a
                                     # working copy in the pinned arena (nvme homes; counts in cpu_budget)
    ...use / update t in place...
    storage.release(name, t, dirty)  # dirty: write the working copy home first; then drop it

`acquire(name, compute=True)` gives the bytes on the compute device instead (the gather source). Every
call waits for its move (the runtime is synchronous per unit; prefetch comes with the planner).
Names: u<i>.param (compute dtype), u<i>.master, u<i>.exp_avg, u<i>.exp_avg_sq, u<i>.grad (fp32).
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch

from ..config import format_size
from ..store import StoreConfig, TieredStore
from ..store.residency import Tier

ALLOC_TIMEOUT_S = 120.0  # a buffer that cannot be had in this long is a planning error: raise, never hang


class ShardStorage:
    def __init__(self, device: torch.device, budgets: dict, nvme_dir: Path | None, rank: int = 0):
        self.device = torch.device(device)
        self.nvme_dir = nvme_dir
        cfg = StoreConfig(
            device_budget=budgets["device"] if budgets["device"] is not None else "auto",
            cpu_budget=budgets["cpu"] if budgets["cpu"] is not None else "auto",
            nvme_budget=budgets["nvme"] if budgets.get("nvme") is not None else "auto",
            nvme_path=str(nvme_dir) if nvme_dir is not None else None,
            rank=rank,
            device=str(self.device),
            # page-locking only pays for DMA to a GPU; without one it would just pin RSS
            lock_memory="auto" if self.device.type == "cuda" else False,
            alloc_timeout=ALLOC_TIMEOUT_S,
        )
        self.store = TieredStore(cfg)
        self._home: dict[str, Tier] = {}
        self._private: dict[str, torch.Tensor] = {}  # host copies of device-homed shards (GPU only)

    # ---- budgets ----------------------------------------------------------------------------
    def capacity(self, tier: str) -> int:
        s = self.store.stats()
        return s["nvme"]["capacity"] if tier == "nvme" else s[tier]["capacity"]

    def nbytes_in(self, tier: str) -> int:
        return self.store.stats()[tier]["bytes_in_use"]

    # ---- shards -----------------------------------------------------------------------------
    def has(self, name: str) -> bool:
        return name in self._home

    def tier_of(self, name: str) -> str:
        return self._home[name].value

    def create(self, name: str, tier: str, tier_class: str, init: torch.Tensor | None = None,
               numel: int | None = None, dtype: torch.dtype | None = None) -> None:
        """Register `name` with its home copy in `tier`: `init`'s values, or zeros of numel/dtype."""
        if init is not None:
            init = init.detach().reshape(-1).contiguous()
            numel, dtype = init.numel(), init.dtype
        try:
            self.store.register(name, numel, dtype, home=tier, tier_class=tier_class, init=init).result()
        except MemoryError as exc:
            raise MemoryError(f"offload: shard {name!r} ({format_size(numel * dtype.itemsize)}) does not fit its "
                              f"{tier} tier: {exc}") from exc
        self._home[name] = Tier(tier)

    def _where(self, name: str, compute: bool) -> Tier:
        home = self._home[name]
        if compute and self.device.type != "cpu":
            return Tier.DEVICE
        # on the host: nvme homes get a working copy in the arena; memory homes lend their home copy
        return Tier.CPU if home is Tier.NVME else home

    def acquire(self, name: str, compute: bool = False) -> torch.Tensor:
        where = self._where(name, compute)
        t = self.store.fetch(name, where).result()  # the bytes must be there before the caller reads them
        if not compute and t.device.type != "cpu":  # device-homed state stepped by the CPU optimizer
            host = t.to("cpu")
            self._private[name] = t
            return host
        return t

    def release(self, name: str, tensor: torch.Tensor | None = None, dirty: bool = False,
                compute: bool = False) -> None:
        where = self._where(name, compute)
        if name in self._private:
            home = self._private.pop(name)
            if dirty:
                home.copy_(tensor)
            return
        if where is self._home[name]:
            return  # the home copy itself: in-place updates are already home
        # dropping (and first writing home) the working copy; waited so its arena range is free again
        self.store.release(name, writeback=dirty).result()

    # ---- lifetime / stats -------------------------------------------------------------------
    def stats(self) -> dict:
        s = self.store.stats()
        return {
            "nvme_read": s["moved"]["nvme->cpu"],
            "nvme_written": s["moved"]["cpu->nvme"],
            "host_to_device": s["moved"]["cpu->device"],
            "device_to_host": s["moved"]["device->cpu"],
            "peak_resident": {t: s[t]["peak_bytes"] for t in ("device", "cpu", "nvme")},
        }

    def close(self) -> None:
        """Close the store (joins its threads, frees the arena, removes swap files) and the run directory."""
        self.store.close()
        self._home.clear()
        self._private.clear()
        if self.nvme_dir is not None and self.nvme_dir.exists():
            shutil.rmtree(self.nvme_dir, ignore_errors=True)

    @property
    def closed(self) -> bool:
        return self.store.closed


def check_nvme_path(path: str | os.PathLike, need_bytes: int | None, what: str) -> None:
    """Fail early (with the numbers) when `path` is missing, read-only, or has less than `need_bytes` free."""
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"offload.Config.nvme_path: {p} does not exist; create it (mkdir -p {p}) "
                                "on the NVMe drive you want to swap to")
    if not p.is_dir():
        raise NotADirectoryError(f"offload.Config.nvme_path: {p} is not a directory")
    probe = p / f".offload-probe-{os.getpid()}"
    try:
        with open(probe, "wb") as f:
            f.write(b"\0" * 4096)
        probe.unlink()
    except OSError as exc:
        raise PermissionError(
            f"offload.Config.nvme_path: {p} is not writable ({exc.strerror}, errno {exc.errno}); "
            "give a directory this process can write to"
        ) from exc
    if need_bytes is not None:
        free = shutil.disk_usage(p).free
        if free < need_bytes:
            raise OSError(
                f"offload.Config.nvme_path: {p} has {format_size(free)} ({free} bytes) free but {what} needs "
                f"{format_size(need_bytes)} ({need_bytes} bytes); free space or choose a larger drive"
            )
