"""Where the runtime's shards live: named flat tensors with a home tier (device / cpu / nvme).

This is the runtime's narrow view of the tiered store: `put` (create or write back), `get` (bring to a
device, aliasing the resident tensor when it already lives there), `delete`, byte accounting per tier and
bytes moved. Memory tiers hold the tensor itself; the nvme tier holds one swap file per shard under the
run directory and reads it into a fresh host tensor on `get` (the caller drops it after use, so nvme-homed
state occupies host memory only while a unit is being worked on). Synchronous by design: every call
returns when its bytes are where it says.
"""
from __future__ import annotations

import os
import shutil
import threading
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..config import format_size

MEMORY_TIERS = ("device", "cpu")


@dataclass
class _Entry:
    tier: str
    shape: tuple
    dtype: torch.dtype
    nbytes: int
    tensor: torch.Tensor | None = None  # memory tiers
    path: Path | None = None  # nvme tier


@dataclass
class StorageStats:
    """Bytes moved, per direction (cumulative since the storage was created)."""

    nvme_read: int = 0
    nvme_written: int = 0
    host_to_device: int = 0
    device_to_host: int = 0
    peak_resident: dict = field(default_factory=lambda: {"device": 0, "cpu": 0, "nvme": 0})


class ShardStorage:
    """Named shards in tiers, within budgets. `device` is the compute device (CPU on a CPU machine)."""

    def __init__(self, device: torch.device, budgets: dict[str, int | None], nvme_dir: Path | None):
        self.device = torch.device(device)
        self.budgets = dict(budgets)
        self.nvme_dir = nvme_dir
        self._entries: dict[str, _Entry] = {}
        self.resident = {"device": 0, "cpu": 0, "nvme": 0}
        self.stats = StorageStats()
        self._lock = threading.Lock()
        self.closed = False

    # ---- placement -------------------------------------------------------------------------
    def _tier_device(self, tier: str) -> torch.device:
        return self.device if tier == "device" else torch.device("cpu")

    def _charge(self, tier: str, nbytes: int, name: str) -> None:
        budget = self.budgets.get(tier)
        if budget is not None and self.resident[tier] + nbytes > budget:
            raise MemoryError(
                f"offload: the {tier} tier cannot hold shard {name!r} ({format_size(nbytes)}): "
                f"{format_size(self.resident[tier])} already resident of a {tier}_budget of {format_size(budget)}. "
                f"Raise {tier}_budget or move this state to a lower tier (params=/optimizer= 'cpu' or 'nvme')."
            )
        self.resident[tier] += nbytes
        self.stats.peak_resident[tier] = max(self.stats.peak_resident[tier], self.resident[tier])

    def has(self, name: str) -> bool:
        return name in self._entries

    def tier_of(self, name: str) -> str:
        return self._entries[name].tier

    def put(self, name: str, tensor: torch.Tensor, tier: str | None = None) -> None:
        """Create `name` in `tier` from `tensor` (copied), or write `tensor` back to an existing `name`.

        Writing back the very tensor `get` returned for a memory tier is free (it is the resident copy).
        """
        self._check_open()
        tensor = tensor.detach()
        entry = self._entries.get(name)
        if entry is None:
            if tier is None:
                raise KeyError(f"offload storage: {name!r} does not exist; give a tier to create it")
            nbytes = tensor.numel() * tensor.element_size()
            self._charge(tier, nbytes, name)
            entry = _Entry(tier, tuple(tensor.shape), tensor.dtype, nbytes)
            self._entries[name] = entry
            if tier in MEMORY_TIERS:
                entry.tensor = torch.empty(tensor.shape, dtype=tensor.dtype, device=self._tier_device(tier))
            else:
                entry.path = self.nvme_dir / (name.replace("/", "_") + ".swp")
        if tuple(tensor.shape) != entry.shape or tensor.dtype != entry.dtype:
            raise ValueError(
                f"offload storage: write of {tuple(tensor.shape)}/{tensor.dtype} into {name!r} "
                f"which is {entry.shape}/{entry.dtype}"
            )
        if entry.tier in MEMORY_TIERS:
            if tensor.data_ptr() != entry.tensor.data_ptr():
                self._count_copy(tensor.device, entry.tensor.device, entry.nbytes)
                entry.tensor.copy_(tensor)
        else:
            host = tensor.to("cpu") if tensor.device.type != "cpu" else tensor
            if tensor.device.type != "cpu":
                self.stats.device_to_host += entry.nbytes
            _write_file(entry.path, host.contiguous())
            self.stats.nvme_written += entry.nbytes

    def get(self, name: str, device: torch.device | str | None = None) -> torch.Tensor:
        """The shard on `device` (default: host). Memory tiers return the resident tensor itself when it
        already lives on `device` (in-place updates need no write back); nvme reads a fresh host copy."""
        self._check_open()
        entry = self._entries[name]
        device = torch.device(device) if device is not None else torch.device("cpu")
        if entry.tier in MEMORY_TIERS:
            src = entry.tensor
        else:
            src = torch.empty(entry.shape, dtype=entry.dtype)
            _read_file(entry.path, src)
            self.stats.nvme_read += entry.nbytes
        if src.device == device or (src.device.type == device.type == "cpu"):
            return src
        self._count_copy(src.device, device, entry.nbytes)
        return src.to(device)

    def delete(self, name: str) -> None:
        entry = self._entries.pop(name, None)
        if entry is None:
            return
        self.resident[entry.tier] -= entry.nbytes
        entry.tensor = None
        if entry.path is not None:
            try:
                entry.path.unlink()
            except FileNotFoundError:
                pass

    def nbytes_in(self, tier: str) -> int:
        return self.resident[tier]

    def _count_copy(self, src: torch.device, dst: torch.device, nbytes: int) -> None:
        if src.type == "cpu" and dst.type != "cpu":
            self.stats.host_to_device += nbytes
        elif src.type != "cpu" and dst.type == "cpu":
            self.stats.device_to_host += nbytes

    def _check_open(self) -> None:
        if self.closed:
            raise RuntimeError("offload: the runtime's storage is closed (the offload.init block has exited)")

    def close(self) -> None:
        """Drop every shard and remove the swap files (and the run directory this storage owns)."""
        for name in list(self._entries):
            self.delete(name)
        if self.nvme_dir is not None and self.nvme_dir.exists():
            shutil.rmtree(self.nvme_dir, ignore_errors=True)
        self.closed = True


def _as_bytes(t: torch.Tensor) -> memoryview:
    return memoryview(t.view(-1).view(torch.uint8).numpy())


def _write_file(path: Path, t: torch.Tensor) -> None:
    try:
        with open(path, "wb", buffering=0) as f:
            f.write(_as_bytes(t))
    except OSError as exc:
        raise OSError(exc.errno, f"offload: writing swap file {path} ({t.numel() * t.element_size()} bytes) failed: "
                      f"{exc.strerror}") from exc


def _read_file(path: Path, out: torch.Tensor) -> None:
    want = out.numel() * out.element_size()
    try:
        with open(path, "rb", buffering=0) as f:
            got = f.readinto(_as_bytes(out))
    except OSError as exc:
        raise OSError(exc.errno, f"offload: reading swap file {path} failed: {exc.strerror}") from exc
    if got != want:
        raise OSError(f"offload: short read of swap file {path}: {got} of {want} bytes")


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
