"""Free-function collectives over the data-parallel group (torch.distributed; gloo on CPU, NCCL on GPU).

World size 1 needs no process group: every function degrades to a local copy.
"""
from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist


# torch >= 2.12 names them *_single (the *_tensor spellings warn); older releases only have *_tensor.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@dataclass
class Group:
    rank: int = 0
    world_size: int = 1
    pg: object | None = None  # None: the default group
    name: str = "main"  # which of the runtime's groups (the watchdog counts collectives per group)
    watchdog: object | None = None  # watchdog.Watchdog: every collective runs through it

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def sub_group(group: Group, name: str, timeout_s: float | None = None) -> Group:
    """A new process group over the same ranks, for one lane's collectives (every rank calls this in the
    same order). Each lane issuing on its own group keeps each group's calls in one thread's order."""
    if not group.distributed:
        return Group(group.rank, group.world_size, name=name)
    kwargs = {} if timeout_s is None else {"timeout": datetime.timedelta(seconds=timeout_s)}
    return Group(group.rank, group.world_size, dist.new_group(backend=dist.get_backend(), **kwargs), name,
                 group.watchdog)


def _guarded(group: Group, collective: str, what: str, fn):
    return fn() if group.watchdog is None else group.watchdog.run(group.name, collective, what, fn)


def all_gather_into(group: Group, out: torch.Tensor, shard: torch.Tensor, what: str = "") -> None:
    """out (world_size * shard.numel()) <- every rank's shard, in rank order."""
    if not group.distributed:
        out.copy_(shard)
        return
    _guarded(group, "all_gather", what, lambda: _all_gather(out, shard.contiguous(), group=group.pg))


def reduce_scatter_mean(group: Group, full: torch.Tensor, what: str = "") -> torch.Tensor:
    """This rank's shard of the element-wise mean of `full` over ranks. One rank: `full` itself (callers
    pass a gradient they own and only read the result)."""
    if not group.distributed:
        return full
    out = torch.empty(full.numel() // group.world_size, dtype=full.dtype, device=full.device)
    _guarded(group, "reduce_scatter", what,
             lambda: _reduce_scatter(out, full.contiguous(), op=dist.ReduceOp.SUM, group=group.pg))
    out.div_(group.world_size)
    return out


def all_reduce_(group: Group, t: torch.Tensor, op: str = "sum", what: str = "") -> torch.Tensor:
    if group.distributed:
        reduce_op = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}[op]
        _guarded(group, "all_reduce", what, lambda: dist.all_reduce(t, op=reduce_op, group=group.pg))
    return t


def broadcast_(group: Group, t: torch.Tensor, src: int = 0, what: str = "") -> torch.Tensor:
    if group.distributed:
        _guarded(group, "broadcast", what, lambda: dist.broadcast(t, src=src, group=group.pg))
    return t
