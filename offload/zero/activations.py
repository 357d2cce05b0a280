"""Activation offload: tensors autograd saves in the forward leave the compute device for the store's cpu tier
or an nvme swap file, and come back for the backward, read ahead in the reverse of the order they left.

    offloader = ActivationOffloader(store, device, (Tier.NVME,), min_bytes, lane, meter, reserve, is_param)
    with offloader.forward():           # the runtime opens it around each wrapped model's forward
        loss = model(batch)             # saved tensors >= min_bytes: copied out by the lane, the original dropped
    loss.backward()                     # each comes back when autograd asks (the next ones already on their way)

What moves: every tensor autograd saves while the block is open (torch.autograd.graph.saved_tensors_hooks) that
is on the compute device, holds at least `min_bytes`, is contiguous, and is not a parameter's bytes (`is_param`:
the units' gathered buffers come back by their own gather). With activation checkpointing (torch.utils.checkpoint
non-reentrant, as a Hugging Face model's gradient_checkpointing_enable() uses) the tensors saved outside the
checkpointed blocks are each block's inputs: those travel, the activations recomputed in the backward never leave.
From the second forward on, its last KEEP_LAST such tensors stay (the backward needs them first: moving them frees
nothing at the peak and costs a round trip). The bytes move exactly: the backward sees bit for bit what the forward
saved. Saved-tensor hooks turn off torch's check of a saved tensor changed in place; it is made here instead: a
tensor left in place, as torch; a moved one changed before its copy out finished (the copy may hold either value),
or changed while its original (or, for a view, its base) still lives at the backward, is refused with torch's
message.

Budgets: a tensor moves only if the store has room for it beside what the runtime's lanes need to make progress
(`reserve()` bytes of the cpu tier; the states' own pipeline must never wait on activations, which are freed only
in the backward); else it stays where it is, counted in stats()["kept_bytes"]. `homes` are the tiers tried in
order, per tensor: Config.activations "cpu" is (cpu,), "nvme" (nvme,), "auto" (cpu, nvme): the cpu tier while it
has room, the swap file after it (without an nvme_path, the cpu tier alone). Shards of the "activations" class
are removed from the store as soon as they are back (their swap slots are reused the next step).

Where the bytes are, per saved tensor (`_Ticket`): OUT (the lane is copying it, piece by piece, into the store;
the original is held by that work) -> STORED (the store holds its pieces: cpu tier or swap file; or, when the lane
found no room after all, `kept`: the original itself) -> BACK (the lane has copied the pieces into a fresh
compute-device tensor and removed their shards) -> the tensor belongs to autograd (the ticket keeps no reference:
it is freed with its node's saved variables, as an unmoved one would be). A ticket whose handle autograd dropped
unused (a forward without backward) has its shards removed by the lane. Counters (`stats`) are written by both
threads, under the lock.

The compute device's peak, by design: the forward holds at most OUT_WINDOW originals whose copies out are
unfinished (past that it waits, so a slow lane or disk cannot pile them up), the backward at most READ_AHEAD
tensors back early; a checkpointed model's peak is then its states' working set plus one block's activations
plus those, whatever its depth (tests/test_activation_offload.py asserts it against block sizes).
"""
from __future__ import annotations

import collections
import concurrent.futures as cf
import contextlib
import threading
import weakref
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

from .. import inject
from ..device import record, retire, sync, wait
from ..ops.copy import copy_ as host_copy
from ..store import LeaseMode
from ..store.arena import ArenaFullError
from ..store.lease import resolved
from ..store.residency import Tier
from ..store.swap_file import SwapSpaceError, page_bytes
from ..telemetry import Queue
from .lanes import WorkLane

__all__ = ["ActivationKey", "ActivationOffloader", "READ_AHEAD", "WRITE_WINDOW"]

READ_AHEAD = 2  # saved tensors brought back ahead of the one autograd asks for (bounds the device memory it takes)
WRITE_WINDOW = 4  # pieces written to nvme at once: bounds the staging the copies out take from the cpu tier
OUT_WINDOW = 2  # saved tensors whose copies out are unfinished at once: the forward waits past that, so a slow
#                 lane (a slow disk behind it) cannot pile the originals up on the compute device
MIN_PIECE_BYTES = 1 << 20  # a piece is at least this (or the store's staging slot, when larger)
# the forward's last saved tensors (by the previous forward's count) stay where they are: the backward asks for them
# first, so moving them frees no device memory at its peak (the read-ahead would bring them straight back) and
# costs a round trip; the loss's logits, the largest, are among them
KEEP_LAST = READ_AHEAD + 1


@dataclass(frozen=True)
class ActivationKey:
    """One piece of a saved tensor in the store: the forward it was saved in (from 0), its place in that forward,
    and the piece (a tensor moves in pieces of at most a staging slot, so the cpu tier never needs one range as
    large as the tensor, and nvme staging stays bounded)."""

    forward: int
    index: int
    piece: int = 0


_HANDED_OVER = resolved(None)  # ticket.back once the tensor is autograd's
_LOST = resolved(None)  # ticket.back once its copy back failed (raised where autograd asked; the shards are gone)


@dataclass(frozen=True)
class _Failed:
    """What a copy back that raised returns through the lane: the error, raised where autograd asks (not the lane's
    own failure: a user who catches it, say an out-of-memory batch skipped, is not told again at the next drain)."""

    error: BaseException


@dataclass(eq=False)
class _Ticket:
    keys: list  # ActivationKey per piece
    bounds: list  # (first, end) element of each piece
    nbytes: int
    home: Tier  # where its pieces live: the cpu tier or the swap file
    out: cf.Future | None = None  # resolves once every piece is in the store (the lane's copy out)
    back: cf.Future | None = None  # the lane's copy back into a fresh tensor: issued once, by unpack or read-ahead;
    #                                _HANDED_OVER once autograd has it (the ticket outlives it: no reference kept)
    kept: torch.Tensor | None = None  # the lane found no room after all: the tensor itself, never moved
    modified: bool = False  # the original was changed in place before its copy out finished (lane)


@dataclass(eq=False)
class _Saved:
    """What autograd holds in place of a moved tensor."""

    ticket: _Ticket
    shape: torch.Size
    dtype: torch.dtype
    version: int  # the original's version counter when autograd saved it (torch's check, which hooks turn off)
    # the original and, for a view, its base (it shares the view's version counter and may outlive it), while
    # something else keeps them: changed in place since, it is refused
    aliases: tuple[weakref.ref, ...]
    value: torch.Tensor | None = None  # once back (a second unpack, retain_graph, returns it again)

    def live_alias(self) -> torch.Tensor | None:
        return next((t for t in (ref() for ref in self.aliases) if t is not None), None)


class _Anonymous:
    """A key for the forwards opened without a model (weakly referenced, as a model is)."""


@dataclass(eq=False)
class _Unmoved:
    """What autograd holds for a saved tensor that stays where it is: it, and its version when saved."""

    tensor: torch.Tensor
    version: int


@dataclass
class ActivationStats:
    moved_bytes: int = 0  # saved bytes copied out to the store
    moved_to_nvme_bytes: int = 0  # the part of them that went on to the swap file
    kept_bytes: int = 0  # saved bytes that qualified but stayed (no room in the budgets)
    moved_tensors: int = 0
    left_last_bytes: int = 0  # the forward's last KEEP_LAST tensors, needed first by the backward: not moved
    read_ahead_hits: int = 0  # tensors already back (or on their way) when autograd asked


class ActivationOffloader:
    """See the module docstring."""

    def __init__(self, store, device: torch.device, homes: tuple[Tier, ...], min_bytes: int, lane: WorkLane, meter,
                 reserve, is_param, setting: str | None = None):
        bad = [h for h in homes if h not in (Tier.CPU, Tier.NVME)] or ([] if homes else ["none"])
        if bad:
            raise ValueError(f"activations go to the cpu tier or nvme, not {bad}")
        self.store = store  # the TieredStore
        self.device = device
        self.homes = tuple(homes)  # tried in this order for each tensor
        self.setting = setting or homes[0].value  # Config.activations, for the report
        self.min_bytes = max(1, int(min_bytes))
        self.lane = lane  # copies out, reads back and removals run here, in order
        self.meter = meter
        self.reserve = reserve  # () -> cpu-tier bytes the runtime's lanes must always find free
        self.is_param = is_param  # (tensor) -> True when its bytes are a parameter's
        self.stats = ActivationStats()
        self._forward_no = -1
        self._count = 0
        # per model whose forward opens the block: the qualifying tensors its last forward under grad saved
        self._last_counts: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._keep_from: int | None = None  # this forward's first index kept in place (KEEP_LAST), if known
        self._owners: list = []  # the models whose forwards are open, outermost first
        self._anonymous = _Anonymous()  # the owner of forward() blocks opened without a model
        self._depth = 0
        self._reserved = 0
        self._hooks = None
        self._order: dict[int, list[weakref.ref]] = {}  # forward -> its moved tensors' handles, in pack order
        self._seen = WeakIdKeyDictionary()  # tensor -> (its version, handle): one copy of a tensor saved twice
        self._dropped: collections.deque = collections.deque()  # tickets autograd dropped (appended by finalizers)
        self._writes: collections.deque = collections.deque()  # the lane's write-behinds in flight (nvme), oldest first
        self._outs: collections.deque = collections.deque()  # copies out not known finished, oldest first (training
        #                                                      thread): each holds its original on the device
        self._lock = threading.Lock()
        self._forward_demand = 0  # cpu-tier bytes this forward's saved tensors took or wanted (training thread)
        self._forward_window = 0  # and the staging of its writes to the swap file
        self.cpu_demand = 0  # the most any forward so far took or wanted: the schedule keeps it free (cpu_room)

    # ---- the forward's block -------------------------------------------------------------------
    def enter(self, owner: nn.Module | None = None) -> None:
        """Opens the saved-tensor hooks (nested calls count; the outermost starts a new forward). `owner`: the model
        whose forward this is. Its forward still open means that forward was cut short where no post-hook ran
        (a KeyboardInterrupt: torch runs always-call hooks for an Exception only): the block starts afresh."""
        if owner is not None and any(o is owner for o in self._owners):
            self._close_block()
        if self._depth == 0:
            last = self._last_counts.get(self._anonymous if owner is None else owner)
            self._keep_from = None if last is None else last - KEEP_LAST
            self._forward_no += 1
            self._count = 0
            self._forward_demand = self._forward_window = 0
            self._seen = WeakIdKeyDictionary()
            self._reserved = self.reserve()  # the lanes' needs change only with the units (once per forward)
            self.flush_dropped()
            self._prune()
            self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
            self._hooks.__enter__()
        self._depth += 1
        self._owners.append(owner)

    def exit(self) -> None:
        if self._depth == 0:
            return
        self._depth -= 1
        owner = self._owners.pop() if self._owners else None
        if self._depth == 0:
            self._close_block()
            self.cpu_demand = max(self.cpu_demand, self._forward_demand + self._forward_window)
            if self._count:  # (a forward under no_grad saves nothing: it says nothing of the next)
                self._last_counts[self._anonymous if owner is None else owner] = self._count

    def _close_block(self) -> None:
        hooks, self._hooks = self._hooks, None
        if hooks is not None:
            hooks.__exit__(None, None, None)
        self._depth, self._owners = 0, []

    @contextlib.contextmanager
    def forward(self):
        self.enter()
        try:
            yield
        finally:
            self.exit()

    # ---- pack: a saved tensor leaves -------------------------------------------------------------
    def _qualifies(self, t: torch.Tensor) -> bool:
        return (t.device == self.device and t.layout is torch.strided and t.is_contiguous()
                and t.numel() * t.element_size() >= self.min_bytes
                and not isinstance(t, nn.Parameter) and not self.is_param(t))

    def _piece_bytes(self) -> int:
        return max(self.store.staging_slot, MIN_PIECE_BYTES)

    def _cpu_bytes(self, nbytes: int) -> int:
        """What a saved tensor of `nbytes` takes of the cpu tier in it: every piece, until the backward."""
        return sum(page_bytes(min(self._piece_bytes(), nbytes - lo)) for lo in range(0, nbytes, self._piece_bytes()))

    def _note_demand(self, nbytes: int, home: Tier) -> None:
        """A forward's claim on the cpu tier: the pieces held there, plus (once) the window of pieces staged at
        once on their way to the swap file."""
        if home is Tier.CPU:
            self._forward_demand += self._cpu_bytes(nbytes)
        else:
            self._forward_window = WRITE_WINDOW * self.store.staged_nbytes(self._piece_bytes())

    def _has_room(self, nbytes: int, home: Tier) -> bool:
        cpu = self.store.stats()["cpu"]
        if home is Tier.CPU:  # every piece is held until the backward
            taken = self._cpu_bytes(nbytes)
        else:  # a piece's staging at a time
            taken = self.store.staged_nbytes(min(nbytes, self._piece_bytes()))
        spill = 0
        if home is Tier.CPU and Tier.NVME in self.homes:  # ("auto") the cpu tier keeps the room the swap file's
            spill = WRITE_WINDOW * self.store.staged_nbytes(self._piece_bytes())  # writes stage through
        return cpu["capacity"] - cpu["bytes_in_use"] - taken - spill >= self._reserved

    def _pack(self, t: torch.Tensor):
        if not self._qualifies(t):
            return _Unmoved(t, t._version)
        seen = self._seen.get(t)
        if seen is not None and seen[0] == t._version:  # the same tensor saved again (a mask, rotary cos/sin)
            handle = seen[1]()
            if handle is not None:
                return handle
        nbytes = t.numel() * t.element_size()
        index = self._count
        self._count += 1
        if self._keep_from is not None and index >= self._keep_from:
            with self._lock:  # (the lane counts too)
                self.stats.left_last_bytes += nbytes
            return _Unmoved(t, t._version)  # needed first by the backward: see KEEP_LAST
        ticket = self._claim(index, t, nbytes)
        # what it takes of the cpu tier (in its home), or would have taken in the first (kept for want of room)
        self._note_demand(nbytes, ticket.home if ticket is not None else self.homes[0])
        if ticket is None:
            with self._lock:  # (the lane counts too)
                self.stats.kept_bytes += nbytes
            return _Unmoved(t, t._version)
        ready = record(self.device)  # the forward's kernels that wrote t, queued before this point
        version = t._version
        ticket.out = self.lane.submit("activation out", self._copy_out, ticket, t, ready, version)
        self._bound_outs(ticket.out)
        aliases = (weakref.ref(t),) if t._base is None else (weakref.ref(t), weakref.ref(t._base))
        saved = _Saved(ticket, t.shape, t.dtype, version, aliases)
        weakref.finalize(saved, self._dropped.append, ticket)  # autograd dropped it: its shard goes (flush_dropped)
        self._seen[t] = (t._version, weakref.ref(saved))
        with self._lock:
            self._order.setdefault(self._forward_no, []).append(weakref.ref(saved))
        return saved

    def _bound_outs(self, out: cf.Future) -> None:
        """At most OUT_WINDOW copies out unfinished: past that, the forward waits for the oldest (its original is
        then freed), so what the forward holds on the device is bounded whatever the lane's speed. A copy that
        failed is not raised here: the backward raises it where it asks for the tensor (its copy back)."""
        self._outs.append(out)
        while self._outs and self._outs[0].done():
            self._outs.popleft()
        while len(self._outs) > OUT_WINDOW:
            oldest = self._outs.popleft()
            if not oldest.done():
                with self.meter.waiting(Queue.ACTIVATION):
                    cf.wait([oldest])  # the lane is OUT_WINDOW tensors behind: its original must go before more pile up

    def _claim(self, index: int, t: torch.Tensor, nbytes: int) -> _Ticket | None:
        """Shards for `t`'s pieces in the first of `homes` with room now, or None when none has."""
        step = max(1, self._piece_bytes() // t.element_size())
        bounds = [(lo, min(lo + step, t.numel())) for lo in range(0, t.numel(), step)]
        keys = [ActivationKey(self._forward_no, index, i) for i in range(len(bounds))]
        for home in self.homes:
            if not self._has_room(nbytes, home):
                continue
            done = []
            try:
                for key, (lo, hi) in zip(keys, bounds):
                    self.store.register(key, hi - lo, t.dtype, home=home.value, tier_class="activations", timeout=0,
                                        zero=False)  # an OVERWRITE lease fills it next
                    done.append(key)
            except (ArenaFullError, SwapSpaceError):  # ArenaBusyError included: no room now, try the next home
                for key in done:
                    self.store.unregister(key)
                continue
            return _Ticket(keys, bounds, nbytes, home)
        return None

    def _lease_out(self, key: ActivationKey):
        """An OVERWRITE lease of a piece's cpu bytes (nvme: a staging slot, at most WRITE_WINDOW pieces in flight;
        while there is no room, after the oldest write of ours lands); None when there is none and nothing of
        ours is in flight to free one."""
        while True:
            while self._writes and (self._writes[0].done() or len(self._writes) >= WRITE_WINDOW):
                self._writes.popleft().result()  # the oldest write-behind lands: its staging slot is free again
            lease = self.store.lease(key, Tier.CPU, LeaseMode.OVERWRITE, block=False)
            if lease is not None:
                return lease
            if not self._writes:
                return None
            self._writes.popleft().result()  # no room: wait for a write of ours to free a slot, then again

    def _copy_out(self, ticket: _Ticket, t: torch.Tensor, ready, version: int) -> None:
        """On the lane: t's pieces -> their cpu bytes; each lease's release writes its piece home (nvme) behind.
        No room after all (the states took it meanwhile): the tensor stays as it is, in the ticket."""
        flat = t.view(-1)
        if t.is_cuda:
            wait(ready, self.device)  # the lane's stream: t's bytes are written by kernels queued before pack
        for key, (lo, hi) in zip(ticket.keys, ticket.bounds):
            lease = self._lease_out(key)
            if lease is None:
                for k in ticket.keys:
                    self.store.unregister(k)
                ticket.kept = t
                with self._lock:
                    self.stats.kept_bytes += ticket.nbytes
                return
            try:
                buf = lease.wait()
                if t.is_cuda:
                    buf.copy_(flat[lo:hi], non_blocking=True)
                    sync(record(self.device))  # the write-behind reads buf, and t may be freed once this returns
                else:
                    host_copy(buf, flat[lo:hi])
                inject.pause(Queue.ACTIVATION)  # a slow copy (tests): the forward goes on meanwhile
            finally:
                released = lease.release()
            if ticket.home is Tier.NVME:
                self._writes.append(released)
        ticket.modified = t._version != version  # changed in place meanwhile: the copy may hold either value
        with self._lock:
            self.stats.moved_bytes += ticket.nbytes
            self.stats.moved_tensors += 1
            if ticket.home is Tier.NVME:
                self.stats.moved_to_nvme_bytes += ticket.nbytes

    # ---- unpack: autograd asks for it back --------------------------------------------------------
    def _unpack(self, saved):
        if isinstance(saved, _Unmoved):
            _check_version(saved.tensor, saved.version, saved.tensor._version)
            return saved.tensor
        ticket = saved.ticket
        alias = saved.live_alias()  # (checked at every unpack: between two backwards of a retained graph too)
        if ticket.modified or (alias is not None and alias._version != saved.version):
            _check_version(alias, saved.version, saved.version + 1 if alias is None else alias._version)
        if saved.value is not None:
            return saved.value
        if ticket.back is _LOST:
            raise RuntimeError("offload: this saved activation could not be brought back in an earlier backward (the "
                               "error was raised there); run the forward again")
        if ticket.back is not None:
            with self._lock:
                self.stats.read_ahead_hits += 1
        self._read_ahead(ticket.keys[0])
        fut = self._bring_back(saved)
        if not fut.done():
            with self.meter.waiting(Queue.ACTIVATION):
                cf.wait([fut])  # autograd needs this tensor now
        t = fut.result()
        if isinstance(t, _Failed):
            with self._lock:  # the ticket lets go of the error: raised through autograd, it holds the step's graph
                ticket.back = _LOST
            raise t.error
        retire(t)  # made on the lane's stream, used and freed on this one
        with self._lock:
            saved.value = t  # held as long as autograd holds `saved` (its node's saved variables), no longer:
            ticket.back = _HANDED_OVER  # the future would keep t alive in the ticket past the node's backward
        return t

    def _bring_back(self, saved: _Saved) -> cf.Future:
        ticket = saved.ticket
        with self._lock:
            if ticket.back is None:
                ticket.back = self.lane.submit("activation back", self._copy_back, ticket, saved.shape, saved.dtype)
            return ticket.back

    def _read_ahead(self, key: ActivationKey) -> None:
        """The next tensors the backward will ask for: those saved just before `key`, newest first."""
        with self._lock:
            handles = self._order.get(key.forward, [])
        issued = 0
        for ref in reversed(handles):
            saved = ref()
            if saved is None or saved.ticket.keys[0].index >= key.index or saved.value is not None:
                continue
            self._bring_back(saved)
            issued += 1
            if issued == READ_AHEAD:
                break

    def _copy_back(self, ticket: _Ticket, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor | _Failed:
        """On the lane: the stored pieces -> a fresh compute-device tensor; the shards are removed (also when it
        fails: nothing else would, the ticket counting as brought back)."""
        left = list(ticket.keys)
        try:
            ticket.out.result()  # the copy out is over (and raises here if it failed)
            if ticket.kept is not None:
                return ticket.kept
            inject.allocation(inject.Site.ACTIVATION_BACK)
            t = torch.empty(shape, dtype=dtype, device=self.device)
            flat = t.view(-1)
            for key, (lo, hi) in zip(ticket.keys, ticket.bounds):
                lease = self.store.lease(key, Tier.CPU, LeaseMode.READ)
                try:
                    buf = lease.wait()
                    if t.is_cuda:
                        flat[lo:hi].copy_(buf, non_blocking=True)
                        sync(record(self.device))  # buf is released (its staging slot reused) right after
                    else:
                        host_copy(flat[lo:hi], buf)
                    inject.pause(Queue.ACTIVATION)
                finally:
                    lease.release()
                self.store.unregister(left.pop(0))
            return t
        except Exception as e:  # noqa: BLE001 - delivered where autograd asks for the tensor
            t = flat = None  # (the error's frame would hold the device tensor)
            if ticket.kept is None:
                for key in left:
                    self.store.unregister(key)
            return _Failed(e)

    # ---- tickets autograd dropped, and the end -----------------------------------------------------
    def flush_dropped(self) -> None:
        """Handles autograd dropped without asking for them back (a forward without a backward): their shards are
        removed by the lane. Called at safe points, never from the finalizer itself (it may run inside any lock)."""
        while self._dropped:
            ticket = self._dropped.popleft()
            with self._lock:
                if ticket.back is not None:  # brought back: the copy back removes the shard
                    continue
            self.lane.submit("activation drop", self._drop, ticket)

    def _drop(self, ticket: _Ticket) -> None:
        try:
            ticket.out.result()
        except Exception:  # noqa: BLE001 - a failed copy out: its leases were released, the shards are still there
            pass
        if ticket.kept is None:
            for key in ticket.keys:
                self.store.unregister(key)

    def _prune(self) -> None:
        with self._lock:
            for fwd in [f for f, hs in self._order.items() if all(h() is None for h in hs)]:
                del self._order[fwd]

    def drain(self) -> None:
        """Wait for every copy and removal asked for so far (raises the first failure)."""
        self._outs.clear()
        self.flush_dropped()
        self.lane.drain()

    def close(self) -> None:
        """Finish the lane's work and stop it; shards still in the store go with the store. Hooks still open (a
        forward cut short where no post-hook ran) are closed: they would pack into a closed store."""
        while self._depth:
            self.exit()
        try:
            self.drain()
        finally:
            self.lane.close()

    def report(self) -> dict:
        """rt.stats()["activations"]: bytes and tensors moved, bytes kept for want of room, bytes of the forward's
        last tensors left in place (KEEP_LAST), read-ahead hits,
        the seconds the training thread waited for one to come back, and the saved tensors the store holds now."""
        return {"home": self.setting, "moved_bytes": self.stats.moved_bytes,
                "moved_to_nvme_bytes": self.stats.moved_to_nvme_bytes,
                "moved_tensors": self.stats.moved_tensors,
                "kept_bytes": self.stats.kept_bytes, "left_last_bytes": self.stats.left_last_bytes,
                "read_ahead_hits": self.stats.read_ahead_hits,
                "wait_s": self.meter.snapshot().wait_s[Queue.ACTIVATION],
                "in_store": self.in_store()}

    def in_store(self) -> int:
        """Saved tensors whose shards the store holds now."""
        return sum(1 for name in self.store.names() if isinstance(name, ActivationKey))


def _check_version(t: torch.Tensor | None, saved: int, now: int) -> None:
    """torch's check of a saved tensor (which saved-tensor hooks turn off): changed in place since it was saved,
    the backward would use other values than the forward did."""
    if now != saved:
        what = "a tensor" if t is None else f"[{t.type()} {list(t.shape)}]"
        raise RuntimeError(
            f"one of the variables needed for gradient computation has been modified by an inplace operation: {what} "
            f"is at version {now}; expected version {saved} instead. (offload: Config.activations saves it through "
            "saved_tensors_hooks, which turn torch's own check off; this one stands in for it. Clone the tensor "
            "before changing it in place.)")
