"""Lanes: the runtime's background queues, each one thread running its work in the order it was given.

    gather        a unit's all-gather: wait for its pending update, read its param chunks, gather
    reduce        a unit's reduce-scatter: launched, not waited for (several ranks; one rank launches nothing)
    reduce drain  each launched reduce's host work: the wait for its sum, the accumulation into the gradient
                  chunks, their norms (every write to a gradient shard goes through here, in order). Apart from
                  the reduce lane, so one reduce's host work never holds the next collective's launch (the next
                  reduce's, and through the tickets every later gather's): [Note: program order]
    optimizer     the optimizer pipeline (read ahead, fused AdamW, write-behind), unit after unit

One thread per lane keeps each lane's work in program order: collectives on a lane are issued in the same
order on every rank (each lane has its own process group, and comm.ProgramOrder keeps the two lanes'
collectives in one order across both). On a GPU each lane's work runs on the lane's own stream (device.py),
and its thread binds the compute device before its first work.
With Config.pipeline=False a lane runs each piece of work in the caller, at once: the synchronous
reference that the pipelined runtime must match bit for bit. Pipelined, small work may also run in the caller when
its lane is idle (submit_small: one rank's small gathers and drains over states in memory).
Lanes holds the four; LaneContext is what the schedule and the optimizer pipeline work with (the store, the
lanes, the meter), built before the units' context (context.py), which holds the schedule.
"""
from __future__ import annotations

import concurrent.futures as cf
import contextlib
import threading
from dataclasses import dataclass
from typing import Callable

import torch

from .. import inject
from ..device import Streams, thread_initializer
from .collectives import comm
from ..telemetry import Lane, Meter, Queue
from .state_store import UnitStateStore


_NO_STREAM = contextlib.nullcontext()

# Work on at most this many bytes may run in the caller instead of on an idle lane (WorkLane.submit_small): a lane
# hop (the pool's queue, a thread woken, the GIL handed over and back) costs 30 us of CPU on an idle EPYC core, a
# copy of 256 KiB 12 us (of 1 MiB 30 us): below this the hop costs more than the work it would overlap.
SMALL_WORK_BYTES = 256 << 10


# See [Note: pipelined equals synchronous] in docs/zero-runtime.md
class WorkLane:
    def __init__(self, lane: Lane, queue: Queue, meter: Meter, threaded: bool, pause_each: bool = True,
                 streams: Streams | None = None, slowed_by: Queue | None = None):
        self.lane = lane
        self.streams = streams or Streams(torch.device("cpu"))
        self._stream_of_its_own = self.streams.device.type == "cuda"  # (on the CPU every stream is None)
        self.queue = queue  # what the training thread waits on when it waits for this lane's work
        self.meter = meter
        self.pause_each = pause_each  # injected delay (tests) per piece of work; False: the work pauses itself
        self.slowed_by = slowed_by or queue  # whose injected delay pauses each piece of work
        self._pool = cf.ThreadPoolExecutor(1, thread_name_prefix=f"offload-{lane.value}",
                                           initializer=thread_initializer(self.streams.device)) if threaded else None
        self._last: cf.Future | None = None
        self._failure: BaseException | None = None  # the first work that raised (reported by drain)
        self._lock = threading.Lock()

    @property
    def threaded(self) -> bool:
        return self._pool is not None

    # See [Note: program order] in docs/zero-runtime.md
    def submit(self, name: str, fn: Callable, *args) -> cf.Future:
        """Run fn(*args) after everything submitted before; a future of its result."""
        run = self._work(name, fn, args)
        fut = self._run_here(run) if self._pool is None else self._pool.submit(run)
        with self._lock:
            self._last = fut
        return fut

    def submit_small(self, name: str, fn: Callable, *args) -> cf.Future:
        """submit(), or fn run in the caller at once (its future resolved) when this lane is idle: every piece of
        work submitted before is over, so program order holds. For small work with nothing to overlap (the
        caller checks that it reads resident bytes, waits on nothing unfinished and launches no collective): a
        lane hop costs more than the work (see SMALL_WORK_BYTES). Not while a test slows this lane (inject)."""
        last = self._last
        if self._pool is None or (last is not None and not last.done()) or inject.delayed(self.slowed_by):
            return self.submit(name, fn, *args)
        fut = self._run_here(self._work(name, fn, args))
        with self._lock:
            self._last = fut
        return fut

    def _work(self, name: str, fn: Callable, args: tuple) -> Callable:
        def run():
            if self.pause_each:
                inject.pause(self.slowed_by)  # a slow lane (tests): the work starts late
            try:
                stream = self.streams.use(self.lane) if self._stream_of_its_own else _NO_STREAM
                with self.meter.working(self.lane, name), stream, comm.lane_work(self.lane.value):
                    return fn(*args)
            except BaseException as e:
                with self._lock:
                    self._failure = self._failure or e
                raise

        return run

    @staticmethod
    def _run_here(run: Callable) -> cf.Future:
        fut: cf.Future = cf.Future()
        try:
            fut.set_result(run())
        except BaseException as e:  # noqa: BLE001 - delivered through the future, as on a thread
            fut.set_exception(e)
        return fut

    def drain(self) -> None:
        """Wait until everything submitted so far has run; raises the first failure among the last."""
        with self._lock:
            last = self._last
        if last is not None and not last.done():
            with self.meter.waiting(self.queue):
                cf.wait([last])  # FIFO: the last one done means all are
        with self._lock:
            failure, self._failure = self._failure, None
        if failure is not None:
            raise failure

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)  # running work finishes; buffers it holds are freed by it
            self._pool = None


def wait(fut: cf.Future | None, meter: Meter, queue: Queue):
    """The training thread needs `fut`'s result now: wait, charging the time to `queue`."""
    if fut is None:
        return None
    if not fut.done():
        with meter.waiting(queue):
            return fut.result()
    return fut.result()


@dataclass
class Lanes:
    gather: WorkLane
    reduce: WorkLane
    reduce_drain: WorkLane
    optimizer: WorkLane

    @classmethod
    def create(cls, meter: Meter, threaded: bool, streams: Streams) -> "Lanes":
        return cls(WorkLane(Lane.GATHER, Queue.GATHER, meter, threaded, streams=streams),
                   WorkLane(Lane.REDUCE, Queue.REDUCE, meter, threaded, streams=streams),
                   WorkLane(Lane.REDUCE_DRAIN, Queue.REDUCE, meter, threaded, streams=streams,
                            slowed_by=Queue.REDUCE_DRAIN),
                   WorkLane(Lane.OPTIMIZER, Queue.OPTIMIZER, meter, threaded, pause_each=False, streams=streams))

    def all(self) -> list[WorkLane]:
        """In dependency order (a drain waits for its launch): drained one after the other, nothing is left."""
        return [self.gather, self.reduce, self.reduce_drain, self.optimizer]


@dataclass(frozen=True)
class LaneContext:
    """What the schedule and the optimizer pipeline work with: the shards' store, the lanes, the meter (built
    before the units' context, which holds the schedule)."""

    states: UnitStateStore
    lanes: Lanes
    meter: Meter
    compute_dtype: torch.dtype
