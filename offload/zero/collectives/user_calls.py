"""A collective the user or a library issues while a runtime of several ranks is open takes its place in the
runtime's one order (issue 44).

The lanes enqueue the gathers and reduces the training thread asked for, later, on communicators of their own.
A user's `dist.all_reduce(loss)` (Accelerate's gather, generate()'s synced_gpus flag) issued right after asking
for a gather ahead could then be enqueued before that gather on one rank and after it on another: NCCL runs
[gather j, all_reduce] on one rank and [all_reduce, gather j] on the other, which hangs wherever the two kernels
cannot run side by side (CUDA_DEVICE_MAX_CONNECTIONS=1, a device whose SMs the kernels fill). So while such a
runtime is open, torch.distributed's collectives (the module attributes: `dist.all_reduce(...)`, looked up at
the call) are wrapped: a call from outside the runtime's own issuing first takes the main group's inline turn
(comm.ProgramOrder.turn), as the runtime's own flags do: it waits until every lane collective asked for before
it is enqueued, and holds the order until it is enqueued itself. The same call then sits in the same place on
every rank. It is recorded where a test records (op "user:<name>"), and counted in the order hash the ranks
compare at each pass end and step, so a rank that issues one the others do not is named there.

Not caught: a function imported before the runtime opened (`from torch.distributed import all_reduce`) and
calls through torch.distributed.distributed_c10d directly. Installed by Runtime.open where collectives are
issued, removed at close (counted over runtimes; the originals come back when the last closes).
"""
from __future__ import annotations

import functools

import torch
import torch.distributed as dist

from . import comm

NAMES = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single", "reduce_scatter",
         "reduce_scatter_tensor", "reduce_scatter_single", "broadcast", "reduce", "barrier", "monitored_barrier",
         "all_to_all", "all_to_all_single", "gather", "scatter", "all_gather_object", "broadcast_object_list",
         "gather_object", "scatter_object_list")
_ORIGINALS: dict = {}
_LIVE: list["UserCollectivesInOrder"] = []  # one per open runtime (the latest opened orders the calls)
_ANY_SIZE = torch.empty(0, dtype=torch.uint8)  # recorded for a call without a tensor (an object, a barrier)


def _sent(args, kwargs) -> torch.Tensor:
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor):
            return a
    return _ANY_SIZE


def _ordered(name: str, original):
    @functools.wraps(original)
    def call(*args, **kwargs):
        group = _LIVE[-1].group if _LIVE else None
        if group is None or group.order is None or comm.in_turn():
            return original(*args, **kwargs)  # the runtime's own (already in its turn), or no runtime
        what = f"torch.distributed.{name} (called by the program)"
        with group.order.turn(None, group.name, what, inline=True):
            comm.record_issued(group, f"user:{name}", _sent(args, kwargs), what)
            return original(*args, **kwargs)

    call._offload_original = original
    return call


class UserCollectivesInOrder:
    """The module docstring's wrapping, for one open runtime's main group (`remove()` at its close)."""

    def __init__(self, group: comm.Group):
        if not _LIVE:
            for name in NAMES:
                original = getattr(dist, name, None)
                if original is not None:
                    _ORIGINALS[name] = original
                    setattr(dist, name, _ordered(name, original))
        self.group = group
        _LIVE.append(self)

    def remove(self) -> None:
        if self not in _LIVE:
            return
        _LIVE.remove(self)
        if not _LIVE:
            for name, original in _ORIGINALS.items():
                if getattr(getattr(dist, name, None), "_offload_original", None) is original:
                    setattr(dist, name, original)
            _ORIGINALS.clear()
