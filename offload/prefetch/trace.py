"""An execution trace: the order in which one training step uses its units.

A step is forward uses (a unit's pre-forward), backward uses (the first time backward needs a unit:
its pre-backward, or its forward re-run by activation checkpointing) and step uses (the optimizer
updating a unit), in the order they happened, with the training thread's compute time after each use
(wall time minus the time it waited on queues). The first step records it; later steps compare what
happens with it: a difference (a skipped unit, another branch, another number of micro-batches) is a
change of plan, and the runtime records again.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass


class Phase(enum.Enum):
    FORWARD = "forward"
    BACKWARD = "backward"
    STEP = "step"


@dataclass(frozen=True)
class Use:
    phase: Phase
    unit: str  # the unit's stable id (its module's qualified name)

    def __str__(self) -> str:
        return f"{self.phase.value}:{self.unit or '<root>'}"


@dataclass(frozen=True)
class Trace:
    uses: tuple[Use, ...]
    compute_s: tuple[float, ...]  # training-thread compute after uses[i] until the next use (or the end)

    def __post_init__(self):
        if len(self.compute_s) != len(self.uses):
            raise ValueError("Trace: one compute time per use")

    def __len__(self) -> int:
        return len(self.uses)

    def units(self, phase: Phase) -> list[str]:
        """Units with a use in `phase`, in order of their first such use."""
        seen: dict[str, None] = {}
        for u in self.uses:
            if u.phase is phase:
                seen.setdefault(u.unit)
        return list(seen)

    def count(self, unit: str, phase: Phase) -> int:
        return sum(1 for u in self.uses if u.unit == unit and u.phase is phase)


class TraceRecorder:
    """Builds a Trace from uses as they happen: record(use, compute_before) where compute_before is the
    training thread's compute time since the previous use."""

    def __init__(self):
        self.uses: list[Use] = []
        self.compute: list[float] = []

    def record(self, use: Use, compute_before: float) -> None:
        if self.compute:
            self.compute[-1] += compute_before
        self.uses.append(use)
        self.compute.append(0.0)

    def finish(self, compute_after: float = 0.0) -> Trace:
        if self.compute:
            self.compute[-1] += compute_after
        return Trace(tuple(self.uses), tuple(self.compute))
