"""The schedule: pure functions of (trace, shard sizes, budgets, cost table). No I/O, no modules.

- traffic_per_step / residency_plan: which nvme-homed shards stay resident in the cpu budget across steps,
  chosen by nvme traffic saved per byte of budget (a bf16 param saves 3: its forward read, its backward
  read and its step write; a gradient or an optimizer state 2).
- plan_prefetch: for every read a use needs, at which earlier use it is issued: early enough that the
  compute in between covers the read at the measured bandwidth, never holding more than the read-ahead
  budget at once (a read that cannot fit anywhere is left to the use itself).
- gather_ahead: the unit whose gather is issued while the current one computes (the next use's unit:
  one unit ahead, the same on every rank, because a gather is a collective).
- reshard_after_forward: whether a unit stays gathered from its forward to its backward (when nothing
  else needs gathering in between: the root, the last block).
- step_order: the order the optimizer updates units: the next forward's order, so the forward can start
  on unit i as soon as unit i's own update is over.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Container, Hashable, Sequence

from .cost import CostTable
from .trace import Phase, Trace


class StateClass(enum.Enum):
    PARAM = "param"  # compute-dtype param: read by every forward and backward use, written by the step
    MASTER_PARAM = "master_param"  # fp32 param that is its own master: the step reads it too
    GRAD = "grad"  # written by each reduce (a backward use), read by the step
    OPTIM = "optim"  # fp32 master or an Adam moment: read and written by the step


@dataclass(frozen=True)
class ShardCost:
    key: Hashable
    unit: str
    cls: StateClass
    nbytes: int
    on_nvme: bool  # homed on nvme: its reads and writes are I/O unless it stays resident in cpu


def traffic_per_step(trace: Trace, shard: ShardCost) -> int:
    """Bytes of nvme I/O one step of `trace` causes for `shard` when it is not resident."""
    if not shard.on_nvme:
        return 0
    f = trace.count(shard.unit, Phase.FORWARD)
    b = trace.count(shard.unit, Phase.BACKWARD)
    s = trace.count(shard.unit, Phase.STEP)
    if shard.cls is StateClass.PARAM:
        reads, writes = f + b, s
    elif shard.cls is StateClass.MASTER_PARAM:
        reads, writes = f + b + s, s
    elif shard.cls is StateClass.GRAD:
        reads, writes = max(b - 1, 0) + s, b  # an accumulating reduce reads what the one before wrote
    else:
        reads, writes = s, s
    return shard.nbytes * (reads + writes)


# See [Note: the cpu budget's order of claims] in docs/zero-runtime.md
def residency_plan(trace: Trace, shards: Sequence[ShardCost], capacity: int) -> frozenset:
    """Keys of the nvme-homed shards to keep resident in `capacity` bytes of cpu budget: greedy by traffic
    saved per byte, then by first use in the trace (earlier first); a shard that does not fit is skipped
    and smaller ones are still tried."""
    first = {}
    for i, use in enumerate(trace.uses):
        first.setdefault(use.unit, i)
    scored = []
    for order, s in enumerate(shards):
        saved = traffic_per_step(trace, s)
        if saved > 0 and s.nbytes > 0:
            scored.append((-saved / s.nbytes, first.get(s.unit, len(trace)), order, s))
    scored.sort(key=lambda x: x[:3])
    chosen, used = [], 0
    for _, _, _, s in scored:
        if used + s.nbytes <= capacity:
            chosen.append(s.key)
            used += s.nbytes
    return frozenset(chosen)


@dataclass(frozen=True)
class Read:
    key: Hashable
    nbytes: int


def plan_prefetch(trace: Trace, needs: Sequence[Sequence[Read]], cost: CostTable, budget: int,
                  margin: float = 1.5) -> list[list[tuple[int, Read]]]:
    """issue[j] = [(i, read), ...]: when use j has been reached, issue `read`, which use i needs.

    needs[i] are the reads use i needs (not resident). A read for use i is issued at the latest use j < i
    whose compute until use i covers `margin` x its read time at cost.nvme_read_Bps (at the start of the
    step if none does), then moved later while the bytes issued but not yet used would exceed `budget` at
    some use in between; a read that fits nowhere before i is not prefetched (use i reads it itself).
    The trace repeats step after step: reads of use 0 are issued at the last use (the step), within the
    budget; the runtime issues a read of a unit whose update is still pending once that update is over.
    """
    n = len(trace)
    if len(needs) != n:
        raise ValueError("plan_prefetch: one list of reads per use")
    issue: list[list[tuple[int, Read]]] = [[] for _ in range(n)]
    held = [0] * n  # bytes issued and not yet used, while use j is current
    if n > 1:
        for read in needs[0]:
            if held[n - 1] + read.nbytes <= budget:
                held[n - 1] += read.nbytes
                issue[n - 1].append((0, read))
    for i in range(1, n):
        for read in needs[i]:
            lead = margin * cost.read_s(read.nbytes)
            j, covered = i - 1, trace.compute_s[i - 1]
            while j > 0 and covered < lead:
                j -= 1
                covered += trace.compute_s[j]
            while j < i and any(held[k] + read.nbytes > budget for k in range(j, i)):
                j += 1
            if j == i:
                continue  # no room before the use: it reads on demand
            for k in range(j, i):
                held[k] += read.nbytes
            issue[j].append((i, read))
    return issue


def gather_ahead(trace: Trace, i: int) -> int | None:
    """Index of the use whose unit is gathered while use i computes: the next forward/backward use, if it
    is another unit's. None at the end of the passes or before the step."""
    if i + 1 < len(trace):
        nxt = trace.uses[i + 1]
        if nxt.phase is not Phase.STEP and nxt.unit != trace.uses[i].unit:
            return i + 1
    return None


def reshard_after_forward(trace: Trace, i: int, unit: str, gathered: Container[str]) -> bool:
    """At the end of `unit`'s forward, with use i the last use reached: free its gathered parameter (True),
    or keep it for its backward (False) when the uses before that backward need no other gather (only
    backward uses of units in `gathered`). Reads only the uses up to the answer (asked once a unit a forward)."""
    uses = trace.uses
    for k in range(i + 1, len(uses)):
        use = uses[k]
        if use.phase is Phase.BACKWARD and use.unit == unit:
            return False
        if use.phase is not Phase.BACKWARD or use.unit not in gathered:
            return True
    return True


def step_order(trace: Trace) -> list[str]:
    """Units in the order the optimizer should update them: the forward's order (the next step's forward
    waits for each unit's own update), then units stepped without a forward use, in step order."""
    order = trace.units(Phase.FORWARD)
    seen = set(order)
    order += [u for u in trace.units(Phase.STEP) if u not in seen]
    return order
