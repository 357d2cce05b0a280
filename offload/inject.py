"""Injected delays and allocation failures, for tests: a missing sync only shows when one queue is slow, a back-off
only when the memory runs out.

    with inject.delay(Queue.NVME_READ, 0.02):   # every nvme read completes 20 ms late
        train()

The same from the environment, for processes a test launches (torchrun workers):
    OFFLOAD_INJECT_DELAY="nvme_read=0.02,optimizer=0.01"
Each queue's worker calls `pause(queue)` where its work completes, never the training thread, so a delay
makes the queue slow without slowing the caller. Costs one dict lookup when nothing is injected.

    with inject.out_of_memory_at(Site.GATHER_AHEAD):   # every gather ahead finds the device full
        train()
or OFFLOAD_INJECT_OOM="gather_ahead". The allocation at that site raises torch.OutOfMemoryError, as a full GPU's.
"""
from __future__ import annotations

import contextlib
import enum
import time

from . import env
from .telemetry import Queue

__all__ = ["delay", "pause", "delayed", "delays", "Site", "out_of_memory_at", "allocation"]


class Site(enum.Enum):
    """Where an allocation may be made to fail."""
    __hash__ = object.__hash__  # members are singletons: hashed by identity, in C (Enum's hashes its name in Python)

    GATHER_AHEAD = "gather_ahead"  # a unit's gathered buffer, allocated before the unit is needed
    ACTIVATION_BACK = "activation_back"  # a saved activation's tensor, allocated to bring it back for the backward


def _from_env() -> dict[Queue, float]:
    spec = env.INJECT_DELAY.get()
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


def delayed(queue: Queue) -> bool:
    """Work on this queue is slowed now (a test's delay)."""
    return bool(_DELAYS) and bool(_DELAYS.get(queue))


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


def _sites_from_env() -> set[Site]:
    spec = env.INJECT_OOM.get()
    try:
        return {Site(name.strip()) for name in spec.split(",") if name.strip()}
    except ValueError:
        raise ValueError(f"OFFLOAD_INJECT_OOM: {spec!r}; give sites among {[s.value for s in Site]}") from None


_FULL: set[Site] = _sites_from_env()


def allocation(site: Site) -> None:
    """Called before an allocation at `site`: raises torch.OutOfMemoryError where one is injected."""
    if site in _FULL:
        import torch

        raise torch.OutOfMemoryError(f"offload.inject: out of memory injected at {site.value}")


@contextlib.contextmanager
def out_of_memory_at(site: Site):
    had = site in _FULL
    _FULL.add(site)
    try:
        yield
    finally:
        if not had:
            _FULL.discard(site)
