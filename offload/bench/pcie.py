"""`offload bench pcie`: host <-> device GB/s with torch's own CUDA copies (no custom kernel).

For each GPU alone: host->device and device->host, pinned and pageable host memory, sizes 4 KiB .. 1 GiB,
timed with CUDA events around `copy_(non_blocking=True)` (the median of `rounds`); and both directions at
once (two streams, pinned, the largest size). Then, with two or more GPUs, every GPU at once (pinned, the
largest size), one direction at a time. Without a CUDA device it says so and returns nothing to measure.

Every stream, event and tensor of a GPU's copies is created under `torch.cuda.device(gpu)` and its events
are recorded on the stream doing the copies: an event of another device cannot time them (and the current
device is per thread, 0 unless set). The all-GPU aggregate is every byte copied over the host's wall clock
of the whole window (threads released together by a barrier, the clock stopped once every device is idle),
not a sum of per-GPU rates: each of those is taken over that GPU's own copies, which overlap the others'
only in part, so their sum counts every GPU as if it had the host to itself.
"""
from __future__ import annotations

import statistics
import threading
import time

import torch

DEFAULT_SIZES = [4 << 10, 64 << 10, 1 << 20, 16 << 20, 256 << 20, 1 << 30]
WINDOW_TIMEOUT_S = 600.0  # a barrier wait past this is a stuck device or thread: raise, never hang


# ---- pure helpers (no CUDA: tested on the CPU) ---------------------------------------------------

def gbps(nbytes: int, seconds: float) -> float:
    if seconds <= 0:
        raise ValueError(f"pcie: {nbytes} bytes in {seconds} s: a time must be positive")
    return nbytes / seconds / 1e9


def window_figures(per_gpu: list[dict], wall_s: float) -> dict:
    """One all-GPU window from each GPU's {"gpu", "bytes", "event_s", "event_device"} and the host's wall
    time of the whole window: the aggregate is total bytes / wall time; each GPU's own rate (its bytes over
    its own events' span) is reported beside it, never summed into it."""
    return {"GBps": gbps(sum(g["bytes"] for g in per_gpu), wall_s), "wall_s": wall_s,
            "per_gpu": [{"gpu": g["gpu"], "GBps": gbps(g["bytes"], g["event_s"]), "bytes": g["bytes"],
                         "event_device": g["event_device"]} for g in per_gpu]}


def run_together(n: int, setup, work) -> tuple[float, list]:
    """Run `setup(i)` then `work(i, setup's result)` on n threads; (wall seconds, [work's results]).

    The window opens when the last thread has finished its setup (allocation, warm-up: outside it) and
    closes when the last has finished its work; both instants are taken by a barrier's action, which runs
    once every party has arrived and before any is released, so no thread's work falls outside the window.
    `work` must return only once what it measures is over (its device synchronized). A failure in any thread
    breaks the barriers (the others return instead of waiting for ever) and is raised here."""
    marks: list[float] = []
    start = threading.Barrier(n, action=lambda: marks.append(time.perf_counter()), timeout=WINDOW_TIMEOUT_S)
    end = threading.Barrier(n, action=lambda: marks.append(time.perf_counter()), timeout=WINDOW_TIMEOUT_S)
    results: list = [None] * n
    errors: list[BaseException] = []
    broken: list[int] = []

    def run(i: int) -> None:
        try:
            state = setup(i)
            start.wait()
            results[i] = work(i, state)
            end.wait()
        except threading.BrokenBarrierError:
            broken.append(i)  # another thread failed (its error is raised) or a wait timed out
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
            errors.append(exc)
            start.abort()
            end.abort()

    threads = [threading.Thread(target=run, args=(i,), name=f"pcie-{i}") for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    if broken:
        raise RuntimeError(f"pcie: threads {sorted(broken)} waited over {WINDOW_TIMEOUT_S:.0f} s for the others")
    return marks[1] - marks[0], results


# ---- CUDA ----------------------------------------------------------------------------------------

def _time_copy(dst: torch.Tensor, src: torch.Tensor, stream, rounds: int) -> tuple[float, int]:
    """(median seconds of one copy, device of its events). The caller holds `torch.cuda.device(gpu)` and
    `stream` is on that GPU: the events are created there and recorded on the stream that copies."""
    times, device = [], None
    with torch.cuda.stream(stream):
        dst.copy_(src, non_blocking=True)  # warm-up
        for _ in range(rounds):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(stream)
            dst.copy_(src, non_blocking=True)
            end.record(stream)
            end.synchronize()  # the figure needs this copy's end
            times.append(start.elapsed_time(end) / 1e3)
            device = end.device.index
    return statistics.median(times), device


def _one_gpu(device: int, size: int, pinned: bool, rounds: int) -> dict:
    with torch.cuda.device(device):
        host = torch.empty(size, dtype=torch.uint8, pin_memory=pinned)
        dev = torch.empty(size, dtype=torch.uint8, device=f"cuda:{device}")
        s = torch.cuda.Stream(device)
        (h2d, h2d_on), (d2h, d2h_on) = _time_copy(dev, host, s, rounds), _time_copy(host, dev, s, rounds)
    return {"h2d_GBps": gbps(size, h2d), "d2h_GBps": gbps(size, d2h), "event_devices": [h2d_on, d2h_on]}


def _both_directions(device: int, size: int, rounds: int) -> float:
    """Aggregate GB/s with a host->device and a device->host copy running at once (pinned). Both events are
    recorded on s1 (this GPU's), s2 starting after `start` and s1 ending after s2."""
    with torch.cuda.device(device):
        a, b = (torch.empty(size, dtype=torch.uint8, pin_memory=True) for _ in range(2))
        da, db = (torch.empty(size, dtype=torch.uint8, device=f"cuda:{device}") for _ in range(2))
        s1, s2 = torch.cuda.Stream(device), torch.cuda.Stream(device)
        times = []
        for _ in range(rounds + 1):  # the first is a warm-up
            torch.cuda.synchronize(device)  # each round starts on an idle GPU: nothing queued ahead of `start`
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(s1)
            s2.wait_event(start)
            with torch.cuda.stream(s1):
                da.copy_(a, non_blocking=True)
            with torch.cuda.stream(s2):
                b.copy_(db, non_blocking=True)
            s1.wait_stream(s2)
            end.record(s1)
            end.synchronize()  # both copies are over
            times.append(start.elapsed_time(end) / 1e3)
    return gbps(2 * size, statistics.median(times[1:]))


def all_gpus_window(n: int, size: int, rounds: int, h2d: bool) -> dict:
    """GPUs 0..n-1 each copying `rounds` x `size` bytes (pinned) in one direction, all at once: one thread
    per GPU, released together (run_together); window_figures' result."""

    def setup(gpu: int):
        torch.cuda.set_device(gpu)  # this thread's current device (per thread, 0 unless set)
        with torch.cuda.device(gpu):
            host = torch.empty(size, dtype=torch.uint8, pin_memory=True)
            dev = torch.empty(size, dtype=torch.uint8, device=f"cuda:{gpu}")
            s = torch.cuda.Stream(gpu)
            dst, src = (dev, host) if h2d else (host, dev)
            with torch.cuda.stream(s):
                dst.copy_(src, non_blocking=True)  # warm-up
            torch.cuda.synchronize(gpu)  # the warm-up stays out of the window
        return dst, src, s

    def work(gpu: int, state) -> dict:
        dst, src, s = state
        with torch.cuda.device(gpu), torch.cuda.stream(s):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(s)
            for _ in range(rounds):
                dst.copy_(src, non_blocking=True)
            end.record(s)
            torch.cuda.synchronize(gpu)  # idle before this thread reaches the barrier that stops the clock
        return {"gpu": gpu, "bytes": size * rounds, "event_s": start.elapsed_time(end) / 1e3,
                "event_device": end.device.index}

    wall_s, per_gpu = run_together(n, setup, work)
    return window_figures(per_gpu, wall_s)


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
    windows = None
    if n > 1:  # every GPU at once, pinned, one direction per window
        windows = (all_gpus_window(n, big, rounds, True), all_gpus_window(n, big, rounds, False))
    return summarize([torch.cuda.get_device_name(d) for d in range(n)], rows, both, windows, big, rounds)


def summarize(devices: list[str], rows: list[dict], both: dict, windows: tuple[dict, dict] | None, size: int,
              rounds: int) -> dict:
    """The result (JSON). Read elsewhere: "rows" and "all_gpus" by the CLI's table, "rows" by the plot,
    "h2d_pinned_gbps" by the planner (offload/plan/step_time.py): one GPU's link alone, at the largest size."""
    together = {}
    if windows is not None:
        h2d, d2h = windows
        together = {"bytes_per_copy": size, "rounds": rounds, "h2d_GBps": h2d["GBps"], "d2h_GBps": d2h["GBps"],
                    "h2d_wall_s": h2d["wall_s"], "d2h_wall_s": d2h["wall_s"],
                    "per_gpu": [{"gpu": a["gpu"], "h2d_GBps": a["GBps"], "d2h_GBps": b["GBps"],
                                 "event_devices": [a["event_device"], b["event_device"]]}
                                for a, b in zip(h2d["per_gpu"], d2h["per_gpu"])]}
    pinned_big = [r for r in rows if r["pinned"] and r["bytes"] == size]
    return {"available": True, "devices": devices, "rows": rows, "both_directions_GBps": both,
            "all_gpus": together,
            "h2d_pinned_gbps": max(r["h2d_GBps"] for r in pinned_big),
            "d2h_pinned_gbps": max(r["d2h_GBps"] for r in pinned_big)}
