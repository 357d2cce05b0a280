"""Collectives of Python objects and a barrier, in the runtime's one order (issue 44): the checkpoint's statuses
and errors, each rank's differing in size.

They go through comm.py's inline path on the main group, as the training thread's flags do: a ticket as they are
issued, after every lane collective asked for before them (comm.ProgramOrder; a gather ahead still being enqueued
on another communicator would else be reordered against them on one rank only), watched by the watchdog (a
stalled rank is named), and recorded where a test records (tests/rank_sequences.py).

An object gather is recorded as (main, all_gather_object, 0, uint8): its size is each rank's pickle, different
by design, so the record says only that one was issued, in its place.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from . import comm

_ANY_SIZE = torch.empty(0, dtype=torch.uint8)  # what an object gather is recorded as sending


def all_gather_object(group: comm.Group, obj, what: str) -> list:
    """Every rank's `obj` (picklable), in rank order; [obj] where nothing is distributed."""
    if not group.distributed:
        return [obj]
    out = [None] * group.world_size
    comm._issue(group, None, "all_gather_object", what,
                lambda: dist.all_gather_object(out, obj, group=group.pg), sent=_ANY_SIZE)
    return out


def barrier(group: comm.Group, what: str) -> None:
    """Return once every rank came here: a one-element all-reduce whose result the host waits for (NCCL's own
    barrier guesses a device from the rank where it is not told one)."""
    if group.distributed:
        comm.all_reduce_host_(group, torch.zeros(1), "sum", what=what)
