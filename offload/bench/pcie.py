"""`offload bench pcie`: host <-> device GB/s with torch's own CUDA copies (no custom kernel).

For each GPU alone, then all GPUs at once: host->device and device->host, pinned and pageable host
memory, sizes 4 KiB .. 1 GiB; and both directions at once (two streams). Timed with CUDA events around
`copy_(non_blocking=True)`; the figure is the median of `rounds`. Without a CUDA device it says so and
returns nothing to measure.
"""
from __future__ import annotations

import statistics
import threading

import torch

DEFAULT_SIZES = [4 << 10, 64 << 10, 1 << 20, 16 << 20, 256 << 20, 1 << 30]


def _time_copy(dst: torch.Tensor, src: torch.Tensor, stream, rounds: int) -> float:
    times = []
    with torch.cuda.stream(stream):
        dst.copy_(src, non_blocking=True)  # warm-up
        for _ in range(rounds):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(stream)
            dst.copy_(src, non_blocking=True)
            end.record(stream)
            end.synchronize()  # the figure needs this copy's end
            times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def _one_gpu(device: int, size: int, pinned: bool, rounds: int) -> dict:
    host = torch.empty(size, dtype=torch.uint8, pin_memory=pinned)
    dev = torch.empty(size, dtype=torch.uint8, device=f"cuda:{device}")
    s = torch.cuda.Stream(device)
    h2d = _time_copy(dev, host, s, rounds)
    d2h = _time_copy(host, dev, s, rounds)
    return {"h2d_GBps": size / h2d / 1e9, "d2h_GBps": size / d2h / 1e9}


def _both_directions(device: int, size: int, rounds: int) -> float:
    """Aggregate GB/s with a host->device and a device->host copy running at once (pinned)."""
    a, b = (torch.empty(size, dtype=torch.uint8, pin_memory=True) for _ in range(2))
    da, db = (torch.empty(size, dtype=torch.uint8, device=f"cuda:{device}") for _ in range(2))
    s1, s2 = torch.cuda.Stream(device), torch.cuda.Stream(device)
    times = []
    for _ in range(rounds + 1):
        torch.cuda.synchronize(device)
        start = torch.cuda.Event(enable_timing=True)
        start.record()
        s1.wait_event(start)
        s2.wait_event(start)
        with torch.cuda.stream(s1):
            da.copy_(a, non_blocking=True)
        with torch.cuda.stream(s2):
            b.copy_(db, non_blocking=True)
        end = torch.cuda.Event(enable_timing=True)
        torch.cuda.current_stream(device).wait_stream(s1)
        torch.cuda.current_stream(device).wait_stream(s2)
        end.record()
        end.synchronize()  # both copies are over
        times.append(start.elapsed_time(end) / 1e3)
    return 2 * size / statistics.median(times[1:]) / 1e9


def pcie_bench(sizes: list[int] | None = None, rounds: int = 5, progress=None) -> dict:
    if not torch.cuda.is_available():
        return {"available": False, "reason": "no CUDA device"}
    sizes = sizes or DEFAULT_SIZES
    n = torch.cuda.device_count()
    rows = []
    for dev in range(n):
        for pinned in (True, False):
            for size in sizes:
                rows.append({"gpu": dev, "pinned": pinned, "bytes": size, **_one_gpu(dev, size, pinned, rounds)})
                if progress:
                    progress()
    big = max(sizes)
    both = {dev: _both_directions(dev, big, rounds) for dev in range(n)}
    together = {}
    if n > 1:  # every GPU at once, host->device pinned
        results = {}

        def run(dev):
            results[dev] = _one_gpu(dev, big, True, rounds)

        threads = [threading.Thread(target=run, args=(d,)) for d in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        together = {"h2d_GBps_sum": sum(r["h2d_GBps"] for r in results.values()),
                    "d2h_GBps_sum": sum(r["d2h_GBps"] for r in results.values())}
    pinned_big = [r for r in rows if r["pinned"] and r["bytes"] == big]
    return {"available": True, "devices": [torch.cuda.get_device_name(d) for d in range(n)], "rows": rows,
            "both_directions_GBps": both, "all_gpus": together,
            "h2d_pinned_gbps": max(r["h2d_GBps"] for r in pinned_big),
            "d2h_pinned_gbps": max(r["d2h_GBps"] for r in pinned_big)}
