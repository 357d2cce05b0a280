"""Injected delays, for tests: a missing sync only shows when one queue is slow.

    with inject.delay(Queue.NVME_READ, 0.02):   # every nvme read completes 20 ms late
        train()

The same from the environment, for processes a test launches (torchrun workers):
    OFFLOAD_INJECT_DELAY="nvme_read=0.02,optimizer=0.01"
Each queue's worker calls `pause(queue)` where its work completes, never the training thread, so a delay
makes the queue slow without slowing the caller. Costs one dict lookup when nothing is injected.
"""
from __future__ import annotations

import contextlib
import os
import time

from .telemetry import Queue

__all__ = ["delay", "pause", "delays"]


def _from_env() -> dict[Queue, float]:
    spec = os.environ.get("OFFLOAD_INJECT_DELAY", "").strip()
    out: dict[Queue, float] = {}
    for item in filter(None, (s.strip() for s in spec.split(","))):
        name, _, seconds = item.partition("=")
        try:
            out[Queue(name.strip())] = float(seconds)
        except ValueError:
            raise ValueError(f"OFFLOAD_INJECT_DELAY: {item!r} is not QUEUE=SECONDS with QUEUE one of "
                             f"{[q.value for q in Queue]}") from None
    return out


_DELAYS: dict[Queue, float] = _from_env()


def delays() -> dict[Queue, float]:
    return dict(_DELAYS)


def pause(queue: Queue) -> None:
    seconds = _DELAYS.get(queue)
    if seconds:
        time.sleep(seconds)


@contextlib.contextmanager
def delay(queue: Queue, seconds: float):
    previous = _DELAYS.get(queue)
    _DELAYS[queue] = float(seconds)
    try:
        yield
    finally:
        if previous is None:
            _DELAYS.pop(queue, None)
        else:
            _DELAYS[queue] = previous
