"""The planner's pure functions (offload/prefetch): traces, the cost table, residency, prefetch timing, gather
ahead, reshard after forward, the optimizer's unit order. No store, no I/O, no modules."""
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from offload.prefetch import (CostTable, Phase, ShardCost, StateClass, Trace, Use, gather_ahead, plan_prefetch,
                             reshard_after_forward, residency_plan, step_order, traffic_per_step)
from offload.prefetch.schedule import Read
from offload.prefetch.trace import TraceRecorder

F, B, S = Phase.FORWARD, Phase.BACKWARD, Phase.STEP


def step_trace(units=("", "0", "1", "2"), compute=0.01) -> Trace:
    """One training step: forward in order, backward in reverse (the root last), then the optimizer."""
    uses = [Use(F, u) for u in units] + [Use(B, u) for u in reversed(units)] + [Use(S, u) for u in units]
    return Trace(tuple(uses), tuple(compute if u.phase is not S else 0.0 for u in uses))


# ---- trace -----------------------------------------------------------------------------------------
def test_recorder_puts_compute_after_the_use_it_follows():
    rec = TraceRecorder()
    rec.record(Use(F, "a"), 5.0)  # time before the first use belongs to no use
    rec.record(Use(F, "b"), 0.25)
    rec.record(Use(B, "b"), 0.5)
    trace = rec.finish(0.125)
    assert trace.uses == (Use(F, "a"), Use(F, "b"), Use(B, "b"))
    assert trace.compute_s == (0.25, 0.5, 0.125)
    assert trace.units(F) == ["a", "b"] and trace.count("b", B) == 1 and trace.count("a", B) == 0


def test_trace_needs_one_compute_time_per_use():
    with pytest.raises(ValueError):
        Trace((Use(F, "a"),), ())


# ---- cost table ------------------------------------------------------------------------------------
def test_cost_table_takes_measured_bandwidth_only_where_enough_was_moved():
    base = CostTable()
    got = base.measured({"nvme->cpu": 4 << 20, "cpu->nvme": 1000}, {"nvme->cpu": 0.002, "cpu->nvme": 0.001})
    assert got.nvme_read_Bps == pytest.approx((4 << 20) / 0.002)
    assert got.nvme_write_Bps == base.nvme_write_Bps  # 1000 bytes say nothing about the disk
    assert got.read_s(got.nvme_read_Bps) == pytest.approx(1.0)


# ---- traffic and residency -------------------------------------------------------------------------
@pytest.mark.parametrize("cls,per_byte", [(StateClass.PARAM, 3), (StateClass.MASTER_PARAM, 4),
                                          (StateClass.GRAD, 2), (StateClass.OPTIM, 2)])
def test_traffic_per_step_per_class(cls, per_byte):
    # bf16 param: read for forward and backward, written by the step; grad: written by the reduce and read by
    # the step; optimizer state: read and written by the step; an fp32 param that is its own master also
    # read by the step
    trace = step_trace()
    assert traffic_per_step(trace, ShardCost("k", "1", cls, 100, on_nvme=True)) == per_byte * 100
    assert traffic_per_step(trace, ShardCost("k", "1", cls, 100, on_nvme=False)) == 0


def test_accumulated_gradient_reads_back_what_the_previous_reduce_wrote():
    uses = [Use(F, "1"), Use(B, "1")] * 3 + [Use(S, "1")]  # 3 micro-batches reduced each
    trace = Trace(tuple(uses), (0.0,) * len(uses))
    grad = ShardCost("g", "1", StateClass.GRAD, 10, on_nvme=True)
    assert traffic_per_step(trace, grad) == 10 * (3 + 2 + 1)  # 3 writes, 2 read-backs, the step's read


def test_residency_prefers_traffic_per_byte_then_earlier_units_and_respects_capacity():
    trace = step_trace()
    shards = [ShardCost("opt2", "2", StateClass.OPTIM, 100, True),
              ShardCost("param2", "2", StateClass.PARAM, 100, True),
              ShardCost("param0", "0", StateClass.PARAM, 100, True),
              ShardCost("cpu", "0", StateClass.PARAM, 1, False),  # not on nvme: nothing to save
              ShardCost("big", "1", StateClass.PARAM, 1000, True)]
    assert residency_plan(trace, shards, 0) == frozenset()
    assert residency_plan(trace, shards, 100) == {"param0"}  # 3 per byte beats 2; unit 0 runs first
    assert residency_plan(trace, shards, 250) == {"param0", "param2"}
    # the big one does not fit: smaller ones are still taken
    assert residency_plan(trace, shards, 399) == {"param0", "param2", "opt2"}
    assert residency_plan(trace, shards, 1300) == {"param0", "param2", "opt2", "big"}


@settings(max_examples=200, deadline=None)
@given(sizes=st.lists(st.integers(1, 1000), min_size=1, max_size=20), capacity=st.integers(0, 10000))
def test_residency_never_exceeds_capacity(sizes, capacity):
    trace = step_trace(units=tuple(str(i) for i in range(len(sizes))))
    shards = [ShardCost(i, str(i), StateClass.OPTIM, n, True) for i, n in enumerate(sizes)]
    chosen = residency_plan(trace, shards, capacity)
    assert sum(sizes[i] for i in chosen) <= capacity
    # greedy: nothing left out would still fit
    assert all(sizes[i] > capacity - sum(sizes[j] for j in chosen) for i in range(len(sizes)) if i not in chosen)


# ---- prefetch --------------------------------------------------------------------------------------
def test_read_is_issued_early_enough_to_hide_behind_compute():
    trace = step_trace(compute=0.010)
    cost = CostTable(nvme_read_Bps=1e6)  # 25 ms for a 25 KB read
    needs = [[] for _ in trace.uses]
    target = trace.uses.index(Use(F, "2"))
    needs[target] = [Read("2/param", 25_000)]
    issue = plan_prefetch(trace, needs, cost, budget=1 << 30, margin=1.0)
    at = [j for j, reads in enumerate(issue) for i, _ in reads if i == target]
    assert len(at) == 1
    covered = sum(trace.compute_s[at[0]:target])
    assert covered >= 0.025  # the compute between issue and use covers the read
    assert sum(trace.compute_s[at[0] + 1:target]) < 0.025  # and it is not issued earlier than that


def test_read_that_does_not_fit_the_budget_is_left_to_its_use():
    trace = step_trace()
    needs = [[Read(("r", i), 100)] if i else [] for i in range(len(trace))]
    issue = plan_prefetch(trace, needs, CostTable(), budget=50)
    assert all(not reads for reads in issue)


def test_reads_of_the_first_use_are_issued_at_the_step():
    trace = step_trace()
    needs = [[] for _ in trace.uses]
    needs[0] = [Read("root", 10)]
    issue = plan_prefetch(trace, needs, CostTable(), budget=100)
    assert issue[len(trace) - 1] == [(0, Read("root", 10))]


def test_plan_prefetch_wants_one_list_of_reads_per_use():
    with pytest.raises(ValueError):
        plan_prefetch(step_trace(), [[]], CostTable(), budget=1)


@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_bytes_read_ahead_never_exceed_the_budget(data):
    n_units = data.draw(st.integers(1, 6))
    trace = step_trace(units=tuple(str(i) for i in range(n_units)),
                       compute=data.draw(st.floats(0.0, 0.05)))
    needs = [[Read((i, k), data.draw(st.integers(1, 400))) for k in range(data.draw(st.integers(0, 3)))]
             if trace.uses[i].phase is not S else [] for i in range(len(trace))]
    budget = data.draw(st.integers(0, 1500))
    cost = CostTable(nvme_read_Bps=data.draw(st.floats(1e3, 1e9)))
    issue = plan_prefetch(trace, needs, cost, budget)
    held = [0] * len(trace)  # bytes issued and not yet used while use j is current
    for j, reads in enumerate(issue):
        for i, read in reads:
            assert read in needs[i]
            span = range(j, len(trace)) if i == 0 else range(j, i)  # use 0's reads wrap to the next step
            assert i == 0 or j < i  # a read is issued before its use
            for k in span:
                held[k] += read.nbytes
    assert max(held) <= budget


# ---- gathers, reshard, step order ------------------------------------------------------------------
def test_gather_ahead_is_the_next_use_of_another_unit():
    trace = step_trace(units=("", "0", "1"))
    uses = trace.uses
    assert uses[gather_ahead(trace, 0)] == Use(F, "0")
    assert gather_ahead(trace, 2) is None  # forward "1" -> backward "1": the same unit, already gathered
    assert uses[gather_ahead(trace, 3)] == Use(B, "0")
    assert gather_ahead(trace, 5) is None  # the next use is the optimizer: nothing to gather
    assert gather_ahead(trace, len(trace) - 1) is None


def test_last_block_and_root_stay_gathered_from_forward_to_backward():
    trace = step_trace(units=("", "0", "1"))
    last_forward = trace.uses.index(Use(F, "1"))
    assert reshard_after_forward(trace, last_forward, "1", frozenset()) is False  # its backward is next
    assert reshard_after_forward(trace, 1, "0", frozenset()) is True  # other units run before its backward
    # the root's forward ends last (it wraps the blocks); its backward needs only gathered units before it
    assert reshard_after_forward(trace, last_forward, "", frozenset({"1", "0"})) is False
    assert reshard_after_forward(trace, last_forward, "", frozenset({"1"})) is True  # block 0 needs a gather


def test_step_order_follows_the_next_forward_then_units_with_no_forward():
    uses = [Use(F, "b"), Use(F, "a"), Use(B, "a"), Use(B, "b"), Use(S, "a"), Use(S, "z"), Use(S, "b")]
    trace = Trace(tuple(uses), (0.0,) * len(uses))
    assert step_order(trace) == ["b", "a", "z"]
