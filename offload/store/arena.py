"""Pinned arena: one large host allocation, sub-allocated in exact sizes at 4096-byte alignment.

    arena = PinnedArena("8GiB")            # or a byte count; lock="auto" | True | False
    blk = arena.alloc(nbytes, timeout=None)  # blocks until a range is free; ArenaFullError if it never can be
    blk = arena.alloc(nbytes, slot=S)      # a short-lived buffer: S bytes (>= nbytes), first fit
    t = blk.view(torch.bfloat16, numel)    # or blk.tensor (uint8, exactly nbytes)
    blk.free()                             # or `with arena.alloc(n) as blk:`
    arena.bytes_in_use, arena.peak_bytes, arena.locked, arena.lock_kind, arena.numa_node
    arena.set_limit(nbytes)                # hold at most nbytes at once from now on (<= capacity)
    arena.close()                          # unlocks / unregisters and drops the allocation

Why one allocation: torch's pinned allocator rounds every block up to a power of two and pins each
one separately; here a block costs its size rounded up to 4096 (so every block can be an O_DIRECT
buffer) and the page-locking happens once.

Locking (lock="auto"): with CUDA, the whole range is registered with cudaHostRegister (via
torch.cuda.cudart()), which makes it pinned for async H2D/D2H copies. Without CUDA, it is mlock'ed
when it fits under RLIMIT_MEMLOCK (lock_kind says "mlock", or "none" with the reason in lock_error);
lock=True locks regardless of the soft limit where the process may (root / CAP_IPC_LOCK) and raises
otherwise; lock=False never locks. pin_memory() is never called: CPU-only torch refuses it. Both locks fault
every page in on one thread before pinning it; the arena faults them in first from several threads
(prefault(): MADV_POPULATE_WRITE on 256 MiB segments), so a 100+ GiB arena pins in a fraction of the time.
numa_node=N: its pages prefer that NUMA node (numa.py: mbind before the first touch), the GPU's socket.

Free ranges are kept sorted by offset; a free coalesces with both neighbours, so a fully freed arena
is one free range again. `alloc` waits on a condition variable for a free(), so a buffer is only handed
out again after its previous owner freed it.

Short-lived buffers (a working copy being stepped, gathered or read ahead) may ask for a `slot`: every one
then takes the same S bytes. Placed first fit, slots tile each free range from its start, so a range of L
bytes holds L // S of them whatever the order of allocations and frees: while the long-lived blocks (home
copies, resident states: exact sizes) stay put, the free_slots(S) counted once are always there to be
had. Without slots, a mix of sizes can leave the room split into pieces too small to use (a 4.7 MiB
request waited forever with 10 MiB free in 4.68 MiB pieces).
"""
from __future__ import annotations

import bisect
import ctypes
import ctypes.util
import mmap
import os
import resource
import threading
import time
import warnings
from dataclasses import dataclass

import torch

from . import numa
from .sizes import format_bytes, parse_size

__all__ = ["PinnedArena", "ArenaBlock", "ArenaFullError", "ArenaBusyError", "ALIGN"]

ALIGN = 4096


class ArenaFullError(MemoryError):
    """A request that can never be satisfied (larger than the arena) or that timed out waiting."""


class ArenaBusyError(ArenaFullError):
    """No range is free now and none came free within the timeout (timeout=0: at once): the request
    itself could fit, so a caller may back off and try later."""


def _clear_cuda_last_error() -> int | None:
    """cudaGetLastError() of the libcudart this process loaded (torch does not bind it): a failed
    cudaHostRegister leaves its error as CUDA's last error, which torch's next kernel-launch check would
    report as its own. The error cleared, or None when no libcudart is loaded."""
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "libcudart" in line}
        codes = [int(ctypes.CDLL(path).cudaGetLastError()) for path in sorted(paths)]  # each loaded copy's
        return next((c for c in codes if c), 0) if codes else None
    except OSError:
        return None


def _page_aligned_bytes(nbytes: int) -> torch.Tensor:
    """`nbytes` zeroed bytes whose storage starts on a page boundary: an anonymous private mapping, unmapped when
    the last tensor viewing it dies. The storage's own first byte must be in the registered range, not only the
    views': torch's is_pinned() asks CUDA about the storage's start (a page-aligned view of a larger torch.empty
    read as not pinned on an H200, though its copies were asynchronous)."""
    if nbytes == 0:
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer(mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS), dtype=torch.uint8)


def _round_up(n: int, a: int = ALIGN) -> int:
    return -(-n // a) * a


@dataclass(eq=False)
class ArenaBlock:
    """A sub-range of the arena: `tensor` is a uint8 view of exactly `nbytes` bytes at `offset`
    (a multiple of 4096 from the arena's 4096-aligned base). Valid until free()."""

    arena: "PinnedArena"
    offset: int
    nbytes: int
    reserved: int  # nbytes rounded up to 4096: the length of an O_DIRECT transfer of the block
    tensor: torch.Tensor
    freed: bool = False
    span: int = 0  # bytes the block takes from the arena: `reserved`, or its slot

    def view(self, dtype: torch.dtype, numel: int | None = None) -> torch.Tensor:
        """The block as a 1-D tensor of `dtype` (default: as many elements as fit)."""
        item = dtype.itemsize  # (no tensor made: a lease of a memory home views its block each time)
        if numel is None:
            numel = self.nbytes // item
        if numel * item > self.nbytes:
            raise ValueError(f"view of {numel} x {dtype} needs {numel * item} bytes; the block has {self.nbytes}")
        return self.tensor[: numel * item].view(dtype)

    def padded(self) -> torch.Tensor:
        """The block's whole reserved range (nbytes rounded up to 4096) as uint8: the length an O_DIRECT
        read or write of this block must use."""
        if self.freed:
            raise RuntimeError(f"{self.arena.name}: block at offset {self.offset} is freed")
        return self.arena.buffer[self.offset : self.offset + self.reserved]

    def data_ptr(self) -> int:
        return self.arena.base_ptr + self.offset

    def free(self) -> None:
        self.arena._free(self)

    def __enter__(self) -> "ArenaBlock":
        return self

    def __exit__(self, *exc) -> None:
        if not self.freed:
            self.free()


class PinnedArena:
    """See the module docstring."""

    def __init__(self, capacity: int | str, *, lock: bool | str = "auto", name: str = "arena",
                 numa_node: int | None = None):
        self.capacity = _round_up(parse_size(capacity, "capacity", counts=True))
        self.limit = self.capacity  # what may be in use at once: the capacity, or less once set_limit lowers it
        self.name = name
        self._cv = threading.Condition()
        self._free_offsets: list[int] = []  # sorted starts of free ranges
        self._free_sizes: dict[int, int] = {}  # start -> length
        self._live: dict[int, ArenaBlock] = {}  # offset -> block
        self.bytes_in_use = 0  # reserved bytes (sizes rounded to 4096)
        self.bytes_requested = 0  # exact bytes asked for by live blocks
        self.peak_bytes = 0
        self.closed = False
        self.lock_kind = "none"
        self.lock_error: str | None = None
        self.prefault_s: float | None = None  # seconds the parallel pre-fault before locking took (None: not done)
        self.numa_node: int | None = None  # the node its pages prefer (numa.py), None: the kernel's default
        self.numa_error: str | None = None  # why a node asked for is not set
        self._raw = _page_aligned_bytes(self.capacity)  # one allocation
        self.buffer = self._raw
        self.base_ptr = self.buffer.data_ptr()
        if numa_node is not None and self.capacity:
            # before any page is touched (the pre-fault and the lock fault them all in): they land on the node
            self.numa_error = numa.prefer(self.base_ptr, self.capacity, numa_node)
            self.numa_node = numa_node if self.numa_error is None else None
        if self.capacity:
            self._free_offsets = [0]
            self._free_sizes = {0: self.capacity}
        if lock is not False and self.capacity:
            self._lock(required=lock is True)

    # ------------------------------------------------------------------ locking

    @property
    def locked(self) -> bool:
        return self.lock_kind != "none"

    def _lock(self, required: bool) -> None:
        if torch.cuda.is_available():
            self.prefault_s = prefault(self.base_ptr, self.capacity)  # registering faults every page in: parallel first
            cudart = torch.cuda.cudart()
            rc = cudart.cudaHostRegister(self.base_ptr, self.capacity, 0)  # flags 0: cudaHostRegisterDefault
            code = int(getattr(rc, "value", rc))
            if code == 0:
                self.lock_kind = "cuda"
                return
            cleared = _clear_cuda_last_error()  # else torch's next CUDA check raises this error, far from here
            self.lock_error = (f"cudaHostRegister({format_bytes(self.capacity)}) failed with cudaError {code}"
                               + ("" if cleared is not None else " (libcudart not found to clear the error)"))
        else:
            soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
            over = soft != resource.RLIM_INFINITY and soft < self.capacity
            if over and not required:
                # "auto" respects the limit even for root (who could exceed it): locking a large arena
                # commits all of it at once, which a shared CPU-only machine should not get by default.
                self.lock_error = (
                    f"RLIMIT_MEMLOCK is {format_bytes(soft)} < arena {format_bytes(self.capacity)} "
                    "(raise it with `ulimit -l`, or pass lock=True to lock anyway where CAP_IPC_LOCK allows)"
                )
            else:
                self.prefault_s = prefault(self.base_ptr, self.capacity)  # mlock faults every page in: parallel first
                err = _libc().mlock(ctypes.c_void_p(self.base_ptr), ctypes.c_size_t(self.capacity))
                if err == 0:
                    self.lock_kind = "mlock"
                    return
                e = ctypes.get_errno()
                self.lock_error = f"mlock({format_bytes(self.capacity)}) failed: {os.strerror(e)} (errno {e})"
        if required:
            raise OSError(f"{self.name}: could not page-lock the arena: {self.lock_error}")
        if torch.cuda.is_available():  # on a GPU unpinned host memory makes every copy synchronous: say so
            warnings.warn(f"offload: {self.name} is not page-locked ({self.lock_error}); host<->GPU copies of it "
                          "will not overlap compute. Lower cpu_budget or raise the locked-memory limit (ulimit -l)",
                          RuntimeWarning, stacklevel=3)

    def _unlock(self) -> None:
        if self.lock_kind == "cuda":
            torch.cuda.cudart().cudaHostUnregister(self.base_ptr)
        elif self.lock_kind == "mlock":
            _libc().munlock(ctypes.c_void_p(self.base_ptr), ctypes.c_size_t(self.capacity))
        self.lock_kind = "none"

    # ------------------------------------------------------------------ allocation

    def _find(self, size: int) -> int | None:
        for off in self._free_offsets:  # first fit
            if self._free_sizes[off] >= size:
                return off
        return None

    def _carve(self, at: int, size: int) -> None:
        """Take [at, at + size) out of the free range that holds it."""
        i = bisect.bisect_right(self._free_offsets, at) - 1
        start = self._free_offsets[i]
        length = self._free_sizes.pop(start)
        del self._free_offsets[i]
        for lo, hi in ((start, at), (at + size, start + length)):  # what is left below and above
            if hi > lo:
                bisect.insort(self._free_offsets, lo)
                self._free_sizes[lo] = hi - lo

    def set_limit(self, nbytes: int) -> int:
        """Hold at most `nbytes` in use from now on (at most the capacity; rounded up to 4096): blocks in use
        stay, requests that would pass it wait for frees. The limit set."""
        with self._cv:
            self.limit = min(self.capacity, _round_up(max(0, int(nbytes))))
            self._cv.notify_all()  # a raised limit lets waiters in; a lowered one makes waiters re-check
            return self.limit

    def free_slots(self, slot: int) -> int:
        """How many blocks of `slot` bytes the free ranges hold at once (each range: its length // slot)."""
        with self._cv:
            return sum(n // slot for n in self._free_sizes.values()) if slot else 0

    def largest_free(self) -> int:
        with self._cv:
            return max(self._free_sizes.values(), default=0)

    def alloc(self, nbytes: int, timeout: float | None = None, slot: int | None = None) -> ArenaBlock:
        """A block of exactly `nbytes` (taking nbytes rounded up to 4096 from the arena, or `slot` bytes: see
        the module docstring). Waits until a large enough range is free; `timeout` seconds
        (None: forever) then ArenaFullError. A request larger than the whole arena raises ArenaFullError at
        once."""
        nbytes = int(nbytes)
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes}")
        size = _round_up(nbytes)
        span = size
        if slot is not None:
            if slot % ALIGN or slot < size:
                raise ValueError(f"slot must be a multiple of {ALIGN} of at least {size} bytes, got {slot}")
            span = slot
        if span > self.capacity:
            raise ArenaFullError(
                f"{self.name}: a request of {format_bytes(nbytes)} ({nbytes} bytes) can never fit in the arena's "
                f"capacity of {format_bytes(self.capacity)}; raise the cpu budget"
            )
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cv:
            while True:
                if self.closed:
                    raise RuntimeError(f"{self.name}: alloc on a closed arena")
                if span > self.limit:  # a caller that may back off (a prefetch) does; any other never gets it
                    raise (ArenaFullError if timeout is None else ArenaBusyError)(
                        f"{self.name}: a request of {format_bytes(nbytes)} ({nbytes} bytes) is over the arena's "
                        f"limit of {format_bytes(self.limit)} (set_limit, below its capacity)")
                off = self._find(span) if span else 0
                if off is not None and self.bytes_in_use + span <= self.limit:
                    break
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise ArenaBusyError(
                        f"{self.name}: timed out after {timeout}s waiting for {format_bytes(span)}; "
                        f"{format_bytes(self.bytes_in_use)} of {format_bytes(self.capacity)} in use, largest free "
                        f"range {format_bytes(max(self._free_sizes.values(), default=0))}"
                    )
                self._cv.wait(left)  # woken by _free (or close); re-check the free list
            if span:
                self._carve(off, span)
            blk = ArenaBlock(self, off, nbytes, size, self.buffer[off : off + nbytes], span=span)
            if span:
                self._live[off] = blk
            self.bytes_in_use += span
            self.bytes_requested += nbytes
            self.peak_bytes = max(self.peak_bytes, self.bytes_in_use)
            return blk

    def _free(self, blk: ArenaBlock) -> None:
        with self._cv:
            if blk.freed:
                raise RuntimeError(f"{self.name}: block at offset {blk.offset} freed twice")
            blk.freed = True
            blk.tensor = _EMPTY  # the block no longer hands out the range it gave back
            self.bytes_in_use -= blk.span
            self.bytes_requested -= blk.nbytes
            if not blk.span or self.closed:
                return
            del self._live[blk.offset]
            off, size = blk.offset, blk.span
            i = bisect.bisect_left(self._free_offsets, off)
            # coalesce with the next free range
            if i < len(self._free_offsets) and self._free_offsets[i] == off + size:
                size += self._free_sizes.pop(self._free_offsets[i])
                del self._free_offsets[i]
            # and with the previous one
            if i > 0:
                prev = self._free_offsets[i - 1]
                if prev + self._free_sizes[prev] == off:
                    self._free_sizes[prev] += size
                    self._cv.notify_all()  # a larger range is free: waiters re-check
                    return
            self._free_offsets.insert(i, off)
            self._free_sizes[off] = size
            self._cv.notify_all()  # a range is free: waiters re-check

    # ------------------------------------------------------------------ lifetime

    @property
    def live_blocks(self) -> int:
        with self._cv:
            return len(self._live)

    def stats(self) -> dict:
        with self._cv:
            return {
                "capacity": self.capacity,
                "limit": self.limit,
                "bytes_in_use": self.bytes_in_use,
                "bytes_requested": self.bytes_requested,
                "peak_bytes": self.peak_bytes,
                "largest_free": max(self._free_sizes.values(), default=0),
                "live_blocks": len(self._live),
                "locked": self.locked,
                "lock_kind": self.lock_kind,
            }

    def close(self) -> None:
        """Unlock and drop the allocation. Blocks still live become invalid (their tensors keep the
        memory alive only as long as the caller holds them); waiters in alloc get an error."""
        with self._cv:
            if self.closed:
                return
            self.closed = True
            for blk in self._live.values():
                blk.freed = True
                blk.tensor = _EMPTY
            self._live.clear()
            self._cv.notify_all()  # waiters in alloc see `closed` and raise
        self._unlock()
        self.buffer = self._raw = None  # type: ignore[assignment]
        self.bytes_in_use = self.bytes_requested = 0

    def __enter__(self) -> "PinnedArena":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        try:
            if not self.closed:
                self.close()
        except Exception:
            pass


_EMPTY = torch.empty(0, dtype=torch.uint8)
_LIBC = None


_MADV_POPULATE_WRITE = 23  # Linux >= 5.14: fault a range in, writable, without touching it from user space
_PREFAULT_SEGMENT = 256 << 20


PREFAULT_MIN_BYTES = 2 << 30  # below it the lock's own faulting was as fast (1 GiB: 0.32 s alone, 0.36 s after)


def prefault(ptr: int, nbytes: int, threads: int | None = None, min_bytes: int = PREFAULT_MIN_BYTES) -> float | None:
    """Fault the pages of [ptr, ptr + nbytes) in from several threads at once (madvise MADV_POPULATE_WRITE on
    segments; ctypes lets the GIL go during each call). cudaHostRegister and mlock fault every page of the range
    in before they pin it, one page after another on one thread: for an arena of 100+ GiB that is minutes, and
    pre-faulted pages only need pinning. The seconds it took, or None where the kernel cannot (before 5.14: the
    lock then faults the pages itself, as before). Measured on 2 vCPUs: mlock of a fresh 4 GiB 2.4-3.6 s alone,
    1.1 s after a 2-thread pre-fault."""
    threads = threads or min(16, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count())
    if nbytes < max(min_bytes, 2 * _PREFAULT_SEGMENT) or threads < 2:
        return None  # small, or one core: the lock's own faulting is as fast (on one thread, faster: 2.4 s vs 4.0)
    libc = _libc()
    segments = [(o, min(_PREFAULT_SEGMENT, nbytes - o)) for o in range(0, nbytes, _PREFAULT_SEGMENT)]
    t0 = time.perf_counter()
    if libc.madvise(ctypes.c_void_p(ptr), ctypes.c_size_t(4096), _MADV_POPULATE_WRITE) != 0:
        return None  # EINVAL: not supported by this kernel
    failed = []

    def work(mine):
        for offset, length in mine:
            if libc.madvise(ctypes.c_void_p(ptr + offset), ctypes.c_size_t(length), _MADV_POPULATE_WRITE) != 0:
                failed.append(ctypes.get_errno())  # ENOMEM and the like: the lock reports what it finds
                return

    pool = [threading.Thread(target=work, args=(segments[i::threads],), name=f"offload-prefault-{i}")
            for i in range(min(threads, len(segments)))]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    return None if failed else time.perf_counter() - t0


def _libc():
    global _LIBC
    if _LIBC is None:
        _LIBC = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        _LIBC.mlock.argtypes = _LIBC.munlock.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        _LIBC.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return _LIBC
