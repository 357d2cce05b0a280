"""Telemetry: a profiler label on every phase, where the training thread's time went, and a Chrome trace.

    meter = Meter()
    with meter.waiting(Queue.GATHER):           # the training thread blocks on a queue: charged to it
        handle.wait()
    with span("adamw:layers.0", Lane.OPTIMIZER):  # torch.profiler label + a trace event on that lane
        kernel(...)
    meter.busy(Lane.OPTIMIZER, seconds)          # background work done on a lane
    snap = meter.snapshot()                      # cumulative seconds per queue / lane; diff two for a step

    start_trace(); ...; save_trace("step.json")  # Chrome / Perfetto trace of every span since start_trace

Knows nothing about modules, shards or files: the store, the runtime and the optimizer call it.
"""
from __future__ import annotations

import contextlib
import enum
import json
import os
import threading
import time
from dataclasses import dataclass, field

import torch

__all__ = ["Queue", "Lane", "Meter", "MeterSnapshot", "span", "start_trace", "stop_trace", "save_trace",
           "tracing", "recording"]


class Queue(enum.Enum):
    """What the training thread can wait for. Its wall time is compute plus these waits."""
    __hash__ = object.__hash__  # members are singletons: hashed by identity, in C (Enum's hashes its name in Python)

    NVME_READ = "nvme_read"  # a shard's bytes coming in from its swap file
    NVME_WRITE = "nvme_write"  # a write-behind that must land before its buffer is reused
    COPY = "copy"  # host <-> device copies
    GATHER = "gather"  # a unit's all-gather (includes the read of its shard)
    REDUCE = "reduce"  # gradient reduce-scatters and their accumulation into the grad shards
    # injected delays only (tests): a reduce's drain (the wait for its sum, its copy into the gradient chunks, their
    # norms) slowed apart from its launch; the training thread's waits for gradients count as REDUCE
    REDUCE_DRAIN = "reduce_drain"
    OPTIMIZER = "optimizer"  # a unit's pending update (the next gather of a unit waits for its own)
    COLLECTIVE = "collective"  # collectives run on the training thread (clip norm, flags)
    SPACE = "space"  # budget space: a buffer could not be had until a release freed it
    CHECKPOINT = "checkpoint"  # writing or reading a checkpoint (rt.save_checkpoint / load_checkpoint)
    ACTIVATION = "activation"  # an offloaded activation coming back for the backward (Config.activations)


class Lane(enum.Enum):
    """Threads that do work for the training thread (one trace row each)."""
    __hash__ = object.__hash__  # members are singletons: hashed by identity, in C (Enum's hashes its name in Python)

    MAIN = "main"  # the training thread: compute, and in synchronous mode every move
    GATHER = "gather"
    REDUCE = "reduce"  # the reduce-scatters' launches
    REDUCE_DRAIN = "reduce drain"  # each reduce's host work after its launch: wait, copy into the gradient chunks
    OPTIMIZER = "optimizer"
    NVME_READ = "nvme read"
    NVME_WRITE = "nvme write"
    COPY = "copy"
    ACTIVATIONS = "activations"  # offloaded activations' copies out and back


@dataclass
class MeterSnapshot:
    wait_s: dict = field(default_factory=dict)  # Queue -> seconds the training thread waited on it
    busy_s: dict = field(default_factory=dict)  # Lane -> seconds of work done on it
    at: float = 0.0  # time.perf_counter() of the snapshot

    def minus(self, earlier: "MeterSnapshot") -> "MeterSnapshot":
        return MeterSnapshot({q: v - earlier.wait_s.get(q, 0.0) for q, v in self.wait_s.items()},
                             {l: v - earlier.busy_s.get(l, 0.0) for l, v in self.busy_s.items()},
                             self.at - earlier.at)


class Meter:
    """Cumulative wait time per Queue (training thread) and busy time per Lane (any thread)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._wait = {q: 0.0 for q in Queue}
        self._wait_total = 0.0  # their sum, kept as they grow: the schedule reads it at every unit's use
        self._busy = {l: 0.0 for l in Lane}
        self._working = threading.local()  # the lanes this thread is counting busy time for now

    @contextlib.contextmanager
    def waiting(self, queue: Queue):
        t0 = time.perf_counter()
        with span(f"wait:{queue.value}", Lane.MAIN):
            try:
                yield
            finally:
                dt = time.perf_counter() - t0
                with self._lock:
                    self._wait[queue] += dt
                    self._wait_total += dt

    def total_wait(self) -> float:
        """Seconds the training thread has waited on every queue, all told (a snapshot's sum, without one)."""
        return self._wait_total  # (one float, written under the lock: read whole)

    def busy(self, lane: Lane, seconds: float) -> None:
        with self._lock:
            self._busy[lane] += seconds

    @contextlib.contextmanager
    def working(self, lane: Lane, name: str):
        """Work on `lane`: a span, and its duration counted as the lane's busy time. Work nested in work of the
        same lane on the same thread (a lane item's kernel) is a span only: its time is already counted."""
        active = self._working.__dict__.setdefault("lanes", set())
        outer = lane not in active
        t0 = time.perf_counter()
        active.add(lane)
        try:
            if recording():
                with span(name, lane):
                    yield
            else:  # (no span's context to open and close: a few pieces of work a unit a step)
                yield
        finally:
            if outer:
                active.discard(lane)
                self.busy(lane, time.perf_counter() - t0)

    def snapshot(self) -> MeterSnapshot:
        with self._lock:
            return MeterSnapshot(dict(self._wait), dict(self._busy), time.perf_counter())


_profiler_enabled = torch.autograd._profiler_enabled  # this thread's: what record_function would record into


def recording() -> bool:
    """A span records now (torch's profiler on this thread, or a trace): a caller formats a span's name only
    then."""
    return _TRACE is not None or _profiler_enabled()


# ---- Chrome trace ----------------------------------------------------------------------------

class _Trace:
    def __init__(self):
        self.lock = threading.Lock()
        self.events: list[dict] = []
        self.t0 = time.perf_counter()


_TRACE: _Trace | None = None


def tracing() -> bool:
    return _TRACE is not None


def start_trace() -> None:
    """Record every span from now on (until stop_trace / save_trace)."""
    global _TRACE
    _TRACE = _Trace()


def stop_trace() -> list[dict]:
    """Stop recording; the Chrome trace events recorded so far."""
    global _TRACE
    trace, _TRACE = _TRACE, None
    return [] if trace is None else trace.events


def save_trace(path: str | os.PathLike) -> int:
    """Stop recording and write a Chrome trace (chrome://tracing, ui.perfetto.dev): one row per lane.
    Returns the number of events written."""
    events = stop_trace()
    lanes = sorted({e["tid"] for e in events})
    meta = [{"name": "thread_name", "ph": "M", "pid": 0, "tid": tid, "args": {"name": tid}} for tid in lanes]
    with open(path, "w") as f:
        json.dump({"traceEvents": meta + events, "displayTimeUnit": "ms"}, f)
    return len(events)


def _record(name: str, lane: Lane, t0: float, t1: float, args: dict | None) -> None:
    trace = _TRACE
    if trace is None:
        return
    event = {"name": name, "ph": "X", "pid": 0, "tid": lane.value, "ts": (t0 - trace.t0) * 1e6,
             "dur": (t1 - t0) * 1e6}
    if args:
        event["args"] = args
    with trace.lock:
        trace.events.append(event)


@contextlib.contextmanager
def span(name: str, lane: Lane = Lane.MAIN, args: dict | None = None):
    """A profiler label (torch.profiler.record_function, visible in torch's profiler) and, while a trace
    is being recorded, a complete event on `lane`'s row. Neither on: nothing (a label costs about 6 us of CPU
    whether a profiler records it or not, and the runtime opens several a unit a step)."""
    if not recording():
        yield
        return
    t0 = time.perf_counter()
    with torch.profiler.record_function(f"offload::{name}"):
        try:
            yield
        finally:
            if _TRACE is not None:
                _record(name, lane, t0, time.perf_counter(), args)


def record(name: str, lane: Lane, t0: float, t1: float, args: dict | None = None) -> None:
    """A trace event for work whose start and end were timed elsewhere (an I/O that ran in the kernel)."""
    if _TRACE is not None:
        _record(name, lane, t0, t1, args)
