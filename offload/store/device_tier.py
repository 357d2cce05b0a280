"""The device tier: the compute device's memory within the device budget (budget.DeviceTier, the allocator), a
MemoryTier (memory_tier.py), and the copies between it and the cpu tier, on one host->device and one
device->host stream (device.py). Without a GPU it is a budgeted region of host memory and its copies are host
copies: the same code path, so CPU runs test it.
"""
from __future__ import annotations

import torch

from ..device import Streams
from ..device import record as device_record
from ..device import sync as device_sync
from ..device import wait as device_wait
from ..ops.copy import copy_ as host_copy
from .budget import DeviceTier
from .links import Link
from .memory_tier import MemoryTier
from .residency import Tier

__all__ = ["DeviceMemoryTier"]


class DeviceMemoryTier(MemoryTier):
    level = Tier.DEVICE

    def __init__(self, capacity: int, device: torch.device):
        self.device = device
        self.streams = Streams(device)  # GPU: one host->device and one device->host copy stream
        # device blocks are allocated on the host->device stream that fills them (device.py)
        super().__init__(Tier.DEVICE.value, DeviceTier(capacity, device,
                                                       alloc_stream=self.streams.get(Link.CPU_TO_DEVICE)))

    def set_limit(self, nbytes: int) -> int:
        """Hold at most `nbytes` from now on (an "auto" budget fitted after the first step); the limit set."""
        return self.pool.set_limit(nbytes)

    def stream_point(self):
        """On CUDA, an event on the caller's current stream now: a copy that waits for it sees the caller's queued
        writes to a working copy, and a block just taken from the caching allocator is not written while kernels
        queued before may still use its previous occupant. None without CUDA."""
        if self.device.type != "cuda":
            return None
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(self.device))
        return ev

    def copy(self, dst: torch.Tensor, src: torch.Tensor, after=None) -> None:
        """dst <- src between cpu and device blocks (both host tensors without a GPU); returns once the bytes have
        landed, so that a block may be freed or reused right after. `after`: a stream_point() the copy waits for."""
        if dst.device.type == "cpu" and src.device.type == "cpu":
            host_copy(dst, src)  # multi-threaded C++ copy (GIL released)
            return
        link = Link.CPU_TO_DEVICE if dst.is_cuda else Link.DEVICE_TO_CPU
        with self.streams.use(link):  # pinned arena <-> device block: a DMA on the copy stream
            device_wait(after, self.device)  # the caller's writes to the working copy, queued before the request
            dst.copy_(src, non_blocking=True)
            done = device_record(self.device)
        device_sync(done)  # the calling worker goes on (and a block may be freed) only once the copy is over
