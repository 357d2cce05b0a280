"""Ranks that issued different collectives, named at the end of the pass that did it (issue 44).

Every gather and reduce is a collective, so every rank must ask for the same ones in the same order. One that
does not (rank-dependent routing, an eval forward on one rank only, a forward of another length that changed a
decision) pairs its collectives with another rank's: on NCCL a hang at some later collective, on gloo or with
same-size units silently wrong numbers. The optimizer step compares what each rank asked (Runtime.sync_used);
this compares the same record (comm.AskedCollectives) at the end of every backward and every eval forward, so
the error comes from the pass that diverged, naming the units and the ranks, not from a hang a step later.

One small all-gather per pass: (which pass ended, units, gathers, reduces, order hash) per rank. Only where the
rows differ, and the ranks hold as many units, a second one of the per-unit counts names the units. Both
decisions read the gathered rows, the same on every rank, so every rank issues the same collectives here.
The counts are not taken: the step's own comparison refuses the step as well (a caught error, then opt.step()),
and zero_grad() forgets them (AskedCollectives.forget_divergence).
"""
from __future__ import annotations

import torch

from . import comm

PASSES = ("backward", "eval forward")


# the fix, said by this pass check and by the step's own (update/step.py, sync_used)
SAME_UNITS_FIX = ("Every rank must run the same units in the same order: call every expert of a mixture-of-experts "
                  "layer on every rank (on an empty batch where it got no tokens), and run an evaluation, generate(), "
                  "model.state_dict() or rt.full_state_dict() on every rank, not on rank 0 only")


class RanksDiverged(RuntimeError):
    """The ranks asked for different gathers or reduces in one pass."""


def check_pass(group: comm.Group, units: list, where: str) -> None:
    """At the end of a pass (`where`: one of PASSES), on the training thread of every rank."""
    if not group.distributed or group.order is None:
        return
    asked = group.order.asked
    counts = dict(asked.counts)
    totals = [sum(n for (lane, _), n in counts.items() if lane == name) for name in ("gather", "reduce")]
    head = torch.tensor([PASSES.index(where), len(units), *totals, asked.order_hash], dtype=torch.int64)
    rows = comm.all_gather_host(group, head, what=f"what each rank issued in this {where}").view(group.world_size, -1)
    if bool((rows == rows[0]).all()):
        return
    asked.diverged = True
    said = [_pass_ends(rows)] if len(set(rows[:, 0].tolist())) > 1 else []
    if len(set(rows[:, 1].tolist())) > 1:
        said.append("the ranks hold " + _per_rank(rows[:, 1].tolist(), "units"))
    else:
        per_unit = torch.tensor([counts.get((lane, u.index), 0) for u in units for lane in ("gather", "reduce")],
                                dtype=torch.int64)
        every = comm.all_gather_host(group, per_unit, what=f"which units each rank ran in this {where}")
        said.extend(_units_apart(units, every.view(group.world_size, len(units), 2)))
    if not said:
        said.append("the same units as often, in another order")
    shown = "; ".join(said[:4]) + (f" and {len(said) - 4} more" if len(said) > 4 else "")
    raise RanksDiverged(
        f"offload: the ranks issued different collectives by the end of this {where} ({shown}): each gather and "
        "reduce is a collective, so one rank's paired with another's for another unit (a hang on NCCL, wrong "
        "numbers on gloo); opt.step() refuses this step, call opt.zero_grad(). " + SAME_UNITS_FIX)


def _per_rank(values: list, noun: str) -> str:
    """'2 units on rank 0 and 3 units on ranks 1, 2' (ranks grouped by value)."""
    by_value: dict = {}
    for rank, v in enumerate(values):
        by_value.setdefault(v, []).append(rank)
    return " and ".join(f"{v} {noun} on rank{'s' if len(r) > 1 else ''} {', '.join(map(str, r))}"
                        for v, r in by_value.items())


def _pass_ends(rows: torch.Tensor) -> str:
    by_pass: dict = {}
    for rank, p in enumerate(rows[:, 0].tolist()):
        by_pass.setdefault(PASSES[p], []).append(rank)
    return " where ".join(f"rank{'s' if len(r) > 1 else ''} {', '.join(map(str, r))} ended "
                          f"{'an' if p[0] in 'ae' else 'a'} {p}" for p, r in by_pass.items())


def _units_apart(units: list, every: torch.Tensor) -> list[str]:
    """every[rank, unit, lane]: one phrase per unit whose counts differ over ranks."""
    out = []
    for k, u in enumerate(units):
        ways = [f"{done} {_per_rank(every[:, k, j].tolist(), 'times')}"
                for j, done in enumerate(("gathered", "reduced")) if len(set(every[:, k, j].tolist())) > 1]
        if ways:
            out.append(f"{u.label} {' and '.join(ways)}")
    return out
