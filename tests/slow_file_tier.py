"""A storage tier that exists only in the tests: shards' bytes in one plain file on a second path, read and
written with pread/pwrite on a small thread pool, each I/O delayed by `latency_s` (a slow remote store).
The whole tier is this file; the last line registers it (docs/tiers.md).

    StoreConfig(tiers={"file2": {"path": "/tmp/x", "budget": "1MiB", "latency_s": 0.002}})
"""
from __future__ import annotations

import concurrent.futures as cf
import os
import time
from dataclasses import dataclass

import torch

from offload.store.sizes import parse_size
from offload.store.storage_tier import FutureHandle, StorageTier, register_storage_tier
from offload.store.swap_file import SwapSpaceError, page_bytes


@dataclass
class FileSlot:
    offset: int
    nbytes: int


class SlowFileTier(StorageTier):
    name = "file2"
    read_link, write_link = StorageTier.links_of("file2")

    def __init__(self, path: str, budget: int, latency_s: float, rank: int):
        os.makedirs(path, exist_ok=True)
        self.path = os.path.join(path, f"rank{rank}-file2.bin")
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        self.latency_s = latency_s
        self._capacity, self._used, self._end = budget, 0, 0
        self._freed: dict[int, list[int]] = {}  # slot bytes -> offsets given back (reused by slots of that size)
        self._pool = cf.ThreadPoolExecutor(4, thread_name_prefix="file2")

    @classmethod
    def build(cls, config, settings: dict) -> "SlowFileTier":
        unknown = set(settings) - {"path", "budget", "latency_s"}
        if unknown or "path" not in settings:
            raise ValueError(f"StoreConfig.tiers['file2']: give 'path' (and 'budget', 'latency_s'), not {unknown}")
        return cls(settings["path"], parse_size(settings.get("budget", "64MiB"), "StoreConfig.tiers['file2'].budget"),
                   float(settings.get("latency_s", 0.0)), config.rank)

    @property
    def capacity(self) -> int:
        return self._capacity

    @property
    def bytes_in_use(self) -> int:
        return self._used

    def fresh_slot_reads_zero(self, tier_class: str) -> bool:
        return not any(self._freed.values())  # past the end the file reads as zeros; a freed slot does not

    def reserve(self, shard: object, nbytes: int, tier_class: str) -> FileSlot:
        size = page_bytes(nbytes)
        if self._used + size > self._capacity:
            raise SwapSpaceError(28, f"shard {shard!r} needs {size} bytes of file2 but its budget has "
                                     f"{self._capacity - self._used} left; raise StoreConfig.tiers['file2'].budget")
        reuse = self._freed.get(size)
        offset = reuse.pop() if reuse else self._end
        self._end = max(self._end, offset + size)
        self._used += size
        return FileSlot(offset, nbytes)

    def free(self, slot: FileSlot) -> None:
        size = page_bytes(slot.nbytes)
        self._freed.setdefault(size, []).append(slot.offset)
        self._used -= size

    def _read(self, offset: int, buf: torch.Tensor) -> None:
        time.sleep(self.latency_s)
        view, done = memoryview(buf.numpy()), 0
        while done < len(view):
            got = os.preadv(self.fd, [view[done:]], offset + done)
            if got == 0:  # past the end: never written, so zeros
                view[done:] = bytes(len(view) - done)
                return
            done += got

    def _write(self, offset: int, buf: torch.Tensor) -> None:
        time.sleep(self.latency_s)
        view, done = memoryview(buf.numpy()), 0
        while done < len(view):
            done += os.pwrite(self.fd, view[done:], offset + done)

    def read(self, slot: FileSlot, buf: torch.Tensor) -> FutureHandle:
        return FutureHandle(self._pool.submit(self._read, slot.offset, buf))

    def write(self, slot: FileSlot, buf: torch.Tensor) -> FutureHandle:
        return FutureHandle(self._pool.submit(self._write, slot.offset, buf))

    def where(self, slot: FileSlot) -> str:
        return f"{self.path} at offset {slot.offset}"

    def paths(self) -> list[str]:
        return [self.path]

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        os.close(self.fd)
        os.unlink(self.path)


register_storage_tier(SlowFileTier.name, SlowFileTier.build)
