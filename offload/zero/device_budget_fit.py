"""An "auto" device budget fitted after the first step to what that step left free on the device.

"auto" takes a fraction of the device's free memory when the runtime opens, before the model's activations,
autograd's buffers and the communicators exist. The first step is the traced one: once it is over the device
has held its activation peak and every communicator. The device tier may then hold what it holds plus a
fraction of what was free at that peak (store/budget.py fit_auto_device_budget), never less than its own
working set in that step, the smallest over ranks (every rank plans with the same numbers). Gathered units are
torch's allocations, outside the tier: if the first step held fewer gathered bytes at once than the runtime's
bound allows later steps (gathering ahead follows the plan the first step's trace makes), the difference is taken
off the free bytes first (in the runs measured so far the first step already reached the bound). Lowering the
limit only makes later requests wait or back off (a prefetch does): no block moves.

    fit = fit_device_budget(device, store, group, ranks_sharing, gathered_later)   # once, after the first step
    fit.budget_after                                               # the device tier's limit from now on
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from ..device_memory import free_at_peak
from ..store import format_bytes
from ..store.budget import AUTO_FRACTION, fit_auto_device_budget
from .collectives import comm

log = logging.getLogger("offload")


@dataclass(frozen=True)
class DeviceBudgetFit:
    """What the fit measured on this rank (bytes) and the limit every rank took."""
    budget_before: int
    budget_after: int
    free_at_peak: int  # this rank's share of what the device had free at its allocator's busiest
    tier_in_use: int
    tier_peak: int
    gathered_later: int  # bytes of gathered units later steps hold beyond the first step's peak (taken off free)

    @property
    def short_of_working_set(self) -> bool:
        """The tier's working set in the first step was more than the step left room for: its floor set the
        limit, and what else the device holds at the peak (activations) has next to no margin."""
        room = self.free_at_peak - self.gathered_later
        return self.tier_peak > self.tier_in_use + int(room * AUTO_FRACTION["device_cuda"])


def fit_device_budget(device: torch.device, store, group, ranks_sharing: int, gathered_later: int = 0
                      ) -> DeviceBudgetFit:
    """Measure, agree over ranks, set the device tier's limit (`store`: the TieredStore) and say so.
    `gathered_later`: the gathered bound less the first step's peak of gathered bytes."""
    stats = store.stats()
    tier = stats["device"]
    free = free_at_peak(device)
    if device.type != "cuda":  # the device tier is host memory: shared by the node's ranks, and with this rank's
        # cpu tier, whose arena may still fault in the pages it has not touched (a locked arena has them all)
        cpu = stats["cpu"]
        resident = cpu["capacity"] if cpu["locked"] else cpu["peak_bytes"]
        free = free // max(1, ranks_sharing) - max(0, cpu["capacity"] - resident)
    limit = fit_auto_device_budget(tier["capacity"], tier["bytes_in_use"], tier["peak_bytes"],
                                   free - gathered_later)
    agreed = comm.all_reduce_host_(group, torch.tensor([limit], dtype=torch.float64), "min",
                                   what="the device budget fitted after the first step")
    limit = store.limit_device(int(agreed[0]))
    fit = DeviceBudgetFit(tier["capacity"], limit, free, tier["bytes_in_use"], tier["peak_bytes"], gathered_later)
    if fit.short_of_working_set:
        log.warning("offload: the first step left %s free on %s at its peak beside the device tier's working set "
                    "of %s: the activations have next to no room. Lower the batch or the sequence length, set "
                    "Config.activations='cpu', or give device_budget", format_bytes(max(0, free)), device,
                    format_bytes(fit.tier_peak))
    elif limit < fit.budget_before:
        log.info("offload: device_budget 'auto' fitted after the first step: %s -> %s (%s free on %s at its peak, "
                 "with the activations and communicators)", format_bytes(fit.budget_before), format_bytes(limit),
                 format_bytes(free), device)
    return fit
