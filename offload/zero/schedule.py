"""The schedule: the runtime's side of the planner. It owns the traced unit order, the plan made from it,
and the prefetch that plan drives; the hooks make one call into it per event.

    on_forward(unit) / on_backward(unit)   a use: traced, matched against the plan, planned work issued
    on_backward_end()                      the backward pass is over
    before_step(units)                     the optimizer is about to update `units`: the step's trace is
                                           complete; a first step, or one that did not match the plan,
                                           makes a new plan (re-trace); returns the units in update order
    take_prefetched(unit)                  the gather takes the param chunks read ahead for it
    reshard_after_forward(unit)            free after forward, or keep for the backward right after

Following a plan means: at use i, issue the reads the plan put there (param chunks of later uses, within
the read-ahead budget; a unit whose update is still running is read once it is over) and the gather of
the next use's unit (one ahead; a collective, so decided only by the plan and the uses so far, which are
the same on every rank). A use that differs from the plan (a unit skipped, another branch, eval under
no_grad in between is not traced at all) stops following for the rest of the step, releases what was read
ahead, and the step's own trace becomes the next plan. Nothing it does changes a result: only when bytes
move.
"""
from __future__ import annotations

import contextlib
import logging
import threading
import time
from dataclasses import dataclass

import torch

from .. import prefetch as planner
from ..prefetch import Phase, Trace, Use
from ..prefetch.schedule import Read
from ..prefetch.trace import TraceRecorder
from ..store import LeaseMode, Tier
from ..store.swap_file import page_bytes
from ..telemetry import recording, span
from .lanes import LaneContext
from .shards import ShardKey, StateKind
from .state_machines import TRAINING_MOVES, TrainingState, UnitState
from .state_store import Use as Where

log = logging.getLogger("offload")


@dataclass(frozen=True)
class Plan:
    trace: Trace
    issue: list  # issue[i]: [(use index, Read)] to issue when use i is reached
    step_order: list  # unit ids in the order the optimizer updates them
    resident: frozenset  # ShardKeys held in the cpu tier across steps
    read_budget: int  # bytes of params read ahead and not yet used, at most
    state_budget: int  # bytes of the next update's optimizer states read during the backward, at most
    lanes_bytes: int = 0  # cpu bytes the plan keeps for the lanes (working set and read-ahead): not the residents'
    forward_units: frozenset = frozenset()  # units the forward uses (their updates hand their params over)


class Schedule:
    def __init__(self, ctx: LaneContext, units_by_uid: dict, reserve_bytes, prefetch: bool, gather_ahead: bool,
                 on_new_backward=lambda: None, pipeline=None, updates_in_backward=lambda: False,
                 plan_for_updates_in_backward: bool = False, before_gather=lambda unit: None,
                 activation_room=lambda: 0, on_pass_end=lambda where: None):
        self.ctx = ctx
        self.activation_room = activation_room  # () -> cpu bytes the offloaded activations take (kept free)
        self.pipeline = pipeline  # OptimizerPipeline: reads the next update's states during the backward
        # the next update's first states are read while the backward computes; with the updates in the backward
        # (speculative, or Config.update_in_backward) the disk is idle under the forward instead: read them then,
        # in backward order. () -> the next backward queues updates (asked as each pass starts)
        self.updates_in_backward = updates_in_backward
        # the plan's state read-ahead leaves the optimizer lane's working set free for updates in the backward
        self.plan_for_updates_in_backward = plan_for_updates_in_backward
        self.before_gather = before_gather  # (unit) -> None: before any gather is issued (speculation's void)
        self.on_new_backward = on_new_backward  # the runtime forgets the last clip coefficient
        # (where) -> None: a backward or an eval forward (the root's, without gradients) is over: the ranks compare
        # what they issued in it (collectives/divergence.py)
        self.on_pass_end = on_pass_end
        self.units = units_by_uid  # uid -> ShardedUnit (the runtime adds units as it wraps models)
        self.reserve_bytes = reserve_bytes  # () -> cpu bytes the pipelines need besides what stays resident
        self.prefetch = prefetch  # Config.pipeline: read ahead and gather ahead
        self.gather_ahead = gather_ahead  # placement: the device budget holds one more gathered unit
        self.state = TrainingState.IDLE
        self.plan: Plan | None = None
        self.plans_made = 0
        self.gathers_backed_off = 0  # gathers ahead the device had no room for (gathered where needed instead)
        # units whose gather ahead backed off, their own use not reached yet: reshard_after_forward counts them as
        # gathered, as the ranks that did gather them ahead do, so every rank keeps and frees alike (a rank that
        # freed a unit the others kept would gather it once more than they: the gathers would pair wrongly)
        self._backed_off: set[str] = set()
        self.cost = planner.CostTable()
        self._cursor = -1  # the last use of the plan matched in this step
        self._following = False
        self._matched = True  # every use of this step so far matched the plan
        self._recorder = TraceRecorder()
        self._backward_seen: set[str] = set()
        self._callback_queued = False  # autograd's end-of-backward callback is queued for this pass
        self._clock = (time.perf_counter(), 0.0)  # (time, total waits) at the last use
        self._lock = threading.Lock()  # the prefetch table: the optimizer lane issues deferred reads
        self._prefetched: dict[ShardKey, object] = {}  # read ahead, not yet taken
        self._prefetched_bytes = 0
        self._claims: dict[str, int] = {}  # uid -> generation: bumped when a gather takes the unit's reads
        self.param_bytes_handed_over = 0  # param chunks an update kept in memory for the next gather (hand_over)
        if pipeline is not None:
            pipeline.param_written = self.hand_over

    # ---- training state ------------------------------------------------------------------------
    # See [Note: one writer per state] in docs/zero-runtime.md
    def _enter(self, state: TrainingState) -> None:
        if (self.state, state) not in TRAINING_MOVES:
            raise RuntimeError(f"offload: the training loop went from {self.state.name} to {state.name}, which the "
                               "runtime does not expect (offload/zero/state_machines.py TRAINING_MOVES); please report "
                               "it with the loop that did it")
        self.state = state

    # ---- the hooks' calls (hooks.py) ------------------------------------------------------------
    def pre_forward(self, unit) -> None:
        unit.check_alive()
        self._close_failed_backward()
        self.before_gather(unit)
        unit.unshard(async_op=True)  # its own gather first: the lane runs gathers in the order issued
        self.on_forward(unit)  # trace it; issue what the plan puts here (reads and the next gather)
        unit.wait_for_unshard()

    def gather_for_call(self, unit) -> None:
        """A module of `unit` is called by itself, gradients off: gathered now (current values), left gathered
        until the unit's own next forward or the end of a backward frees it (the root stays within its bound)."""
        unit.check_alive()
        self.before_gather(unit)
        unit.unshard()

    def recompute(self, unit) -> None:
        """Activation checkpointing re-runs the unit's forward inside backward: it must be gathered."""
        unit.check_alive()
        self.before_gather(unit)
        unit.unshard(async_op=True)
        self.on_backward(unit)
        unit.wait_for_unshard()

    def post_forward(self, unit) -> None:
        if not torch.is_grad_enabled() or self.reshard_after_forward(unit):
            unit.reshard()
        if not torch.is_grad_enabled() and unit.name == "":
            self.on_pass_end("eval forward")

    def forward_failed(self, unit) -> None:
        """`unit`'s forward raised (an out-of-memory error, a bad batch): no backward comes for what this step's
        forward gathered, so it is freed now, not at the next forward (a retry with a smaller batch started with
        those bytes held): `unit` and every unit gathered but the ones whose forward encloses it (still running,
        they may catch the error; if not, theirs ends the same way)."""
        for u in self.units.values():
            if u.state in (UnitState.UNSHARDED, UnitState.GATHERING) and not _encloses(u, unit):
                try:
                    u.reshard()
                except Exception:  # noqa: BLE001 - its gather failed (it dropped its buffer): the forward's own
                    pass           # error is the one raised

    def pre_backward(self, unit) -> None:
        if torch.is_grad_enabled():  # the engine runs hooks with grad mode on only for create_graph=True
            raise RuntimeError(
                "offload: a backward with create_graph=True (higher-order gradients: a gradient penalty, "
                "torch.autograd.grad(..., create_graph=True)) is not supported (nor by FSDP): "
                f"{unit.label}'s gathered parameters are freed after its backward, and the graph of the gradients "
                "would read them later. Compute that term outside the offloaded model, or train without offload.init")
        if not self._callback_queued:
            self._callback_queued = True
            self.on_new_backward()
            # runs when the whole backward pass has finished: free what no post-backward freed
            torch.autograd.Variable._execution_engine.queue_callback(self._backward_finished)
        self.before_gather(unit)
        unit.unshard(async_op=True)
        self.on_backward(unit)
        unit.wait_for_unshard()

    def post_backward(self, unit) -> None:
        unit.reshard()

    def _backward_finished(self) -> None:
        self._callback_queued = False
        self._reshard_all()
        self.on_backward_end()
        self.on_pass_end("backward")  # (a backward that raised is not compared: its ranks may have failed apart)

    def _close_failed_backward(self) -> None:
        """A forward while the end-of-backward callback is still marked queued: the last backward raised
        before its callback ran. Clear the mark (else no later backward queues one, and gathered units
        would leak into every step) and free what that backward left gathered."""
        if self._callback_queued and self.state is not TrainingState.FORWARD:
            self._callback_queued = False
            self._reshard_all()
            self.on_backward_end()

    def _reshard_all(self) -> None:
        for u in self.units.values():
            if u.state in (UnitState.UNSHARDED, UnitState.GATHERING):
                u.reshard()

    # ---- uses ----------------------------------------------------------------------------------
    def on_forward(self, unit) -> None:
        if not torch.is_grad_enabled():
            return  # eval / generate under no_grad: not part of a training step's trace
        if self.state is not TrainingState.FORWARD:
            self._enter(TrainingState.FORWARD)
            if self.updates_in_backward():
                self._read_states_ahead(self.plan.trace.units(Phase.BACKWARD) if self.plan else [])
        self._use(Use(Phase.FORWARD, unit.uid))

    def on_backward(self, unit) -> None:
        if self.state is not TrainingState.BACKWARD:
            self._enter(TrainingState.BACKWARD)
            if self.pipeline is not None:
                self.pipeline.prefer_forward_order(None)  # updates queued in the backward: oldest first
            if not self.updates_in_backward():  # the disk is idle while the backward computes
                self._read_states_ahead(self.plan.step_order if self.plan else [])
        if unit.uid in self._backward_seen:
            return  # a unit's backward use is its first need in the pass (pre-backward or recompute)
        self._backward_seen.add(unit.uid)
        self._use(Use(Phase.BACKWARD, unit.uid))

    def _read_states_ahead(self, uids: list) -> None:
        """Read the first optimizer states of the units `uids` will update first, within the plan's allowance."""
        if self.prefetch and self._following and self.pipeline is not None and self.plan.state_budget:
            self.pipeline.read_states_ahead([self.units[u] for u in uids if u in self.units], self.plan.state_budget)

    def on_backward_end(self) -> None:
        if self.updates_in_backward() and self.pipeline is not None and self.plan is not None:
            self.pipeline.prefer_forward_order(self.plan.step_order)  # the forward waits for its first units first
        self._backward_seen.clear()
        self._enter(TrainingState.IDLE)

    def _use(self, use: Use, issue: bool = True) -> None:
        self._backed_off.discard(use.unit)  # its own gather is issued (the hooks gather before they trace)
        now, waited = time.perf_counter(), self._total_wait()
        last_t, last_w = self._clock
        self._recorder.record(use, max(0.0, (now - last_t) - (waited - last_w)))
        self._clock = (now, waited)
        if not self._following:
            self._matched = False
            return
        trace = self.plan.trace
        i = self._cursor + 1
        if i < len(trace) and trace.uses[i] == use:
            self._cursor = i
            if issue:
                with span(f"prefetch:{use}") if recording() else _NO_SPAN:
                    self._issue(i)
            return
        self._following = False  # the step left the plan: no more reads or gathers ahead this step
        self._matched = False
        self.release_prefetched()

    def _total_wait(self) -> float:
        return self.ctx.meter.total_wait()

    # ---- following the plan --------------------------------------------------------------------
    def _issue(self, i: int) -> None:
        plan = self.plan
        if self.prefetch:
            for _, read in plan.issue[i]:
                self._read_ahead(read)
            j = planner.gather_ahead(plan.trace, i) if self.gather_ahead else None
            if j is not None:
                nxt = self.units.get(plan.trace.uses[j].unit)
                if nxt is not None and not nxt.fresh and nxt.state is not UnitState.FREED:
                    self.before_gather(nxt)
                    # the device full: gathered where it is needed instead (in the backward, on several ranks: raises)
                    if not nxt.unshard_ahead(reorders_nothing=self.state is TrainingState.FORWARD):
                        self._gather_backed_off(nxt)

    def _read_ahead(self, read: Read) -> None:
        unit = self.units.get(read.key.unit)
        if unit is None or unit.fresh:
            return
        with self._lock:
            gen = self._claims.get(unit.uid, 0)
        update = unit.update
        if update is not None and not update.done():
            # the shard is being updated: read it once the update is over (from the optimizer lane)
            update.add_done_callback(lambda f: f.exception() is None and self._issue_read(unit, read, gen, update))
            return
        self._issue_read(unit, read, gen, update)

    def _issue_read(self, unit, read: Read, gen: int, update) -> None:
        with self._lock:
            if (self._claims.get(unit.uid, 0) != gen or unit.update is not update or read.key in self._prefetched
                    or self._prefetched_bytes + read.nbytes > self.plan.read_budget):
                return  # the gather already took this unit, a newer update came, or no budget left
            spec = unit.shards.spec(StateKind.PARAM, read.key.chunk)
            lease = self.ctx.states.lease(spec, Where.COMPUTE, LeaseMode.READ, block=False)
            if lease is None:
                return  # no room in the tier now: back off; the gather reads it itself
            self._prefetched[read.key] = lease
            self._prefetched_bytes += read.nbytes

    def hand_over(self, unit, chunk, spec) -> None:
        """On the optimizer lane: an update after the backward has just written `unit`'s param chunk, and its lease
        still holds the bytes. The next forward gathers the unit right after its update, so while the plan pages
        that chunk and the read-ahead budget has room, a READ lease on the same working copy goes in the read-ahead
        table (the update's release then writes it home and keeps it): the gather takes it instead of reading back
        from nvme what was just written, a write-then-read on the forward's critical path."""
        plan = self.plan
        if not (self.prefetch and self._following and plan is not None and spec.home is Tier.NVME
                and not self.ctx.states.is_resident(spec) and unit.uid in plan.forward_units):
            return
        nbytes = self.ctx.states.staged_nbytes(spec)
        with self._lock:
            if spec.key in self._prefetched or self._prefetched_bytes + nbytes > plan.read_budget:
                return
            # the update's lease is in the cpu tier (Use.HOST): one of that tier shares its working copy (no I/O, no
            # buffer); the gather copies it to the compute device as it does a compute lease's bytes
            lease = self.ctx.states.lease(spec, Where.HOST, LeaseMode.READ, block=False)
            if lease is None:
                return
            self._prefetched[spec.key] = lease
            self._prefetched_bytes += nbytes
            self.param_bytes_handed_over += spec.nbytes

    def _gather_backed_off(self, unit) -> None:
        self._backed_off.add(unit.uid)
        self.gathers_backed_off += 1
        if self.gathers_backed_off == 1:
            log.warning("offload: the device had no room to gather %s ahead of its use; it is gathered where it is "
                        "needed instead (its gather no longer overlaps compute; rt.stats()['gathers_backed_off'] "
                        "counts them). Lower device_budget or the activations' memory (a smaller micro-batch, "
                        "checkpointing, Config.activations) to leave the gathers room.", unit.label)

    def take_prefetched(self, unit) -> dict:
        """{chunk index: lease} read ahead for `unit`'s gather (removed from the table; later reads for this
        gather are dropped)."""
        taken = {}
        with self._lock:
            self._claims[unit.uid] = self._claims.get(unit.uid, 0) + 1
            if not self._prefetched:
                return taken  # (nothing read ahead: params in memory, or not following a plan)
            for c in unit.shards.chunks:
                spec = unit.shards.spec(StateKind.PARAM, c)
                lease = self._prefetched.pop(spec.key, None)
                if lease is not None:
                    taken[c.index] = lease
                    self._prefetched_bytes -= self.ctx.states.staged_nbytes(spec)
        return taken

    def drop_prefetched(self, unit) -> None:
        """The optimizer is about to write `unit`'s shard: release anything read ahead of it."""
        for lease in self.take_prefetched(unit).values():
            lease.release()

    def release_prefetched(self) -> None:
        """Give back every param chunk read ahead (a use left the plan, or the runtime is made quiet: whoever
        quiesces may replace shards whole, a checkpoint load, and bytes read ahead before that would be stale)."""
        with self._lock:
            held, self._prefetched, self._prefetched_bytes = self._prefetched, {}, 0
            for uid in self.units:
                self._claims[uid] = self._claims.get(uid, 0) + 1
        for lease in held.values():
            lease.release()

    def reshard_after_forward(self, unit) -> bool:
        if not (self.prefetch and self._following):
            return True
        return planner.reshard_after_forward(self.plan.trace, self._cursor, unit.uid, _Gathered(self))

    # ---- the step: end of a trace, maybe a new plan -----------------------------------------------
    def before_step(self, units: list) -> list:
        """`units` are about to be updated: record the step's uses, re-plan if this step did not follow the
        plan, and return them in the plan's update order."""
        for unit in units:
            self._use(Use(Phase.STEP, unit.uid), issue=False)  # after_step issues: the updates exist then
        trace = self._recorder.finish()
        if not (self._matched and self.plan is not None and len(trace) == len(self.plan.trace)):
            self._replan(trace)
        self._next_trace()
        order = {uid: k for k, uid in enumerate(self.plan.step_order)}
        return sorted(units, key=lambda u: order.get(u.uid, len(order)))

    def after_step(self) -> None:
        """The updates are queued: issue the reads the plan puts at the step (the next forward's first unit),
        each once its unit's update is over."""
        if self.plan is not None and self._following and len(self.plan.trace):
            with span("prefetch:step"):
                if self.prefetch:
                    for _, read in self.plan.issue[len(self.plan.trace) - 1]:
                        self._read_ahead(read)

    def step_skipped(self) -> None:
        """The step ends without updates (offload.GradScaler skipped it: its gradients overflowed). Its forward and
        backward leave the trace: the next step records afresh and keeps the plan if it follows it. What was read
        ahead for it is given back (the states on the optimizer lane, after what is queued there)."""
        self.release_prefetched()
        if self.pipeline is not None:
            self.ctx.lanes.optimizer.submit("drop states read ahead", self.pipeline.drop_states_read_ahead)
        self._next_trace()

    def _next_trace(self) -> None:
        """The next step's uses are recorded afresh and followed against the plan from its first."""
        self._recorder = TraceRecorder()
        self._cursor, self._following, self._matched = -1, self.plan is not None, True
        self._clock = (time.perf_counter(), self._total_wait())
        self._backed_off.clear()

    def forget(self) -> None:
        """Drop the plan and everything read ahead (a quiet point: before a checkpoint, at close)."""
        self.release_prefetched()
        if self.pipeline is not None:
            self.pipeline.drop_states_read_ahead()
        self.plan = None
        self._following = False

    def _replan(self, trace: Trace) -> None:
        with span("replan"):
            for lane in self.ctx.lanes.all():
                lane.drain()  # residency changes below: nothing may be moving
            self.release_prefetched()
            if self.pipeline is not None:
                self.pipeline.drop_states_read_ahead()
            self.ctx.states.wait_moves()  # write-behinds too: what the cpu tier holds now is held for good
            stats = self.ctx.states.stats()
            self.cost = self.cost.measured(stats["moved"], stats["busy_s"])
            specs = self._nvme_specs()
            states = self.ctx.states
            resident_bytes = sum(page_bytes(s.nbytes) for s in specs if s.key in states.resident_keys())
            # See [Note: the cpu budget's order of claims] in docs/zero-runtime.md
            # The cpu budget, what is not held for good (home shards): first the lanes' working set (so they
            # can always make progress), then the read-ahead (params, the optimizer's next chunks), then states
            # kept resident across steps.
            working, wanted_reads, wanted_ahead = self.reserve_bytes()
            if not any(s.key.kind is StateKind.PARAM for s in specs):
                wanted_reads = 0  # no param pages: none is read ahead into the cpu tier
            free = stats["cpu"]["capacity"] - (stats["cpu"]["bytes_in_use"] - resident_bytes) - working.total
            read_budget = min(wanted_reads, max(0, free))
            step_ahead = min(wanted_ahead, max(0, free - read_budget))
            costs = [planner.ShardCost(s.key, s.key.unit, _class_of(s.key.kind, self.ctx.compute_dtype),
                                       page_bytes(s.nbytes), on_nvme=True) for s in specs]
            params = {c.key for c in costs if c.cls in _PARAM_CLASSES}
            # the saved activations' share: what the forwards so far held in the cpu tier (Config.activations),
            # never taken by resident states (else the next step's would find no room and stay on the device)
            room = free - read_budget - step_ahead - self.activation_room()
            plan_a = planner.residency_plan(trace, costs, max(0, room)) if self.prefetch else frozenset()
            plan, reserve = plan_a, working.total + read_budget + step_ahead
            if self.prefetch and working.gather:
                # every paged param can stay resident: the gather stages nothing and no param is read ahead, so
                # their reserves hold resident states too
                plan_b = planner.residency_plan(trace, costs, max(0, room + read_budget + working.gather))
                if params <= plan_b:
                    plan, reserve = plan_b, working.total - working.gather + step_ahead
            self._settle_residency(specs, plan, reserve)
            if plan is not plan_a and not params <= states.resident_keys():  # a param was not placed: stage it
                reserve = working.total + read_budget + step_ahead
                self._settle_residency(specs, plan_a, reserve)
            elif plan is not plan_a:
                read_budget = 0
            resident = states.resident_keys()
            needs = []
            for use in trace.uses:
                unit = self.units.get(use.unit)
                reads = []
                if use.phase is not Phase.STEP and unit is not None:
                    for c in unit.shards.chunks:
                        spec = unit.shards.spec(StateKind.PARAM, c)
                        if spec.home is Tier.NVME and spec.key not in resident:
                            reads.append(Read(spec.key, states.staged_nbytes(spec)))
                needs.append(reads)
            issue = planner.plan_prefetch(trace, needs, self.cost, read_budget)
            # the optimizer lane's share (working set and read-ahead) is idle between updates; so is the params'
            # read-ahead budget when no param is read ahead. Read during the forward (updates in the backward), the
            # lane's working set stays free: an update runs while later units' states wait in the read-ahead.
            working_step = 0 if self.plan_for_updates_in_backward else working.step
            state_budget = working_step + step_ahead + (0 if any(needs) else read_budget) if self.prefetch else 0
            self.plan = Plan(trace, issue, planner.step_order(trace), resident, read_budget, state_budget, reserve,
                             frozenset(trace.units(Phase.FORWARD)))
            self.plans_made += 1

    def _settle_residency(self, specs: list, plan: frozenset, reserve: int) -> None:
        """Hold `plan`'s shards resident (and no others), leaving room for `reserve` bytes of the lanes' staging
        slots: residents that leave too little of it in whole slots (holes between them are lost to slots) give
        it back, other states before params."""
        states = self.ctx.states
        for f in states.evict(states.resident_keys() - plan):
            f.result()  # their buffers must be free before the new residents are read in
        kept = sorted((s for s in specs if s.key in plan), key=lambda s: s.key.kind is not StateKind.PARAM)
        states.keep_resident(kept)
        while kept and states.free_staging_bytes() < reserve:
            for f in states.evict([kept.pop().key]):
                f.result()

    def _nvme_specs(self) -> list:
        """Every registered nvme-homed shard of every unit, in unit order, chunk by chunk: the residency plan
        breaks ties in this order, so a chunk's master and moments (alike per byte) stay resident together or
        page together, and a paged chunk's update can run in the backward (update/speculation.py)."""
        out = []
        for unit in self.units.values():
            for c in unit.shards.chunks:
                for kind in unit.shards.kinds():
                    spec = unit.shards.spec(kind, c)
                    if spec.home is Tier.NVME and self.ctx.states.has(spec):
                        out.append(spec)
        return out


_PARAM_CLASSES = (planner.StateClass.PARAM, planner.StateClass.MASTER_PARAM)


def _class_of(kind: StateKind, compute_dtype: torch.dtype) -> planner.StateClass:
    if kind is StateKind.PARAM:
        return planner.StateClass.MASTER_PARAM if compute_dtype == torch.float32 else planner.StateClass.PARAM
    return planner.StateClass.GRAD if kind is StateKind.GRAD else planner.StateClass.OPTIM


def _encloses(outer, inner) -> bool:
    """`outer`'s module holds `inner`'s (its forward runs inside outer's). Only on a failed forward: a walk."""
    return outer is not inner and any(m is inner.module for m in outer.module.modules())


_NO_SPAN = contextlib.nullcontext()  # (a label's name is formatted only when a profiler or a trace records it)


class _Gathered:
    """The units reshard_after_forward may count as gathered: their gathered bytes are current, or their gather
    ahead backed off. Asked unit by unit as the planner walks the trace (it stops at the first forward use, so
    it asks about a few units, not all of them once a unit a forward)."""

    def __init__(self, schedule: "Schedule"):
        self._units, self._backed_off = schedule.units, schedule._backed_off

    def __contains__(self, uid) -> bool:
        u = self._units.get(uid)
        return (u is not None and u.fresh) or uid in self._backed_off
