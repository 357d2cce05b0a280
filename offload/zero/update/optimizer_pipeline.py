"""The optimizer pipeline: the update over every unit's shard, chunk by chunk, on the optimizer lane.

    for each chunk, in the plan's unit order:
        lease chunk k+1's states (read ahead, if the budget has room now)
        wait chunk k's states                       (the only wait: the bytes are needed)
        the family's step over chunk k (AdamW: the fused kernel; also writes the bf16 param chunk)
        release chunk k's states                    (write-behind to their home tier)
    a unit's `update` future resolves after its last chunk is released

opt.step() only queues this and returns: the next forward overlaps the tail of the step, and a unit's next
gather waits for that unit's own update (unit.update), so results are bitwise those of the synchronous
path (Config.pipeline=False runs the same code in the training thread, one chunk at a time). Everything an
update uses is captured when step() is called (hyperparameters, step counts, the clip coefficient), so an
LR scheduler stepping right after opt.step() changes only the next step.

Between steps the lane is idle and the disk with it while the backward computes: read_states_ahead (issued
by the schedule when a backward starts) leases the fp32 master and moments of the next update's first chunks
into the lane's own share of the cpu budget, so the update starts on bytes already read. Those leases are
READ leases until the update takes them (Lease.upgrade: then written home on release); a unit the update
does not step gives them back unwritten, and anyone else about to read or replace those states whole
(checkpoints, state dicts, a re-plan, close) drops them first (drop_states_read_ahead, once the lanes are idle).

With Config.update_in_backward the runtime queues each unit's update from its reduce (submit_one): the
states are then read ahead under the forward, in the backward's order; each lane item runs the queued update
needed first (the oldest while the backward lasts, then the next forward's order: prefer_forward_order) and
reads the first states of the units after it while it steps.
"""
from __future__ import annotations

import concurrent.futures as cf
import threading
from dataclasses import dataclass, field

import torch

from ... import inject
from ...optim.schema import Schema
from ...store import LeaseMode, Tier
from ...telemetry import Queue, recording
from ..lanes import LaneContext
from ..shards import Chunk, StateKind
from ..state_store import Use


class UpdateFailed(RuntimeError):
    """An update on the optimizer lane raised (an I/O error reading a state, a corrupt swap slot): the unit that
    failed, and the units queued after it in that lane item, are not updated, or only in part. Raised wherever the
    runtime next needs one of them (their gathers wait for their updates), until rt.load_checkpoint replaces
    every state; the cause is chained."""

    def __init__(self, failed_label: str, behind: list[str], cause: BaseException):
        shown = ", ".join(behind[:4]) + (f" and {len(behind) - 4} more" if len(behind) > 4 else "")
        super().__init__(
            f"offload: the optimizer update of {failed_label} failed ({type(cause).__name__}: {cause}); it"
            + (f" and {len(behind)} unit(s) queued after it ({shown})" if behind else "")
            + " are not updated, or only in part, while the units before were: the states are part-updated, so "
            "this run can neither train on nor be saved. Load the last checkpoint (rt.load_checkpoint in this "
            "process, or resume in a new one)")


@dataclass(frozen=True)
class Run:
    """Shard elements [lo, hi) stepped with one set of hyperparameters and one step count."""

    lo: int
    hi: int
    hyper: dict  # the param group's values (lr, betas, ...): a copy taken at step()
    step: int


@dataclass
class UnitUpdate:
    unit: object  # ShardedUnit
    runs: list[Run]
    grad_scale: float
    zero_moments: bool  # the unit's first step: its optimizer states start at their fill value (no read)
    param_overwrite: bool  # the step writes every element of the compute-dtype param chunk (no read)
    grads_ready: cf.Future | None = None  # the last gradient work queued before step() (a later zero_grad
    #                                       waits for this update: reading unit.grads on the lane would deadlock)
    grad_chunks: list | None = None  # that work's chunk by chunk, when it is a reduce's drain (unit.grad_chunks)
    done: cf.Future = field(default_factory=cf.Future)
    chunks: frozenset | None = None  # indices of the chunks this update steps (None: every chunk)
    # speculative (speculation.py): the master and optimizer states are written beside their old bytes, in the
    # shard's spare slot: `exchanged` lists the specs whose slots the lane exchanged, `written` their writes
    speculative: bool = False
    exchanged: list = field(default_factory=list)
    written: list = field(default_factory=list)
    # queued by opt.step() after the backward: the next forward gathers the unit right after its update, so each
    # param chunk written is offered to it (OptimizerPipeline.param_written) before it goes home
    hand_over: bool = False
    _wanted: list | None = field(default=None, repr=False)  # (wanted())

    def grads_written(self, c: Chunk) -> cf.Future | None:
        """What reading chunk c's gradient waits for: the drain's chunk (the reduce writes the chunks in order: the
        update of a unit's first chunks overlaps the writing of its last), or, for the last chunk, the whole gradient
        work (a drain failing after its last chunk fails the update, as it did when every chunk waited for it)."""
        if self.grad_chunks is None or c.index == len(self.grad_chunks) - 1:
            return self.grads_ready
        return self.grad_chunks[c.index]

    def wanted(self) -> list[tuple[object, object, LeaseMode]]:
        """(lease slot, state kind, mode) of every state chunk the kernel touches: the gradient, the family's
        states (slot: the StoredState), the master and the compute-dtype param. The same for every chunk: made once."""
        if self._wanted is None:
            shards = self.unit.shards
            moments = LeaseMode.OVERWRITE if self.zero_moments else LeaseMode.UPDATE
            want = [(StateKind.GRAD, StateKind.GRAD, LeaseMode.READ)]
            want += [(s, s, moments) for s in shards.schema.states]
            if shards.master_is_param:
                want.append((StateKind.MASTER, StateKind.PARAM, LeaseMode.UPDATE))
            else:
                want.append((StateKind.MASTER, StateKind.MASTER, LeaseMode.UPDATE))
                want.append((StateKind.PARAM, StateKind.PARAM,
                             LeaseMode.OVERWRITE if self.param_overwrite else LeaseMode.UPDATE))
            self._wanted = want
        return self._wanted

    def runs_in(self, c: Chunk) -> list[tuple[int, int, Run]]:
        """(chunk-local lo, hi, run) for the runs that meet chunk c."""
        out = []
        for r in self.runs:
            a, b = max(r.lo, c.lo), min(r.hi, c.hi)
            if a < b:
                out.append((a - c.lo, b - c.lo, r))
        return out


@dataclass
class _Item:
    update: UnitUpdate
    chunk: Chunk
    runs: list
    last_of_unit: bool
    leases: dict = field(default_factory=dict)  # StateKind (or "out") -> lease
    wants: list = field(default_factory=list)  # (lease slot, ShardSpec, mode) of each state chunk it touches

    @classmethod
    def of(cls, u: UnitUpdate, c: Chunk) -> "_Item":
        """Chunk c of update u, its specs made once (a chunk the update does not step: no runs, no wants)."""
        runs = u.runs_in(c)
        specs = [(slot, u.unit.shards.spec(kind, c), mode) for slot, kind, mode in u.wanted()] if runs else []
        return cls(u, c, runs, False, wants=specs)


class OptimizerPipeline:
    def __init__(self, ctx: LaneContext, read_ahead: int):
        self.ctx = ctx
        self.read_ahead = read_ahead  # chunks leased ahead of the one being stepped (0: none)
        self._ahead: dict = {}  # ShardKey -> (READ lease, bytes), taken between steps (read_states_ahead)
        self._ahead_lock = threading.Lock()
        # updates queued one by one in the backward (Config.update_in_backward), each lane item runs the one that
        # is needed first: in the backward the oldest; once it is over, the next forward's order
        self._pending: list[tuple[int, UnitUpdate]] = []
        self._pending_lock = threading.Lock()
        self._sequence = 0
        self._forward_rank: dict | None = None  # unit uid -> position in the next forward (None: oldest first)
        self._order: list = []  # the units of the last read_states_ahead, in the order their updates come
        self._allowance = 0
        # (unit, chunk, spec) -> None, on this lane after an update of a hand_over UnitUpdate wrote the param chunk
        # and before its lease goes (the schedule keeps those bytes for the next gather: Schedule.hand_over)
        self.param_written = None

    # ---- between steps: the next update's first states, read while the backward computes -------------
    def read_states_ahead(self, units: list, allowance: int) -> None:
        """Queue, on the optimizer lane (after the last update has released them), READ leases on the fp32
        master and moments of `units`' chunks in this order, within `allowance` bytes of the cpu budget and
        only where there is room now. States that are resident, not on nvme, or not yet created (a unit's
        first step starts its moments at zero) are skipped: there is nothing to read."""
        if self.read_ahead and allowance > 0 and units:
            self._order, self._allowance = list(units), allowance  # the one-unit updates keep reading in this order
            self.ctx.lanes.optimizer.submit("state read-ahead", self._read_states_ahead, list(units), allowance)

    def _read_states_ahead(self, units: list, allowance: int) -> None:
        states = self.ctx.states
        resident = states.resident_keys()
        with self._ahead_lock:
            held = sum(n for _, n in self._ahead.values())  # (each backward of an accumulation asks again)
            for unit in units:
                if not unit.shards.moments_registered:
                    continue
                kinds = list(unit.shards.schema.states)
                if not unit.shards.master_is_param:  # (an fp32 param is its master: the backward gathers it)
                    kinds.insert(0, StateKind.MASTER)
                for c in unit.shards.chunks:
                    for kind in kinds:
                        spec = unit.shards.spec(kind, c)
                        if spec.home is not Tier.NVME or spec.key in resident or spec.key in self._ahead:
                            continue
                        staged = states.staged_nbytes(spec)
                        if held + staged > allowance:
                            return
                        lease = states.lease(spec, Use.HOST, LeaseMode.READ, block=False)
                        if lease is None:
                            return  # no room now: the update reads the rest itself
                        self._ahead[spec.key] = (lease, staged)
                        held += staged

    def _take_ahead(self, key):
        with self._ahead_lock:
            return self._ahead.pop(key, (None, 0))[0]

    def drop_states_read_ahead(self, keep=frozenset()) -> None:
        """Give back the states read ahead (READ leases: nothing is written), except `keep`'s keys. Call with
        the optimizer lane idle, or from it."""
        with self._ahead_lock:
            dropped = [self._ahead.pop(k)[0] for k in list(self._ahead) if k not in keep]
        for lease in dropped:
            lease.release()

    def take_back_read_ahead(self, keys, then) -> None:
        """A speculative update taken back: the states read ahead under `keys` hold its new bytes, which are not the
        shard's value any more. They are given back (their releases waited for) and `then()` (its slots exchanged
        back) runs before the lane may read any of them ahead again: the table's lock is held throughout (a read
        ahead started in between read the new bytes again). Neither the releases nor the exchange take it."""
        with self._ahead_lock:
            dropped = [self._ahead.pop(k)[0] for k in keys if k in self._ahead]
            cf.wait([lease.release() for lease in dropped])
            then()

    def submit(self, updates: list[UnitUpdate]) -> None:
        """Queue the updates (in order) on the optimizer lane; each unit's `update` is its future. States read
        ahead for chunks they do not step are given back first."""
        for u in updates:
            u.unit.on_update_queued(u.done)
        if updates:
            self.ctx.lanes.optimizer.submit("optimizer step", self._run, updates, False)

    def submit_one(self, update: UnitUpdate) -> None:
        """Queue one unit's update from the backward; see prefer_forward_order for which runs first."""
        update.unit.on_update_queued(update.done)
        with self._pending_lock:
            self._pending.append((self._sequence, update))
            self._sequence += 1
        self.ctx.lanes.optimizer.submit("optimizer step", self._run_next)

    def prefer_forward_order(self, order: list | None) -> None:
        """Run the queued one-unit updates in `order` (unit uids: the next forward's, once the backward is over:
        the forward waits for its first units' updates first), or oldest first (None, while a backward runs)."""
        with self._pending_lock:
            self._forward_rank = None if order is None else {uid: k for k, uid in enumerate(order)}

    def _run_next(self) -> None:
        with self._pending_lock:
            rank = self._forward_rank
            queued = sorted(self._pending, key=lambda p: (p[0],) if rank is None else (
                rank.get(p[1].unit.uid, len(rank)), p[0]))
            best = queued[0]
            self._pending.remove(best)
        unit = best[1].unit
        if self._allowance and self.read_ahead:
            # while this unit steps, read the first states of those after it (queued ones first, then, while the
            # backward runs, the units it reaches next): one lane item per unit, so the run's own read-ahead stops
            # at its last chunk
            later = self._order[self._order.index(unit) + 1:] if rank is None and unit in self._order else []
            self._read_states_ahead(list(dict.fromkeys([p[1].unit for p in queued[1:]] + later)), self._allowance)
        self._run([best[1]], keep_read_ahead=True)  # (the states read ahead are the next units')

    # ---- on the optimizer lane ------------------------------------------------------------------
    def _run(self, updates: list[UnitUpdate], keep_read_ahead: bool) -> None:
        items: list[_Item] = []
        for u in updates:
            mine = [_Item.of(u, c) for c in u.unit.shards.chunks if u.chunks is None or c.index in u.chunks]
            mine = [it for it in mine if it.runs]
            if mine:
                mine[-1].last_of_unit = True
                items.extend(mine)
            else:
                u.done.set_result(None)  # nothing of this unit lives in this rank's shard
        if self._ahead and not keep_read_ahead:  # states read ahead for chunks this update does not step go back
            # first (the lane's room)
            self.drop_states_read_ahead(keep={spec.key for it in items for _, spec, _ in it.wants})
        try:
            self._run_items(items)
        except BaseException:
            self.drop_states_read_ahead()
            raise
        if not keep_read_ahead:
            self.drop_states_read_ahead()  # (nothing is left: every state kept was stepped)

    def _run_items(self, items: list[_Item]) -> None:
        failed: BaseException | None = None
        for k, item in enumerate(items):
            if failed is not None:
                self._release(item)
                if item.last_of_unit:
                    item.update.done.set_exception(failed)
                continue
            try:
                self._lease(item, block=True)
                for nxt in items[k + 1:k + 1 + self.read_ahead]:
                    if not self._lease(nxt, block=False):
                        break  # no room now: later chunks wait their turn (ordered back-off)
                self._step(item)
                self._offer_param(item)
            except BaseException as e:  # noqa: BLE001 - every later unit's future carries it
                failed = e
                if isinstance(e, Exception) and not isinstance(e, UpdateFailed):  # (an interrupt stays itself)
                    behind = list(dict.fromkeys(it.update.unit.label for it in items[k + 1:]
                                                if it.update.unit is not item.update.unit))
                    failed = UpdateFailed(item.update.unit.label, behind, e)
                    failed.__cause__ = e
                self._release(item)
                if item.last_of_unit:
                    item.update.done.set_exception(failed)
                continue
            written = self._release(item)
            if item.update.speculative:
                item.update.written.extend(written)  # a miss takes the slots back once these landed
            if item.last_of_unit:
                item.update.done.set_result(None)
        if failed is not None:
            raise failed

    def _lease(self, item: _Item, block: bool) -> bool:
        """Lease what `item` still lacks; block=False: stop at the first that has no room now. True when it
        has every lease."""
        for slot, spec, mode in item.wants:
            if slot in item.leases:
                continue
            if slot is StateKind.GRAD:
                grads = item.update.grads_written(item.chunk)
                if grads is not None and not grads.done():
                    if not block:
                        return False  # a reduce is still writing the gradient: read it once that is over
                    grads.result()  # the kernel reads the gradient: the reduce must be over
                elif grads is not None:
                    grads.result()  # a failed reduce fails the update
            lease = self._take_ahead(spec.key) if self._ahead else None  # (only this lane fills the table)
            if lease is not None and mode is LeaseMode.UPDATE:
                lease.upgrade()  # read between steps; the kernel writes it now
            else:
                if lease is not None:
                    lease.release()  # (the moments of a unit's first step start at zero: not read)
                lease = self.ctx.states.lease(spec, Use.HOST, mode, block=block)
                if lease is None:
                    return False
            item.leases[slot] = lease
        return True

    def _step(self, item: _Item) -> None:
        u = item.update
        schema: Schema = u.unit.shards.schema
        name = f"{schema.name}:{u.unit.uid or '<root>'}[{item.chunk.index}]" if recording() else ""
        t = {slot: lease.wait() for slot, lease in item.leases.items()}  # the kernel needs every state now
        if u.speculative:
            self._write_beside(item)
        inject.pause(Queue.OPTIMIZER)  # a slow kernel (tests)
        with self.ctx.meter.working(self.ctx.lanes.optimizer.lane, name):
            states = {s.name: t[s] for s in schema.states}
            if u.zero_moments:
                schema.fill_(states)
            else:  # an optimizer's first step of these elements: their moments start at zero, whatever an earlier
                for a, b, r in item.runs:  # optimizer over these parameters left in the unit's states (torch: a new
                    if r.step == 1:  # optimizer's state starts empty)
                        schema.fill_range_(states, a, b)
            out = t.get(StateKind.PARAM)
            if out is not None and u.param_overwrite:
                _zero_outside(out, item.runs)  # padding: the kernel writes only stepped elements
            for a, b, r in item.runs:
                schema.step_chunk(t[StateKind.MASTER], t[StateKind.GRAD], states, out, a, b, r.hyper, r.step,
                                  u.grad_scale)

    def _offer_param(self, item: _Item) -> None:
        """The kernel wrote `item`'s compute-dtype param chunk: while the lease still holds those bytes in memory,
        offer them to the next forward's gather (else it would read back from nvme what this release writes)."""
        if item.update.hand_over and self.param_written is not None:
            for slot, spec, _ in item.wants:
                if spec.key.kind is StateKind.PARAM and slot in item.leases:
                    self.param_written(item.update.unit, item.chunk, spec)

    def _write_beside(self, item: _Item) -> None:
        """A speculative update (speculation.py): its master and optimizer states are read (waited); exchange each
        one's slot with its spare's, so the write-behind lands beside the old bytes, which the spare now holds."""
        u, shards, states = item.update, item.update.unit.shards, self.ctx.states
        for slot, spec, _ in item.wants:
            if slot is StateKind.MASTER or slot in shards.schema.states:
                if states.is_resident(spec):  # chosen when not resident; residency changes only at a step
                    raise RuntimeError(f"offload: {spec.key} became resident under a speculative update")
                states.exchange(spec, spec.spare())
                u.exchanged.append(spec)

    @staticmethod
    def _release(item: _Item) -> list:
        out = [lease.release() for lease in item.leases.values()]  # write-behind: the lane goes on; moves of one
        item.leases.clear()  # shard stay in order
        return out


def _zero_outside(t: torch.Tensor, runs: list) -> None:
    at = 0
    for a, b, _ in sorted(runs, key=lambda x: x[0]):
        if a > at:
            t[at:a].zero_()
        at = max(at, b)
    if at < t.numel():
        t[at:].zero_()
