"""How the runtime's large host buffers behave in the process's memory (Linux and glibc; no-ops elsewhere).

    tune_malloc(device)      how the run's host transients are allocated: the host pool (CPU default), or
                             glibc with an mmap threshold for RSS near what is in use, or for speed
    untune_malloc(mode)      the runtime closes: the pool's hold goes
    advise_huge_pages(t)     t's pages come as 2 MiB transparent huge pages when first touched
    peak_rss_bytes()         this process's peak resident set
    rss_bytes()              this process's resident set now
    reset_peak_rss()         the peak restarts from now (a measurement of what follows)

A freshly mapped buffer page-faults every 4 KiB when first written: a gathered unit's flat buffer is one
each time it is gathered, so it asks for huge pages, 512 times fewer faults (40 MiB fresh + copied: 2.9 ms
instead of 8.1 ms here).
"""
from __future__ import annotations

import resource
import sys

import torch

from .. import env

_HUGE = 2 << 20
_MADV_HUGEPAGE = 14
_libc = None


def _glibc():
    global _libc
    if _libc is None:
        import ctypes

        try:
            _libc = ctypes.CDLL("libc.so.6", use_errno=True)
            _libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        except (OSError, AttributeError):  # not glibc (musl, ...): nothing to tune
            _libc = False
    return _libc


MMAP_THRESHOLD = {"frugal": 128 * 1024, "fast": 32 << 20, "pool": 128 * 1024}  # glibc's initial value; its maximum


def malloc_mode(device: torch.device) -> str:
    """OFFLOAD_MALLOC_TUNE: "auto" (default) is "frugal" when compute runs on a GPU (host malloc then holds
    only transients: keep RSS tight) and "pool" on a CPU (the "device tier" is host memory: activations,
    gathered units and gradients are all host transients); "pool", "frugal", "fast", or "off" (leave glibc
    alone)."""
    mode = env.MALLOC_TUNE.get().lower()
    if mode == "auto":
        return "frugal" if device.type == "cuda" else "pool"
    if mode in ("0", "off"):
        return "off"
    if mode not in MMAP_THRESHOLD:
        raise ValueError(f"OFFLOAD_MALLOC_TUNE={mode!r}: expected auto, pool, frugal, fast or off")
    return mode


def tune_malloc(device: torch.device) -> str:
    """Set how host transients are allocated for the run (process-wide); returns the mode used.

    "pool": torch's CPU allocator is the host pool (store/host_pool.py) for requests of 128 KiB and up: a freed
    block is reused by the next request of its size class, at most a capped cache of them kept, so RSS is what
    is in use plus the cap, flat from step to step, and pages are faulted once. Where the pool cannot be
    installed (no C++ extension) "fast" is used. The others only fix glibc's M_MMAP_THRESHOLD: glibc serves a
    malloc above it with a fresh mmap (given back at free, first touch page-faults every 4 KiB) and by default
    raises it to the largest block freed so far (up to 32 MiB), after which such blocks come from the heap and
    are kept for reuse. "frugal" pins it at 128 KiB: RSS near what is in use, but on a CPU-only run every
    activation and gradient page-faults again each step (the 50M-parameter bench: 0.84 s/step instead of 0.59).
    "fast" fixes it at 32 MiB: reuse, but glibc's heaps fragment and grow step after step (12-25 MiB a step
    on a 19M-parameter Llama, issue 21)."""
    mode = malloc_mode(device)
    if mode == "off" or not sys.platform.startswith("linux"):
        return mode
    if mode == "pool":
        from ..store import host_pool

        if not host_pool.acquire():
            mode = "fast"
    libc = _glibc()
    if libc:
        libc.mallopt(-3, MMAP_THRESHOLD[mode])  # M_MMAP_THRESHOLD (fixing it also stops the dynamic creep)
    return mode


def untune_malloc(mode: str) -> None:
    """The runtime that tuned with `mode` closes: its hold on the host pool goes (glibc's setting stays)."""
    if mode == "pool":
        from ..store import host_pool

        host_pool.release()


def advise_huge_pages(t: torch.Tensor) -> None:
    """Ask for transparent huge pages over the 2 MiB-aligned interior of t's storage (a host buffer about to
    be written for the first time). Harmless where THP is off or the range is small; CUDA tensors: no-op."""
    if t.device.type != "cpu" or not sys.platform.startswith("linux"):
        return
    storage = t.untyped_storage()
    if storage.nbytes() < _HUGE:
        return  # (no aligned huge page inside)
    start = storage.data_ptr()
    lo = -(-start // _HUGE) * _HUGE
    hi = (start + storage.nbytes()) // _HUGE * _HUGE
    libc = _glibc()
    if libc and hi > lo:
        libc.madvise(lo, hi - lo, _MADV_HUGEPAGE)  # advice only: a refusal changes nothing but speed


def _status_bytes(field: str) -> int | None:
    """A size field of /proc/self/status ("VmRSS", "VmHWM"), in bytes; None where /proc is missing."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def peak_rss_bytes() -> int:
    """This process's peak resident set: VmHWM (per address space, so it does not inherit the parent's peak
    across fork+exec as ru_maxrss can), else ru_maxrss."""
    peak = _status_bytes("VmHWM")
    return peak if peak is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def rss_bytes() -> int:
    """This process's resident set now (VmRSS), 0 where /proc is missing."""
    return _status_bytes("VmRSS") or 0


def reset_peak_rss() -> bool:
    """Restart the peak resident set (VmHWM) at the current one (echo 5 > /proc/self/clear_refs), so a later
    peak_rss_bytes() covers only what follows. False where not allowed; the peak since exec then still bounds it."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False
