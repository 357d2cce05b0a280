"""A step's loss scale: what the scale of the next backward is, what this step's gradient shards carry, and
whether they overflowed (offload.GradScaler, grad_scaler.py, drives it; the update path holds it)."""
from __future__ import annotations

import enum
from dataclasses import dataclass

import torch


class GradState(enum.Enum):
    """What the runtime's stored gradient shards of this step carry (LossScale.state; LossScale's on_* methods are
    its only writers)."""

    PLAIN = "plain"  # no loss scale (no GradScaler): the stored gradient is the gradient
    SCALED = "scaled"  # the shards hold the gradient times S; a clip or a step must unscale first
    UNSCALED = "unscaled"  # the shards still hold it times S, the step's factor carries 1/S, overflow is known


@dataclass
class LossScale:
    """The runtime's view of loss scaling (rt.loss_scale): the scale of the next backward's gradients (None
    without a GradScaler), what this step's gradients carry, and whether they overflowed."""

    scale: float | None = None
    state: GradState = GradState.PLAIN
    # the factor that takes this step's stored gradients back to the gradient: 1 / S in fp32, as torch's GradScaler
    # computes its inv_scale (1.0 when they carry no scale); set once a backward, read per unit in the backward
    unscale: float = 1.0
    found_inf: bool = False
    skipped_steps: int = 0  # steps skipped for an overflow, since the runtime opened
    overflows_here: int = 0  # of those, the steps whose overflow was in this rank's own shards
    skipped: bool = False  # this step was skipped

    def report(self) -> dict:
        return {"scale": self.scale, "skipped_steps": self.skipped_steps, "overflows_here": self.overflows_here}

    def on_new_backward(self) -> None:
        """A backward starts: its gradients carry the scale, if a GradScaler set one."""
        self.state = GradState.PLAIN if self.scale is None else GradState.SCALED
        self.unscale = 1.0 if self.scale is None else fp32(1.0 / self.scale)
        self.found_inf = self.skipped = False

    def on_unscaled(self, found_inf: bool, found_here: bool) -> None:
        """The overflow check ran: `found_inf` over every rank, `found_here` in this rank's shards."""
        self.state, self.found_inf = GradState.UNSCALED, found_inf
        self.overflows_here += int(found_here)

    def on_skipped(self) -> None:
        self.skipped, self.skipped_steps = True, self.skipped_steps + 1


def fp32(x: float) -> float:
    return torch.tensor(x, dtype=torch.float32).item()  # the scale is fp32, as torch's
