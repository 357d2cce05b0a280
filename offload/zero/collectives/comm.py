"""Free-function collectives over the data-parallel group (torch.distributed; gloo on CPU, NCCL on GPU), issued
as FSDP2 issues them.

- Async: every collective is issued with async_op=True and returns a `Pending`; the consumer calls wait()
  where it needs the result. On NCCL that makes the caller's current stream wait for the collective's
  stream (the host goes on); on gloo the host blocks until it is over. The same calls on both, so the CPU
  tests run the ordering logic of a GPU run.
- Program order: the gather and reduce lanes each own a group, and both groups share one `ProgramOrder`:
  every collective is given a ticket by the training thread when it asks for the work (in program order,
  the same on every rank) and issued from its lane's work in ticket order across both lanes. A collective
  outside its lane's work, or a lane issuing a later ticket before an earlier one of its own, raises at once:
  on NCCL either could enqueue [reduce k, gather j] on one rank and [gather j, reduce k] on another and hang
  both for ever. A ticket is held until its collective is enqueued. The main group's collectives (the training
  thread's flags and norms) are `inline`: ticketed as they are issued, after every lane collective before them.
- One device rule: every tensor of a collective lives on the group's compute device (NCCL's only device on
  GPU; the CPU on gloo). The hot-path collectives (all_gather_into, reduce_scatter_mean) assert it; the
  training thread's small host values (flags, norms, losses) and the state dict's host shards go through the
  `*_host` helpers, which stage them on the device and back.

World size 1 needs no process group: every function degrades to a local copy and a done Pending (unless
`Group.collectives_at_world_size_1`, a test mode: one rank then issues every collective through its group).
"""
from __future__ import annotations

import collections
import contextlib
import datetime
import threading
import time
import zlib
from dataclasses import dataclass, field

import torch
import torch.distributed as dist


# torch >= 2.12 names them *_single (the *_tensor spellings warn); older releases only have *_tensor.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class OrderError(RuntimeError):
    """A lane issued a collective outside its program order (or outside a lane's work)."""


_lane = threading.local()  # the lane whose work this thread is running (lanes.py sets it around each piece)


@contextlib.contextmanager
def lane_work(name: str):
    """Collectives issued inside are the lane `name`'s (its thread, or the caller where lanes run inline)."""
    previous, _lane.name = getattr(_lane, "name", None), name
    try:
        yield
    finally:
        _lane.name = previous


def in_turn() -> bool:
    """This thread is enqueueing a collective of the runtime's now (inside ProgramOrder.turn) or runs a lane's work."""
    return getattr(_lane, "turns", 0) > 0 or getattr(_lane, "name", None) is not None


class ProgramOrder:
    """One issue order for the collectives of the gather and reduce lanes (their groups share it): a ticket per
    collective, handed out in program order by the training thread when it asks for the work (the same on
    every rank). A lane issues its ticket only after every earlier ticket of the other lane was issued (NCCL
    needs one order across communicators: two ranks enqueueing [reduce k, gather j] and [gather j, reduce k]
    can hang where their kernels cannot run side by side), and never before an earlier ticket of its own
    (that is a lane out of its own order: OrderError). A ticket whose work ends without a collective is
    skipped, so nothing waits for it."""

    def __init__(self, wait_s: float = 600.0):
        self._cond = threading.Condition()
        self._next = 0
        self._pending: dict[int, str] = {}  # ticket -> lane, taken and not yet issued or skipped
        self.wait_s = wait_s  # a wait this long for another lane is a bug: raise, never hang silently
        self.asked = AskedCollectives()

    def ticket(self, lane: str, key: int = -1) -> int:
        """`key`: what the collective is for (a unit's index), recorded in `asked` for the ranks to compare."""
        with self._cond:
            t, self._next = self._next, self._next + 1
            self._pending[t] = lane
            self.asked.note(lane, key)
            return t

    @contextlib.contextmanager
    def turn(self, ticket: int | None, lane: str, what: str, inline: bool = False):
        """Around the call that enqueues a collective: waits for every earlier ticket to be enqueued, and holds
        its own until the call returns (so a later one cannot overtake it between the wait and the enqueue).
        Raises OrderError outside the lane's work or out of the lane's own order. inline: the group's collectives
        are issued by the thread asking for them (the training thread's small ones), each ticketed here."""
        if inline:
            ticket = self.ticket(lane)
        elif getattr(_lane, "name", None) != lane:
            raise OrderError(f"offload: {what}: a collective of the {lane} group was issued from "
                             f"{threading.current_thread().name} outside the {lane} lane's work; that group's "
                             "collectives are issued by its lane only (in program order on every rank; else NCCL "
                             "can hang)")
        deadline = time.monotonic() + self.wait_s
        with self._cond:
            if ticket is None or self._pending.get(ticket) != lane:
                raise OrderError(f"offload: {what}: the {lane} group's collective has no ticket of its own "
                                 f"({ticket}); take one with Group.ticket() when the work is asked for")
            mine = [t for t in self._pending if t < ticket and self._pending[t] == lane]
            if mine and not inline:
                raise OrderError(f"offload: {what}: the {lane} group's collective #{ticket} was issued before its "
                                 f"#{min(mine)}, out of program order (every rank must issue them in the order the "
                                 "training thread asked for them; else NCCL can hang)")
            while any(t < ticket for t in self._pending):  # an earlier collective is enqueued first
                left = deadline - time.monotonic()
                if left <= 0:
                    first = min(self._pending)
                    self._pending.pop(ticket, None)
                    self._cond.notify_all()
                    raise OrderError(f"offload: {what}: waited {self.wait_s:g} s for the {self._pending[first]} "
                                     f"lane's collective #{first}, asked for earlier, to be issued")
                self._cond.wait(left)
        _lane.turns = getattr(_lane, "turns", 0) + 1  # (user_calls.py: torch calls inside are the runtime's own)
        try:
            yield
        finally:  # enqueued (or failed): the next ticket's turn
            _lane.turns -= 1
            with self._cond:
                del self._pending[ticket]
                self._cond.notify_all()

    def skip(self, ticket: int | None) -> None:
        """The work holding `ticket` ended without issuing its collective (it failed first)."""
        if ticket is None:
            return
        with self._cond:
            if self._pending.pop(ticket, None) is not None:
                self._cond.notify_all()


class AskedCollectives:
    """The lanes' collectives asked for since the last take(), in program order: how many per (lane, key) and a
    hash of their order. Every rank must ask for the same ones in the same order: a gather of one unit on one rank
    pairs with another's gather of a different unit of the same size (rank-dependent routing, a forward on one
    rank only) and computes on halves of each, without an error. The runtime compares them over ranks at every
    optimizer step (UpdatePath.sync_used), before anything is updated."""

    def __init__(self):
        self.counts: collections.Counter = collections.Counter()  # (lane, key) -> collectives asked
        self.order_hash = 0
        # set where a pass's check (divergence.py) found the ranks apart: the counts are kept, so the step's own
        # comparison refuses it too; a zero_grad() instead of the step forgets them (the next step starts level)
        self.diverged = False

    def note(self, lane: str, key: int) -> None:
        self.counts[(lane, key)] += 1
        step = zlib.crc32(f"{lane}:{key}".encode())  # (not hash(): str hashes differ between processes)
        self.order_hash = (self.order_hash * 1_000_003 + step) % (1 << 61)

    def take(self) -> tuple[collections.Counter, int]:
        out = self.counts, self.order_hash
        self.counts, self.order_hash = collections.Counter(), 0
        self.diverged = False
        return out

    def forget_divergence(self) -> None:
        if self.diverged:
            self.take()


# ---- the issued sequence, for tests: every rank's must be the same ------------------------------------------
class SequenceRecorder:
    """Every collective issued through this module while recording, in issue order: (group, op, numel, dtype).
    Lanes issue in ticket order (under ProgramOrder.turn), so two ranks that pair their collectives right record
    equal lists. Tests compare them across ranks at teardown (tests/rank_sequences.py)."""

    def __init__(self):
        self.entries: list[tuple[str, str, int, str]] = []
        self.whats: list[str] = []  # what each was for (named where two ranks' lists differ; not compared)
        self._lock = threading.Lock()

    def note(self, group: str, op: str, numel: int, dtype: torch.dtype, what: str) -> None:
        with self._lock:
            self.entries.append((group, op, int(numel), str(dtype).removeprefix("torch.")))
            self.whats.append(what)


_recorders: list[SequenceRecorder] = []


@contextlib.contextmanager
def recording():
    """Record the collectives this process issues inside (every thread's); yields the SequenceRecorder."""
    recorder = SequenceRecorder()
    _recorders.append(recorder)
    try:
        yield recorder
    finally:
        _recorders.remove(recorder)


def record_issued(group: "Group", op: str, t: torch.Tensor, what: str) -> None:
    for recorder in _recorders:  # (empty unless a test records: the hot path pays one list check)
        recorder.note(group.name, op, t.numel(), t.dtype, what)


@dataclass
class Group:
    rank: int = 0
    world_size: int = 1
    pg: object | None = None  # None: the default group
    name: str = "main"  # which of the runtime's groups (the watchdog counts collectives per group)
    watchdog: object | None = None  # watchdog.Watchdog: every collective runs through it
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))  # every collective tensor's device
    order: ProgramOrder | None = None  # a lane's group: issued from its lane's work, in the lanes' ticket order
    # issued by the thread that asks (the training thread), after every lane collective asked for before it: the
    # main group's flags, norms and losses, on another communicator than the lanes' (NCCL: one order across them)
    inline: bool = False
    # Config.collectives_at_world_size_1 (a test mode): one rank issues every collective through `pg` as 8 would
    collectives_at_world_size_1: bool = False

    @property
    def distributed(self) -> bool:
        return self.world_size > 1 or self.collectives_at_world_size_1

    def ticket(self, key: int = -1) -> int | None:
        """The next collective's place in the lanes' program order (training thread, when it asks); `key`: what
        it is for (a unit's index: ProgramOrder.asked)."""
        return self.order.ticket(self.name, key) if self.order is not None and self.distributed and not self.inline \
            else None

    def skip(self, ticket: int | None) -> None:
        """The work given `ticket` ended without its collective (see ProgramOrder.skip)."""
        if self.order is not None:
            self.order.skip(ticket)


def sub_group(group: Group, name: str, order: ProgramOrder, timeout_s: float | None = None) -> Group:
    """A new process group over the same ranks, for one lane's collectives (every rank calls this in the
    same order), issued in `order` (shared by the lanes' groups)."""
    if not group.distributed:
        return Group(group.rank, group.world_size, name=name, device=group.device, order=order)
    return Group(group.rank, group.world_size, lane_process_group(timeout_s), name, group.watchdog, group.device,
                 order, collectives_at_world_size_1=group.collectives_at_world_size_1)


def lane_process_group(timeout_s: float | None = None):
    """A process group over every rank for a lane's collectives. On NCCL its kernels run on NCCL's internal
    streams (async_op=True), created at high priority here, as FSDP2's collective streams: a gather or
    reduce the next unit waits for is not queued behind compute kernels on the GPU's scheduler."""
    kwargs = {} if timeout_s is None else {"timeout": datetime.timedelta(seconds=timeout_s)}
    backend = dist.get_backend()
    if "nccl" in str(backend).lower() and dist.is_nccl_available():
        kwargs["pg_options"] = dist.ProcessGroupNCCL.Options(is_high_priority_stream=True)
    return dist.new_group(backend=backend, **kwargs)


class Pending:
    """A collective in flight (FSDP2's wait_for_unshard half): wait() once where the result is needed.
    `then` runs after the wait, on the same stream (e.g. the mean's division)."""

    def __init__(self, group: Group | None = None, work=None, collective: str = "", what: str = "", then=None):
        self._group, self._work, self._collective, self._what, self._then = group, work, collective, what, then

    def wait(self) -> None:
        work, self._work = self._work, None
        if work is not None:
            _guarded(self._group, self._collective, self._what, work.wait, counted=False)
        then, self._then = self._then, None
        if then is not None:
            then()



def _guarded(group: Group, collective: str, what: str, fn, counted: bool = True):
    if group.watchdog is None:
        return fn()
    return group.watchdog.run(group.name, collective, what, fn, counted=counted)


def _check(group: Group, what: str, *tensors: torch.Tensor) -> None:
    for t in tensors:
        if t.device != group.device:
            raise ValueError(f"offload: {what}: a collective tensor is on {t.device} but the {group.name} group's "
                             f"tensors live on {group.device} (comm.py: one device for every collective; host "
                             "values go through the *_host helpers)")


def _issue(group: Group, ticket: int | None, collective: str, what: str, fn, then=None,
           sent: torch.Tensor | None = None) -> Pending:
    """`sent`: what this rank contributes (recorded while a test records: its numel and dtype)."""
    if group.order is None:
        record_issued(group, collective, sent, what)
        work = _guarded(group, collective, what, fn)
    else:
        with group.order.turn(ticket, group.name, what, inline=group.inline):
            record_issued(group, collective, sent, what)  # in the turn: the order the collectives are enqueued in
            work = _guarded(group, collective, what, fn)
    return Pending(group, work, collective, what, then)


def own_place(group: Group, out: torch.Tensor) -> torch.Tensor:
    """This rank's place in a gather's output (`out`, world_size equal pieces in rank order): a view. Written
    there and passed as the shard, the gather runs in place (FSDP2's copy-in; NCCL copies nothing itself)."""
    n = out.numel() // group.world_size
    return out.view(-1)[group.rank * n:(group.rank + 1) * n]


def in_place(group: Group, out: torch.Tensor, shard: torch.Tensor) -> bool:
    """The shard is its own place in `out` (nothing for the collective to copy locally)."""
    place = own_place(group, out)
    return shard.data_ptr() == place.data_ptr() and shard.numel() == place.numel()


def all_gather_into(group: Group, out: torch.Tensor, shard: torch.Tensor, what: str = "",
                    ticket: int | None = None) -> Pending:
    """Issue: out (world_size * shard.numel()) <- every rank's shard, in rank order. Both on group.device.
    `shard` may be own_place(group, out), written beforehand: the gather then runs in place."""
    if not group.distributed:
        out.copy_(shard)
        return Pending()
    _check(group, what, out, shard)
    shard = shard.contiguous()
    return _issue(group, ticket, "all_gather", what,
                  lambda: _all_gather(out, shard, group=group.pg, async_op=True), sent=shard)


def reduce_scatter_mean(group: Group, full: torch.Tensor, what: str = "", ticket: int | None = None,
                        ) -> tuple[torch.Tensor, Pending]:
    """Issue: this rank's shard of the element-wise mean of `full` over ranks (the division runs at wait()).
    One rank: `full` itself (callers pass a gradient they own and only read the result)."""
    if not group.distributed:
        return full, Pending()
    _check(group, what, full)
    full = full.contiguous()
    out = torch.empty(full.numel() // group.world_size, dtype=full.dtype, device=full.device)
    pending = _issue(group, ticket, "reduce_scatter", what,
                     lambda: _reduce_scatter(out, full, op=dist.ReduceOp.SUM, group=group.pg, async_op=True),
                     then=lambda: out.div_(group.world_size), sent=full)
    return out, pending


def all_reduce_(group: Group, t: torch.Tensor, op: str = "sum", what: str = "") -> torch.Tensor:
    """In place, waited (the training thread needs the value now). `t` on group.device."""
    if group.distributed:
        _check(group, what, t)
        reduce_op = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}[op]
        _issue(group, None, "all_reduce", what,
               lambda: dist.all_reduce(t, op=reduce_op, group=group.pg, async_op=True), sent=t).wait()
    return t


def broadcast_(group: Group, t: torch.Tensor, src: int = 0, what: str = "") -> torch.Tensor:
    """In place, waited. `t` on group.device."""
    if group.distributed:
        _check(group, what, t)
        _issue(group, None, "broadcast", what,
               lambda: dist.broadcast(t, src=src, group=group.pg, async_op=True), sent=t).wait()
    return t


# ---- host values: staged through the compute device (small ones, or one unit at a time) ---------------------
def _staged(group: Group, t: torch.Tensor, run) -> torch.Tensor:
    if t.device == group.device:
        return run(t)
    on_device = run(t.to(group.device))
    t.copy_(on_device)  # blocking: the caller reads the host value next
    return t


def all_reduce_host_(group: Group, t: torch.Tensor, op: str = "sum", what: str = "") -> torch.Tensor:
    """all_reduce_ of a tensor wherever it lives (a host flag vector, a norm, a loss), in place."""
    if not group.distributed:
        return t
    return _staged(group, t, lambda d: all_reduce_(group, d, op, what))


def broadcast_host_(group: Group, t: torch.Tensor, src: int = 0, what: str = "") -> torch.Tensor:
    """broadcast_ of a tensor wherever it lives, in place."""
    if not group.distributed:
        return t
    return _staged(group, t, lambda d: broadcast_(group, d, src, what))


def all_gather_host(group: Group, shard: torch.Tensor, what: str = "") -> torch.Tensor:
    """Every rank's `shard` concatenated, on the host (the state dict's fp32 units: one unit on the device
    at a time)."""
    if not group.distributed:
        return shard.to("cpu", copy=True)
    send = shard.to(group.device)
    out = torch.empty(send.numel() * group.world_size, dtype=send.dtype, device=group.device)
    all_gather_into(group, out, send, what).wait()
    return out.to("cpu")  # blocking: the caller reads it next
