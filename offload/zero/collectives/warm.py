"""The communicators' memory, taken before the device budget is measured (issue 44).

NCCL allocates a communicator's buffers outside torch's caching allocator, at its first collective. Left to the
first step, that lands after the "auto" device budget took its share of the free memory: an out-of-memory error
at step 1 on a full device. So Runtime.open() runs one tiny all-reduce on each of its groups first, and then
measures; rt.stats()["communicators_device_bytes"] is what the warm-up took (the device's free memory before
minus after; 0 on the CPU and gloo, whose buffers are host memory the RSS at open already counts), and
["communicators_device_bytes_by_group"] each communicator's part (measured around its own warm-up).

Issued on the training thread before any lane exists, the same on every rank: outside the lanes' program order
(nothing else can run yet), in the groups' creation order.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from . import comm


def warm_up(groups: list[comm.Group], device: torch.device) -> dict[str, int]:
    """One all-reduce of one element on each distributed group; the device bytes each took, by group name (CUDA;
    0 elsewhere). Empty where no group is distributed."""
    groups = [g for g in groups if g.distributed]
    tensors = [torch.zeros(1, device=device) for _ in groups]  # (the allocator's block is not the communicators')
    cuda = device.type == "cuda"
    taken = {}
    for g, t in zip(groups, tensors):
        if cuda:
            torch.cuda.synchronize(device)
            free_before = torch.cuda.mem_get_info(device)[0]
        comm.record_issued(g, "all_reduce", t, "warm-up")
        comm._guarded(g, "all_reduce", "warm-up", lambda: dist.all_reduce(t, group=g.pg))  # (watched: counted)
        if cuda:
            torch.cuda.synchronize(device)
        taken[g.name] = max(0, free_before - torch.cuda.mem_get_info(device)[0]) if cuda else 0
    return taken
