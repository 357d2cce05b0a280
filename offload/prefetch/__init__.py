"""The prefetch planner: pure functions of an execution trace, budgets and a cost table (the runtime's read-ahead
and residency; `offload plan`, which sizes a run before it starts, is offload/plan/).

    trace.py     Phase, Use, Trace: the order of unit uses in one training step, and time between them
    cost.py      CostTable: bandwidths and per-use compute time, measured
    schedule.py  which shards stay resident, when each read is issued, which unit to gather ahead,
                 whether a unit stays gathered from forward to backward, the optimizer's unit order

Nothing here does I/O or knows about modules: the runtime (offload/zero/schedule.py) feeds it a trace and
follows what it returns. Every function is unit-tested without a store.
"""
from .cost import CostTable
from .schedule import (ShardCost, StateClass, gather_ahead, plan_prefetch, reshard_after_forward, residency_plan,
                       step_order, traffic_per_step)
from .trace import Phase, Trace, Use

__all__ = ["Phase", "Use", "Trace", "CostTable", "ShardCost", "StateClass", "traffic_per_step", "residency_plan",
           "plan_prefetch", "gather_ahead", "reshard_after_forward", "step_order"]
