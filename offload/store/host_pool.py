"""The host pool: torch's CPU allocator while a runtime computes on the CPU (csrc/memory/host_pool.cpp).

    acquire(headroom)   the first holder installs it (requests of MIN_BYTES and up; it maps at most `headroom`
                        bytes beyond its peak in use); False where it could not be (no extension, another
                        allocator in place)
    release()           the last holder gives torch its previous allocator back and the cache to the OS
    stats()             in use, cached, their peaks, hits and misses
    trim()              the cache back to the OS now, the peak in use restarted (after loading a model, say)
    take_window_peak()  the most in use since the last call (a step's peak, what a GPU's max_memory_allocated
                        would say of the same tensors), restarted from what is in use now

Why a pool: a step frees and re-allocates the same transients every step (activations, autograd's gradients,
gathered units, reduce outputs). glibc either maps each one fresh and faults its pages in again every step, or
keeps freed ones in heaps that fragment and grow step after step. The pool keeps blocks of 8 size classes per
power of two and reuses a freed one for the next request of its class; what it maps (in use + cached) never
exceeds its peak in use plus the headroom (huge-page blocks, the cheapest to map again, go back to the OS first,
oldest first). Resident memory is
then the step's own peak plus at most the headroom, flat from step to step, and a repeating step maps nothing
new. It is process-wide: every CPU tensor of MIN_BYTES or more comes from it while installed; a tensor
allocated then and freed later goes back to it (or to the OS once uninstalled).
"""
from __future__ import annotations

import threading

from .. import _ext, env
from .sizes import parse_size

MIN_BYTES = 128 << 10  # smaller requests stay with glibc (its frugal mmap threshold: no fragmentation above it)
DEFAULT_HEADROOM = "128MiB"  # what the pool may map beyond its peak in use; OFFLOAD_HOST_POOL_HEADROOM overrides

_lock = threading.Lock()
_holders = 0


def headroom_bytes() -> int:
    """OFFLOAD_HOST_POOL_HEADROOM ("128MiB" by default): more keeps more freed blocks for reuse (fewer fresh
    mappings, whose pages fault in again), less keeps resident memory nearer the step's own peak."""
    value = env.HOST_POOL_HEADROOM.get() or DEFAULT_HEADROOM
    try:
        return parse_size(value)
    except ValueError as e:
        raise ValueError(f"OFFLOAD_HOST_POOL_HEADROOM={value!r}: {e}; give a size such as '128MiB'") from None


def acquire(headroom: int | None = None) -> bool:
    """Hold the pool (install it if nobody does; headroom: headroom_bytes() if None); True while it is torch's
    CPU allocator."""
    global _holders
    headroom = headroom_bytes() if headroom is None else headroom
    mod = _ext.get()
    if mod is None:
        return False
    with _lock:
        if _holders == 0 and not mod.host_pool_install(MIN_BYTES, headroom):
            return False  # an allocator of higher priority is in place (it stays)
        _holders += 1
        return True


def release() -> None:
    """Let go of a hold from acquire(); the last one uninstalls it."""
    global _holders
    mod = _ext.get()
    with _lock:
        if _holders == 0 or mod is None:
            return
        _holders -= 1
        if _holders == 0:
            mod.host_pool_uninstall()


def installed() -> bool:
    mod = _ext.get()
    return bool(mod is not None and mod.host_pool_installed())


def stats() -> dict | None:
    mod = _ext.get()
    return dict(mod.host_pool_stats()) if mod is not None else None


def trim() -> int:
    """Unmap every cached block now and restart the peak in use from what is in use; the bytes given back."""
    mod = _ext.get()
    return mod.host_pool_trim() if mod is not None else 0


def take_window_peak() -> int | None:
    """The bytes in use at the pool's busiest since the last call (None without the extension); the window
    restarts from what is in use now. Independent of stats()' peak, which sizes the cache."""
    mod = _ext.get()
    return mod.host_pool_take_window_peak() if mod is not None else None


def size_class(nbytes: int) -> int:
    """The block size a request of nbytes takes (at most 1/8 more; requests under MIN_BYTES are not pooled)."""
    return _ext.require().host_pool_size_class(nbytes)
