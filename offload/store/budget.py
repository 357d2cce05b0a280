"""Tier budgets: "60GiB"-style sizes or "auto", and the device tier's allocator.

"auto" resolves to a stated fraction of what is free now:
    device: 90% of torch.cuda.mem_get_info() free bytes; on a machine without CUDA 25% of
            psutil.virtual_memory().available (the device tier is then a region of host memory)
    cpu:    50% of psutil.virtual_memory().available
    nvme:   90% of the free bytes of the swap directory's filesystem (shutil.disk_usage)
"""
from __future__ import annotations

import contextlib
import os
import shutil
import threading
import time
from dataclasses import dataclass

import torch

from .arena import ArenaBusyError, ArenaFullError, PinnedArena
from .sizes import format_bytes, parse_size

__all__ = ["AUTO_FRACTION", "resolve_budget", "DeviceTier"]

AUTO_FRACTION = {"device_cuda": 0.90, "device_host": 0.25, "cpu": 0.50, "nvme": 0.90}


def resolve_budget(value: int | str, tier: str, *, nvme_path: str | None = None,
                   device: torch.device | None = None) -> int:
    """Bytes of a tier budget; `value` is a size or "auto" (see the module docstring)."""
    what = f"{tier}_budget"
    if value != "auto":
        return parse_size(value, what)
    if tier == "device":
        if torch.cuda.is_available():
            free, _ = torch.cuda.mem_get_info(device)  # the store's GPU (None: the current one)
            return int(free * AUTO_FRACTION["device_cuda"])
        import psutil

        return int(psutil.virtual_memory().available * AUTO_FRACTION["device_host"])
    if tier == "cpu":
        import psutil

        return int(psutil.virtual_memory().available * AUTO_FRACTION["cpu"])
    if tier == "nvme":
        if not nvme_path:
            return 0
        probe = nvme_path
        while probe and not os.path.exists(probe):  # the directory may not exist yet
            probe = os.path.dirname(probe)
        return int(shutil.disk_usage(probe or ".").free * AUTO_FRACTION["nvme"])
    raise ValueError(f"unknown tier {tier!r}")


@dataclass(eq=False)
class _CudaBlock:
    tier: "DeviceTier"
    nbytes: int
    reserved: int
    tensor: torch.Tensor
    freed: bool = False

    def view(self, dtype: torch.dtype, numel: int) -> torch.Tensor:
        return self.tensor[: numel * torch.empty((), dtype=dtype).element_size()].view(dtype)

    def free(self) -> None:
        self.tier._free(self)


class DeviceTier:
    """The device tier's memory: a budget of `capacity` bytes handing out blocks with the arena's
    interface (alloc(nbytes, timeout) -> block with .view(dtype, numel), .free(), .reserved).

    With CUDA: tensors from torch's caching allocator on `device`, counted against the budget
    (rounded to 512 bytes, torch's own granularity). Without: a host PinnedArena (not locked), so
    the budget is enforced exactly the same way and the compute device is the CPU."""

    def __init__(self, capacity: int, device: torch.device, alloc_stream=None):
        self.device = device
        self.alloc_stream = alloc_stream  # CUDA: blocks come from this stream's pool (the stream that fills them)
        self.capacity = capacity
        self._host = None
        if device.type == "cpu":
            self._host = PinnedArena(capacity, lock=False, name="device tier (host memory)")
            self.capacity = self._host.capacity
        self._cv = threading.Condition()
        self._in_use = 0
        self._peak = 0

    @property
    def bytes_in_use(self) -> int:
        return self._host.bytes_in_use if self._host else self._in_use

    @property
    def peak_bytes(self) -> int:
        return self._host.peak_bytes if self._host else self._peak

    def alloc(self, nbytes: int, timeout: float | None = None):
        if self._host is not None:
            return self._host.alloc(nbytes, timeout)
        size = -(-nbytes // 512) * 512
        if size > self.capacity:
            raise ArenaFullError(
                f"device tier: a request of {format_bytes(nbytes)} ({nbytes} bytes) can never fit in the device "
                f"budget of {format_bytes(self.capacity)}; raise device_budget"
            )
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cv:
            while self._in_use + size > self.capacity:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise ArenaBusyError(
                        f"device tier: timed out after {timeout}s waiting for {format_bytes(nbytes)}; "
                        f"{format_bytes(self._in_use)} of {format_bytes(self.capacity)} in use"
                    )
                self._cv.wait(left)  # woken by _free
            self._in_use += size
            self._peak = max(self._peak, self._in_use)
        try:
            with torch.cuda.stream(self.alloc_stream) if self.alloc_stream is not None else contextlib.nullcontext():
                t = torch.empty(size, dtype=torch.uint8, device=self.device)[:nbytes]
        except Exception:
            self._release(size)
            raise
        return _CudaBlock(self, nbytes, size, t)

    def _release(self, size: int) -> None:
        with self._cv:
            self._in_use -= size
            self._cv.notify_all()  # budget freed: waiters re-check

    def _free(self, blk: _CudaBlock) -> None:
        if blk.freed:
            raise RuntimeError("device tier: block freed twice")
        blk.freed = True
        blk.tensor = torch.empty(0, dtype=torch.uint8)
        self._release(blk.reserved)

    def close(self) -> None:
        if self._host is not None:
            self._host.close()
