"""What the compute device's memory did, for the runtime's stats, the "auto" device budget's fit and the benches:

    peak_allocated(device)               # the most the compute device's allocator has held (nothing reset)
    free_at_peak(device)                 # what the device had free when its allocator held the most
    take_peak_allocated(device)          # the same since the last call, the window restarted (tests, benches)

On a CUDA device torch's allocator statistics; on the CPU the host pool's (store/host_pool.py), which is torch's CPU
allocator where it is installed: so this stands above the store, and device.py (streams and events, below the
store) knows nothing of the pool."""
from __future__ import annotations

import torch

from .store import host_pool
from .store.budget import host_memory


def peak_allocated(device: torch.device) -> int | None:
    """The most the compute device's allocator has handed out (the device tier's blocks, gathered units,
    activations, autograd's buffers), resetting nothing: the runtime reports it every step, and a user's own
    torch.cuda.reset_peak_memory_stats / max_memory_allocated measurement stays theirs. CUDA: max_memory_allocated
    (since the process started or the caller last reset it). CPU: the host pool's peak in use (tensors of 128 KiB
    and up, since it was installed or trimmed; None when the pool is not torch's CPU allocator; the device tier's
    own region is not in it there, it is reported as that tier's occupancy)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return host_pool.stats()["peak_in_use_bytes"] if host_pool.installed() else None


def free_at_peak(device: torch.device) -> int:
    """The bytes the compute device had free at its allocator's busiest (since the process started, or the
    caller last reset torch's peak statistics): what is free now less what the allocator held then and has
    given back since. CUDA: the driver's free memory (communicators and other processes counted) less
    max_memory_reserved - memory_reserved. CPU: the host memory available to this process (its cgroup's limit
    counted) less the host pool's peak in use over what it holds now (without the pool: available now)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return max(0, free - (torch.cuda.max_memory_reserved(device) - torch.cuda.memory_reserved(device)))
    available = host_memory()[1]
    pool = host_pool.stats() if host_pool.installed() else None
    return max(0, available - (pool["peak_in_use_bytes"] - pool["in_use_bytes"] if pool else 0))


def take_peak_allocated(device: torch.device) -> int | None:
    """Like peak_allocated, but over a window: the most handed out since the last call, the window restarted now.
    CUDA: this resets torch's peak statistics, so only a measurement that owns the process (a test, a bench)
    calls it, never the runtime. CPU: the host pool's own window (independent of its peak in use)."""
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        return peak
    return host_pool.take_window_peak() if host_pool.installed() else None
