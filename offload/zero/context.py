"""What a unit needs from the runtime, and nothing more (units never see the Runtime)."""
from __future__ import annotations

import collections
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

import torch

from ..device import Streams
from ..telemetry import Meter
from .collectives import comm
from .lanes import Lanes
from .state_store import UnitStateStore

if TYPE_CHECKING:
    from .schedule import Schedule


@dataclass
class Counters:
    """Collective traffic and gathered bytes, for rt.stats()."""

    allgather_bytes: int = 0
    reduce_scatter_bytes: int = 0
    # this rank's shard bytes copied on their way into the gathered buffers, as NCCL would copy them: the gather
    # lane's copies, and the collective's own of a shard not sent from its place (units/unit.py, gather in place)
    gather_copy_bytes: int = 0
    gathered_bytes: int = 0
    peak_gathered_bytes: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, name: str, nbytes: int) -> None:
        with self._lock:
            setattr(self, name, getattr(self, name) + nbytes)

    def gathered(self, delta: int) -> None:
        with self._lock:
            self.gathered_bytes += delta
            self.peak_gathered_bytes = max(self.peak_gathered_bytes, self.gathered_bytes)


@dataclass
class UnitContext:
    device: torch.device
    compute_dtype: torch.dtype
    main_group: comm.Group  # collectives of the training thread (clip norm, flags, state dicts)
    gather_group: comm.Group  # the gather lane's all-gathers
    reduce_group: comm.Group  # the reduce lane's reduce-scatters
    states: UnitStateStore
    lanes: Lanes
    meter: Meter
    counters: Counters
    schedule: "Schedule"  # prefetched leases, and the uses it traces
    streams: Streams  # each lane's stream on a GPU (device.py)
    reduce_dtype: torch.dtype = torch.float32  # Config.reduce_dtype: what ranks sum gradients in
    sync_grads: bool = True  # False inside rt.no_sync(): backward accumulates locally
    max_reduces_in_flight: int = 2  # full gradients held by the reduce lanes at once (bounded memory)
    reduce_window: collections.deque = field(default_factory=collections.deque)  # their futures, oldest first
    on_reduce: Callable | None = None  # (unit) -> None after a unit's reduce is queued (Config.update_in_backward)
    take_grad_norms: bool = True  # a reduce's drain takes its pieces' norms (the last step asked for a norm)

    @property
    def rank(self) -> int:
        return self.main_group.rank

    @property
    def world_size(self) -> int:
        return self.main_group.world_size

    @property
    def distributed(self) -> bool:
        """Collectives are issued (several ranks, or one under Config.collectives_at_world_size_1); else local."""
        return self.main_group.distributed
