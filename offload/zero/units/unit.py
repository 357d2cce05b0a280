"""One sharded unit: a flat parameter gathered before the unit runs and freed after, its gradient reduced
into this rank's shard.

Bytes per unit and rank:
  home tiers  this rank's shard, chunk by chunk (../shards.py): the param in compute dtype, an fp32 master when
              compute is bf16, the Adam moments and the reduced fp32 gradient
  device      the full flat parameter, only while GATHERING / UNSHARDED (`flat`, storage resized to 0
              otherwise); the unsharded fp32 gradient accumulator, only inside `rt.no_sync()`.
The modules always hold either views of `flat` (UNSHARDED) or meta placeholders (SHARDED / FREED).

Work on a unit runs on the runtime's lanes, and every piece that may still be running is a future the next
reader waits for: `update` (the optimizer lane writing the shard: the next gather waits for it, and so does
the next write of the gradient, which the update reads) and `grads` (the last reduce-drain work on the
gradient chunks: the optimizer and the clip norm wait for it). The training thread waits only in
wait_for_unshard (the gather it is about to compute with) and where a reader needs finished gradients.
"""
from __future__ import annotations

import concurrent.futures as cf
import contextlib

import torch
import torch.nn as nn
from torch._C import DisableTorchFunctionSubclass

from ... import inject
from ...device import is_out_of_memory, record, retire, sync
from ...device import wait as stream_wait
from ...store import LeaseMode, Tier
from ...telemetry import Lane, Queue
from ..collectives import comm
from ..context import UnitContext
from ..host_memory import advise_huge_pages
from ..lanes import SMALL_WORK_BYTES, wait
from .layout import FlatLayout
from .piece_norms import PieceNorms
from ..shards import StateKind, UnitShards
from ..state_machines import ALLOWED, UnitState
from ..state_store import Use


def _alias(t: torch.Tensor) -> torch.Tensor:
    """A tensor over t's storage with its own version counter: writing the gathered bytes through it does
    not bump the version of the views autograd saved in forward (they see the new bytes, not a 'modified
    in place' error), the same trick as resizing storage under saved tensors."""
    return torch.empty(0, dtype=t.dtype, device=t.device).set_(t.untyped_storage(), 0, (t.numel(),), (1,))


class IssuedGather:
    """A gather the lane has issued (FSDP2's all-gather result): `pending` is the collective, `copied` the event
    after the lane's own copies into the flat buffer (one rank, GPU), `held` what the collective reads besides
    the flat buffer (a one-chunk lease sent as it is, on gloo) and must outlive it; `pending` None: no collective (one
    rank). The training thread's wait() orders its stream after both, then lets the held buffers go (retired on
    that stream, which is now after every reader of them)."""

    def __init__(self, pending: comm.Pending | None, copied, held: list, device: torch.device):
        self.pending, self.copied, self.held, self.device = pending, copied, held, device

    @property
    def may_block(self) -> bool:
        """wait() may wait: a collective, or the lane's copies on a GPU stream."""
        return self.pending is not None or self.copied is not None

    def wait(self) -> None:
        try:
            if self.pending is not None:
                self.pending.wait()
            stream_wait(self.copied, self.device)
        finally:
            held, self.held = self.held, []
            for h in held:
                if isinstance(h, torch.Tensor):
                    retire(h)
                else:
                    h.release()


class LaunchedReduce:
    """A reduce-scatter the reduce lane has launched, handed to its drain: `shard` (this rank's mean, once
    `pending` is waited), `issued` (the launch stream's event after the launch: one rank has no collective to
    order the drain after it), `read` (what the cast and the collective read: retired on the drain's stream)."""

    def __init__(self, shard: torch.Tensor, pending: comm.Pending, issued, read: list):
        self.shard, self.pending, self.issued, self.read = shard, pending, issued, read


_NOTHING_TO_WAIT = contextlib.nullcontext()  # (a wait that cannot block is not metered: the meter's cost, not its)


def _result(fut: cf.Future | None) -> None:
    """On a lane: the work this depends on must be over (and must have succeeded)."""
    if fut is not None:
        fut.result()


class ShardedUnit:
    def __init__(self, ctx: UnitContext, index: int, uid: str, name: str, module: nn.Module, layout: FlatLayout,
                 shards: UnitShards):
        self.ctx = ctx
        self.index = index
        self.uid = uid  # stable id: store keys, traces and checkpoints refer to it
        self.name = name
        self.module = module
        self.layout = layout
        self.shards = shards
        self.state = UnitState.SHARDED
        self.persistent = False
        self.stale = False  # UNSHARDED copy older than the shard (an update was issued since the gather)
        self.has_grad = False  # a gradient shard holds this step's gradient (since the last zero_grad)
        self.local_grad: torch.Tensor | None = None  # unsharded fp32 accumulator inside rt.no_sync()
        # slot -> it got a gradient since the last zero_grad: set by the views' hooks, read per slot at every step (a
        # list, not a tensor: no tensor op a slot a read)
        self.used = [False] * len(layout.slots)
        self.update: cf.Future | None = None  # the optimizer's pending update of this unit
        self.grads: cf.Future | None = None  # the last reduce-drain work on the gradient chunks
        # the last reduce's drain, chunk by chunk: each future resolves once that chunk's gradient is written (an
        # update reads a unit's first chunks while the drain writes the rest); None after other drain work
        self.grad_chunks: list[cf.Future] | None = None
        # {slot: L2 norm of this rank's piece of the slot's gradient}, written by the reduce's drain when the stored
        # gradient is one reduce's output (None: accumulated or partly zeroed since, or not taken because the last
        # step asked for no norm: UnitContext.take_grad_norms). rt.clip_grad_norm_
        # uses it instead of reading every gradient chunk back (from disk, when they are paged).
        self.grad_norms: dict[int, torch.Tensor] | None = None
        self._gather: cf.Future | None = None  # the gather in flight (GATHERING)
        dtype = ctx.compute_dtype
        self.nbytes_full = layout.padded_numel * dtype.itemsize
        self.flat = torch.empty(layout.padded_numel, dtype=dtype, device=ctx.device)
        self.flat.requires_grad_(layout.trainable)
        # what the gathers write through (_alias): made once, it follows the storage's resizes
        self._flat_writer = _alias(self.flat)
        self.placeholders: list[nn.Parameter] = []
        self.views: list[torch.Tensor] = []
        self._split_sizes = [s.numel for s in layout.slots] + [layout.padded_numel - layout.numel]
        self._fresh_views()
        self._forward_views = False  # the views were made outside a backward, by a gather (construction's are not)
        self.flat.untyped_storage().resize_(0)  # views exist; no bytes until the first gather
        if layout.trainable:
            self.flat.register_post_accumulate_grad_hook(self._on_grad)

    def _fresh_views(self) -> None:
        """New views of `flat` for the modules, one autograd split for all slots: its backward concatenates the
        slots' grads into the flat grad in one pass (per-slot slicing would materialize a zero-filled full-size
        grad for every parameter). Made anew at every gather: autograd runs ready nodes newest first, so a split
        made at construction would run after the whole backward, holding every unit's gradient (and its reduce)
        until the end; made at the gather, it runs right after the unit's own backward. A gather inside a backward
        keeps the views a forward's gather made: the graph holds those (their split is the one that runs), and a
        recompute (activation checkpointing) computes with them as the forward did."""
        in_backward = torch._C._current_graph_task_id() != -1
        if in_backward and self._forward_views:
            return
        self._forward_views = not in_backward
        if torch.is_grad_enabled() and not torch.is_inference_mode_enabled():
            self.views = self._new_views()
        else:
            # the views keep their autograd link to `flat` even when made under no_grad or inference_mode (a persistent
            # unit re-gathered by an inference forward kept views without one: its parameters never trained again)
            with torch.inference_mode(False), torch.enable_grad():
                self.views = self._new_views()

    def _new_views(self) -> list[torch.Tensor]:
        slots = self.layout.slots
        if self._whole_flat_is_one_slot():  # (an embedding, an LM head): its gradient is the flat gradient itself;
            views = [self.flat.view(slots[0].shape)]  # the split's backward would copy it into a second full-size
            views[0].register_hook(self._used_hook(0))  # buffer (its concatenation)
        else:
            pieces = self.flat.split_with_sizes(self._split_sizes)
            frozen = pieces if all(s.requires_grad for s in slots) else self.flat.detach().split_with_sizes(
                self._split_sizes)
            views = [(pieces if s.requires_grad else frozen)[s.index].view(s.shape) for s in slots]
            if pieces[0].grad_fn is not None:  # one hook on the split, not one a view: which slots got a gradient
                pieces[0].grad_fn.register_prehook(self._used_prehook)
        for slot, view in zip(slots, views):
            if slot.index < len(self.placeholders):
                view._offload_placeholder = self.placeholders[slot.index]  # model.parameters() while gathered
        return views

    def _whole_flat_is_one_slot(self) -> bool:
        """One trained parameter filling the flat buffer to the last element (no padding)."""
        slots = self.layout.slots
        return len(slots) == 1 and slots[0].requires_grad and slots[0].numel == self.layout.padded_numel

    @property
    def label(self) -> str:
        return f"unit {self.index} ({self.name or '<root>'})"

    # ---- state transitions (the only writers of self.state) --------------------------------
    # See [Note: one writer per state] in docs/zero-runtime.md
    def _transition(self, to: UnitState) -> None:
        if (self.state, to) not in ALLOWED:
            raise RuntimeError(f"offload: {self.label}: illegal state change {self.state.name} -> {to.name}")
        self.state = to

    # ---- events from outside the unit (the only writers of stale, update and has_grad outside this file) ----
    def on_shard_written(self) -> None:
        """This rank's param shard has (or is about to get) values newer than a gathered copy: an update issued,
        a loaded state dict or checkpoint. Where the unit is UNSHARDED (persistent, or gathered ahead) its flat
        buffer on the compute device still holds the old values, so the next use re-gathers; SHARDED, the next
        gather reads the new shard anyway."""
        if self.state is UnitState.UNSHARDED:
            self.stale = True

    def on_update_queued(self, done: cf.Future) -> None:
        """The optimizer's update of this unit's shard is queued on the optimizer lane: `done` resolves when its
        new param, master and states are in the home tiers; a gather of the unit waits for it first."""
        self.update = done

    def on_update_repaired(self) -> None:
        """Its update failed (UpdateFailed) and a load rewrites this shard and its states: nothing is pending, and a
        gather no longer raises the failure."""
        self.update = None

    def on_gradient_loaded(self, has_grad: bool) -> None:
        """A checkpoint set this rank's gradient chunks: they hold a partial gradient the next backward adds to
        (`has_grad`), or none, which the next reduce overwrites. No unsharded accumulator, no norms taken."""
        self.has_grad, self.local_grad, self.grad_norms = has_grad, None, None

    def on_used_flags(self, flags) -> None:
        """Which slots got a gradient, as the ranks agreed (their OR at a step) or a checkpoint saved."""
        self.used[:] = [bool(f) for f in flags]

    def check_alive(self) -> None:
        if self.state is UnitState.FREED:
            raise RuntimeError(
                f"offload: this model's {self.label} was sharded by an offload.init block that has exited, so its "
                "parameters are freed. Use the model inside the `with offload.init(...)` block, or save it there "
                "with rt.full_state_dict() first."
            )

    def check_requires_grad(self) -> None:
        """requires_grad is fixed when the unit is built (its flat buffer, views and gradient hooks follow it):
        a later change would be ignored silently, so it is refused, naming the parameter."""
        with DisableTorchFunctionSubclass():  # (the placeholders' flags read as a plain tensor's: no dispatch a read)
            changed = [slot for slot, p, v in zip(self.layout.slots, self.placeholders, self.views)
                       if p.requires_grad != slot.requires_grad or v.requires_grad != slot.requires_grad]
        if changed:
            slot = changed[0]
            raise RuntimeError(
                f"offload: parameter {slot.fqn!r} ({self.label}) had requires_grad={slot.requires_grad} when "
                f"the model was sharded and was changed to {not slot.requires_grad} afterwards, which the "
                "runtime cannot follow. Set requires_grad before rt.wrap(model) (for a model built inside "
                "offload.init: before its first forward or offload.AdamW), or rebuild the model."
            )

    # ---- gather ----------------------------------------------------------------------------
    @property
    def fresh(self) -> bool:
        """Gathered (or being gathered) bytes that are current: nothing to issue for this unit."""
        return self.state is UnitState.GATHERING or (self.state is UnitState.UNSHARDED and not self.stale)

    def unshard(self, async_op: bool = False) -> None:
        """Gather every rank's shard into the full flat parameter on the compute device. async_op: only issue
        it (GATHERING); wait_for_unshard() (or unshard()) waits and lets the modules see the views."""
        self.check_alive()
        if torch._C._current_graph_task_id() == -1:  # (a backward's gather: its forward's checked them this step)
            self.check_requires_grad()
        if not self.fresh:
            readers = None
            if self.state is UnitState.SHARDED:
                self._allocate_full()  # (a block of its own: nothing queued reads it)
            else:  # stale (updated, or loaded) while gathered: re-gathered into the buffer the compute stream's
                readers = record(self.ctx.device)  # queued kernels may still read; the gather writes after them
            prefetched = self.ctx.schedule.take_prefetched(self)
            lane = self.ctx.lanes.gather
            submit = lane.submit_small if self._may_run_here(self.nbytes_full, StateKind.PARAM) else lane.submit
            self._gather = submit(f"gather:{self.uid or '<root>'}", self._gather_now, prefetched, self.update,
                                  self.ctx.gather_group.ticket(self.index), readers)
            self._transition(UnitState.GATHERING)
        if not async_op:
            self.wait_for_unshard()

    def unshard_ahead(self, reorders_nothing: bool) -> bool:
        """unshard(async_op=True) for a unit gathered before it is needed. False, with nothing issued, when the
        device cannot hold its gathered buffer now: its gather is then issued where it is needed. That backs off
        only where issuing it later reorders no collective: with one rank (none), or when no other lane's
        collective is ticketed before the need (`reorders_nothing`: the forward, where nothing is reduced; each
        rank's gathers keep one order, whenever each is issued). Elsewhere the refusal raises, as unshard's: NCCL
        needs one issue order across the lanes' communicators (comm.ProgramOrder), and a gather issued before a
        reduce on one rank and after it on another may hang."""
        may_back_off = reorders_nothing or not self.ctx.distributed
        if may_back_off and not self.fresh and self.state is UnitState.SHARDED:
            try:
                inject.allocation(inject.Site.GATHER_AHEAD)
                self._allocate_full()
            except RuntimeError as exc:
                if not is_out_of_memory(exc):
                    raise
                return False
        self.unshard(async_op=True)
        return True

    def _may_run_here(self, nbytes: int, kind: StateKind) -> bool:
        """This unit's gather, or its reduce on one rank, may run on the training thread when its lane is idle
        (WorkLane.submit_small): one rank (no collective, so no ticket to keep in order), a CPU device (no stream
        to overlap with), few bytes (a lane hop costs more than the copy: SMALL_WORK_BYTES), its `kind` chunks
        in memory (no I/O to overlap) and the unit's last update over (nothing to wait for)."""
        ctx = self.ctx
        if nbytes > SMALL_WORK_BYTES or ctx.distributed or ctx.device.type != "cpu":
            return False
        if self.update is not None and not self.update.done():
            return False
        home = self.shards.tiers.params if kind is StateKind.PARAM else self.shards.tiers.grads
        return home is not Tier.NVME or all(ctx.states.is_resident(self.shards.spec(kind, c))
                                            for c in self.shards.chunks)

    def _allocate_full(self) -> None:
        """The flat buffer grows to the gathered size (once: a second call finds it allocated)."""
        storage = self.flat.untyped_storage()
        if storage.nbytes() == self.nbytes_full:
            return
        if self.ctx.device.type == "cuda":
            with self.ctx.streams.use(Lane.GATHER):  # allocated on the stream that writes it (device.py)
                storage.resize_(self.nbytes_full)
        else:
            storage.resize_(self.nbytes_full)
        advise_huge_pages(self.flat)  # fresh pages, written next: 512x fewer faults
        self.ctx.counters.gathered(self.nbytes_full)

    def wait_for_unshard(self) -> None:
        if self.state is not UnitState.GATHERING:
            return
        fut = self._gather
        try:
            issued = wait(fut, self.ctx.meter, Queue.GATHER)  # the lane has read the shard and issued the gather
        except BaseException:
            if not fut.done():  # interrupted (Ctrl-C) while the lane still writes the buffer: it stays GATHERING,
                raise  # and the next wait (the next forward, or a reshard) lets it finish first
            self._gather = None
            self._drop_flat()
            raise
        self._gather = None
        try:
            with self.ctx.meter.waiting(Queue.GATHER) if issued.may_block else _NOTHING_TO_WAIT:
                issued.wait()  # the unit computes next: GPU: the compute stream waits for the gather; gloo: the host
        except BaseException:
            self._drop_flat()
            raise
        self.stale = False
        self._fresh_views()
        self._install(self.views)
        self._transition(UnitState.UNSHARDED)

    def _gather_now(self, prefetched: dict, after_update: cf.Future | None, ticket: int | None,
                    readers=None) -> "IssuedGather":
        """On the gather lane (its stream on a GPU): this rank's param chunks -> every rank's, into the flat
        buffer (after `readers`, the compute stream's point when the buffer was live). Returns at once after
        issuing; the training thread waits on what it returns."""
        ctx = self.ctx
        leases, held = [], []
        try:
            _result(after_update)  # the shard must hold the last update before it is read
            if after_update is not None:  # the param chunks that update kept in memory for this gather
                for index, lease in ctx.schedule.take_prefetched(self).items():
                    if prefetched.setdefault(index, lease) is not lease:
                        lease.release()
            stream_wait(readers, ctx.device)  # GPU: kernels queued on the compute stream read the old bytes first
            for c in self.shards.chunks:
                lease = prefetched.get(c.index)
                if lease is None:
                    lease = ctx.states.lease(self.shards.spec(StateKind.PARAM, c), Use.COMPUTE, LeaseMode.READ)
                leases.append(lease)
            out = self._flat_writer
            gpu = ctx.device.type == "cuda"
            if not ctx.distributed:
                for c, lease in zip(self.shards.chunks, leases):
                    out[c.lo:c.hi].copy_(lease.wait(), non_blocking=True)  # GPU: on the gather stream
                copied = record(ctx.device)
                issued = IssuedGather(None, copied, [], ctx.device)
                copies = 1
            else:
                copies = 0
                if len(leases) == 1 and not gpu:  # the lease's own bytes: the collective copies them into place
                    send = leases[0].wait()
                    held = leases  # gloo reads them until the consumer's wait (the host blocks there)
                else:  # in place, as FSDP2: the chunks straight into this rank's place in the flat buffer, which
                    # the collective sends from (NCCL sees sendbuff == recvbuff + rank * count and copies nothing
                    # itself); on a GPU always a copy, never a lease's own bytes (see the sync below)
                    send = comm.own_place(ctx.gather_group, out)
                    for c, lease in zip(self.shards.chunks, leases):
                        send[c.lo:c.hi].copy_(lease.wait(), non_blocking=True)  # GPU: on the gather stream
                    copies = 1
                copied = record(ctx.device)
                copies += not comm.in_place(ctx.gather_group, out, send)  # else the collective copies it there
                pending = comm.all_gather_into(ctx.gather_group, out, send, what=f"gather of {self.label}",
                                               ticket=ticket)
                issued = IssuedGather(pending, None, held, ctx.device)
            # GPU: the shard's bytes are read once this future resolves (the copies only, not the collective):
            # the unit's next update, which waits for it, may overwrite them (device homes, resident chunks)
            sync(copied)
            ctx.counters.add("allgather_bytes", self.nbytes_full)
            # this rank's shard copied on its way into the buffer: by the lane, and by the collective unless sent
            # from its place (one copy is the least: the home bytes are not the buffer's)
            ctx.counters.add("gather_copy_bytes", copies * self.shards.shard_numel * self.flat.element_size())
            return issued
        except BaseException:
            held = []  # nothing was issued that reads them: every lease goes back below
            ctx.gather_group.skip(ticket)  # (if it was not issued) the other lane need not wait for it
            raise
        finally:
            for lease in leases:
                if lease not in held:
                    lease.release()  # read on this lane's stream, queued: retired there (device.retire)
            for lease in prefetched.values():
                if lease not in held:
                    lease.release()  # idempotent for the ones used above

    def reshard(self) -> None:
        """Free the full flat parameter (the shard in its home tier is the truth); modules see placeholders."""
        if self.state is UnitState.GATHERING:
            self.wait_for_unshard()  # the lane is writing into the buffer: it must finish first
        if self.state is not UnitState.UNSHARDED or self.persistent:
            return
        self._install(self.placeholders)
        self._free_flat()
        self.ctx.counters.gathered(-self.nbytes_full)
        self._transition(UnitState.SHARDED)

    def _drop_flat(self) -> None:
        """A gather failed: give its buffer back and stay SHARDED."""
        self._install(self.placeholders)
        self._free_flat()
        self.ctx.counters.gathered(-self.nbytes_full)
        self.stale = False
        self._transition(UnitState.SHARDED)

    def _free_flat(self) -> None:
        """Give the flat buffer's bytes back; on a GPU only once the compute queued on the current stream so
        far (the unit's forward or backward, which read them) has passed."""
        retire(self.flat)
        self.flat.untyped_storage().resize_(0)

    def free(self) -> None:
        """Leave the runtime: drop the flat buffer and accumulators; placeholders stay (meta, no bytes)."""
        if self.state is UnitState.FREED:
            return
        if self.state is UnitState.GATHERING:
            try:
                self.wait_for_unshard()
            except Exception:  # leaving anyway: the buffer is dropped below
                pass
        if self.state is UnitState.UNSHARDED:
            self._install(self.placeholders)
            self._free_flat()
            self.ctx.counters.gathered(-self.nbytes_full)
        self.local_grad = None
        self._transition(UnitState.FREED)

    def _install(self, tensors: list[torch.Tensor]) -> None:
        for slot, t in zip(self.layout.slots, tensors):
            for module, attr in slot.refs:
                module._parameters[attr] = t

    # ---- gradients ------------------------------------------------------------------------
    def _used_hook(self, slot: int):
        def hook(grad):
            self.used[slot] = True
            return grad

        return hook

    def _used_prehook(self, grads: tuple) -> None:
        """The split's backward is about to run: `grads` holds a gradient for each of its pieces that got one."""
        for slot in self.layout.slots:
            if slot.requires_grad and grads[slot.index] is not None:
                self.used[slot.index] = True

    def _on_grad(self, flat: torch.Tensor) -> None:
        """Autograd has finished accumulating this unit's flat gradient (once per backward, or once per
        inner backward with reentrant checkpointing): fold it into the local accumulator or reduce it."""
        grad, flat.grad = flat.grad, None
        if grad is None:
            return
        if not self.ctx.sync_grads:
            if self.local_grad is None:
                self.local_grad = grad.float() if grad.dtype != torch.float32 else grad.clone()
            else:
                self.local_grad.add_(grad)  # fp32 += bf16: the bf16 value converts exactly
            return
        if self.local_grad is not None:
            full, self.local_grad = self.local_grad.add_(grad), None
        elif not self.ctx.distributed:
            full = grad  # nothing to reduce: cast into the fp32 shard as it is stored (exact, one pass fewer)
        elif grad.dtype == self.ctx.reduce_dtype:
            full = grad  # ranks sum in this dtype already (Config.reduce_dtype="bf16" with bf16 compute)
        else:
            full = grad.float()  # ranks sum in fp32
        self.reduce(full)

    def reduce(self, full_grad: torch.Tensor) -> None:
        """Queue: mean over ranks of the full gradient (fp32, or Config.reduce_dtype; compute dtype on one rank,
        where nothing is summed), this rank's shard added into the stored fp32 gradient (or written over it,
        the first time since zero_grad). Two pieces of work: the launch on the reduce lane, its drain on the
        reduce-drain lane (lanes.py), so no later collective's launch waits for this one's host work; one on one
        rank, where nothing is launched (the drain's lane does the launch's stream wait). `full_grad`
        travels with the work, and so does the event after the compute that wrote it (the reduce stream waits
        for that, not for the whole device)."""
        overwrite, self.has_grad = not self.has_grad, True
        window = self.ctx.reduce_window  # every unit's reduces in flight (their drains), oldest first
        while window and window[0].done():
            window.popleft()
        while len(window) >= self.ctx.max_reduces_in_flight:  # bound the full gradients held by the lanes
            wait(window.popleft(), self.ctx.meter, Queue.REDUCE)
        written = record(self.ctx.device)
        name = self.uid or "<root>"
        chunks_written = [cf.Future() for _ in self.shards.chunks]
        if self.ctx.distributed:
            launched = self.ctx.lanes.reduce.submit(f"reduce:{name}", self._launch_reduce, full_grad, written,
                                                    self.ctx.reduce_group.ticket(self.index))
            self.grads = self.ctx.lanes.reduce_drain.submit(f"reduce drain:{name}", self._drain_reduce, launched,
                                                            overwrite, self.update, chunks_written)
        else:  # one rank: no collective to launch in program order, so no launch to keep apart from the host work:
            # one lane item, the drain's (a lane hop and a future fewer a unit a step), or none where it is small
            lane = self.ctx.lanes.reduce_drain
            submit = lane.submit_small if self._may_run_here(full_grad.nbytes, StateKind.GRAD) else lane.submit
            self.grads = submit(f"reduce drain:{name}", self._reduce_locally, full_grad, written, overwrite,
                                self.update, chunks_written)
        self.grad_chunks = chunks_written
        window.append(self.grads)
        if self.ctx.on_reduce is not None:
            self.ctx.on_reduce(self)

    def _launch_reduce(self, full_grad: torch.Tensor, written, ticket: int | None) -> LaunchedReduce:
        """On the reduce lane (its stream on a GPU): cast and launch the reduce-scatter, and return; nothing here
        waits for a collective or touches the gradient chunks (the drain does)."""
        ctx = self.ctx
        try:
            stream_wait(written, ctx.device)  # this stream reads what autograd wrote on the compute stream
            send = full_grad
            if ctx.distributed and ctx.reduce_dtype != full_grad.dtype:
                send = full_grad.to(ctx.reduce_dtype)  # Config.reduce_dtype: the ranks sum in it
            shard, pending = comm.reduce_scatter_mean(ctx.reduce_group, send, what=f"gradient of {self.label}",
                                                      ticket=ticket)
        except BaseException:
            ctx.reduce_group.skip(ticket)  # (if it was not issued) the other lane need not wait for it
            raise
        ctx.counters.add("reduce_scatter_bytes", send.numel() * send.element_size())
        return LaunchedReduce(shard, pending, record(ctx.device), [full_grad, send])

    def _reduce_locally(self, full_grad: torch.Tensor, written, overwrite: bool, after_update: cf.Future | None,
                        chunks_written: list[cf.Future]) -> None:
        """On the reduce-drain lane, one rank (nothing summed over ranks): the launch's part (its stream's wait for
        autograd's writes; the shard is the gradient itself) and the drain, in one piece of work."""
        self._drain_resolving(lambda: self._launch_reduce(full_grad, written, None), overwrite, after_update,
                              chunks_written)

    def _drain_reduce(self, launched: cf.Future, overwrite: bool, after_update: cf.Future | None,
                      chunks_written: list[cf.Future]) -> None:
        """On the reduce-drain lane (its stream on a GPU): wait for the launched reduce's sum, then write this
        rank's shard of it into the gradient chunks (or add it), taking the pieces' norms on the way."""
        self._drain_resolving(launched.result, overwrite, after_update, chunks_written)  # (a failed launch fails it)

    def _drain_resolving(self, reduced_of, overwrite: bool, after_update: cf.Future | None,
                         chunks_written: list[cf.Future]) -> None:
        """The drain of `reduced_of()`'s sum. Each of `chunks_written` resolves once its chunk's host bytes are
        final (all at the end where they are written on a device), or fails with the drain."""
        try:
            self._drain_into_chunks(reduced_of(), overwrite, after_update, chunks_written)
        except BaseException as e:
            for f in chunks_written:
                if not f.done():
                    f.set_exception(e)
            raise
        for f in chunks_written:
            if not f.done():
                f.set_result(None)

    def _drain_into_chunks(self, reduced: LaunchedReduce, overwrite: bool, after_update: cf.Future | None,
                           chunks_written: list[cf.Future]) -> None:
        ctx = self.ctx
        stream_wait(reduced.issued, ctx.device)  # one rank: the shard is the gradient the launch stream waited for
        reduced.pending.wait()  # this stream (gloo: this thread) goes on once the sum is here
        for t in reduced.read:  # the collective and the cast read them on other streams, which this one now follows
            retire(t)
        _result(after_update)  # the last update reads the gradient chunks: it must be over before they change
        shard = reduced.shard
        self.register_grads()
        mode = LeaseMode.OVERWRITE if overwrite else LeaseMode.UPDATE
        where = self._grads_where(accumulate=not overwrite)
        norms = None  # of the fp32 values stored, while they are here (where a norm is likely asked for)
        if overwrite and ctx.take_grad_norms:
            norms = PieceNorms([p for p in self.layout.pieces(ctx.rank) if self.layout.slots[p.slot].requires_grad])
        for c in self.shards.chunks:
            lease = ctx.states.lease(self.shards.spec(StateKind.GRAD, c), where, mode)
            acc = lease.wait()
            if overwrite:
                acc.copy_(shard[c.lo:c.hi], non_blocking=True)  # GPU to a pinned host chunk: on this stream
                if acc.device != shard.device:
                    sync(record(ctx.device))  # the norm below and the write-behind read these host bytes next
                if norms is not None:
                    norms.feed(c, acc)
            else:
                acc.add_(shard[c.lo:c.hi])  # on one device (_grads_where)
            lease.release()
            if acc.device.type == "cpu":  # host bytes written (a copy from a device was synced above): final
                chunks_written[c.index].set_result(None)
        retire(shard)
        self.grad_norms = norms.done if norms is not None else None
        sync(record(ctx.device))  # readers of the gradient (optimizer, clip norm) wait on this lane's future only

    def _grads_where(self, accumulate: bool = False) -> Use:
        """Where the reduce and zero_grad touch the gradient chunks: in the device tier when they live there
        (on a GPU no host round trip); on a GPU, an accumulation on the device (the chunk is brought up and
        written back by the store, so nothing adds device bytes to host ones); else host memory."""
        if self.shards.tiers.grads is Tier.DEVICE or (accumulate and self.ctx.states.compute_in_device_tier):
            return Use.COMPUTE
        return Use.HOST

    def register_grads(self) -> None:
        if not self.shards.grads_registered:
            for c in self.shards.chunks:
                self.ctx.states.register(self.shards.spec(StateKind.GRAD, c)).result()  # leased just after
            self.shards.grads_registered = True

    def flush_local_grad(self) -> None:
        """Reduce what no_sync accumulated (called when a step needs gradients no backward has reduced)."""
        if self.local_grad is not None:
            g, self.local_grad = self.local_grad, None
            self.reduce(g)

    def wait_grads(self) -> None:
        """The training thread reads this unit's gradient chunks next: every reduce must be over."""
        wait(self.grads, self.ctx.meter, Queue.REDUCE)

    def zero_grad(self, slots=None, set_to_none: bool = True) -> None:
        """Clear the gradients of `slots` (slot indices; None: all). set_to_none (torch's default) makes them
        "no gradient": not stepped until a backward reaches them again. set_to_none=False keeps them as zero
        gradients, which torch.optim.AdamW still steps (decay and moment updates)."""
        frozen = {s.index for s in self.layout.slots if not s.requires_grad}  # never have a gradient
        if slots is None or len(set(slots) | frozen) == len(self.layout.slots):
            if set_to_none:
                self.has_grad = False  # the chunks stay registered; the next reduce writes over them
                self.local_grad = None
                self.used[:] = [False] * len(self.used)
                return
            slots = range(len(self.layout.slots))
        slots = set(slots)
        if self.local_grad is not None:
            for s in slots:
                slot = self.layout.slots[s]
                self.local_grad[slot.offset:slot.offset + slot.numel].zero_()
        if self.has_grad:  # other slots keep their gradient: zero these ranges of the stored shard, in order
            ranges = []
            for p in self.layout.pieces(self.ctx.rank):
                if p.slot not in slots:
                    continue
                if ranges and ranges[-1][1] == p.lo:  # adjacent slots: one range (one lease of each chunk, not one a
                    ranges[-1] = (ranges[-1][0], p.hi)  # slot)
                else:
                    ranges.append((p.lo, p.hi))
            self.grads = self.ctx.lanes.reduce_drain.submit(f"zero_grad:{self.uid or '<root>'}", self._zero_now,
                                                            ranges, self.update)
            self.grad_chunks = None
        if set_to_none:
            for s in slots:
                self.used[s] = False

    def _zero_now(self, ranges: list, after_update: cf.Future | None) -> None:
        _result(after_update)
        self.grad_norms = None  # some pieces are zeroed now: read them back if a norm is asked for
        for lo, hi in ranges:
            for c, a, b in self.shards.chunks_over(lo, hi):
                lease = self.ctx.states.lease(self.shards.spec(StateKind.GRAD, c), self._grads_where(),
                                              LeaseMode.UPDATE)
                lease.wait()[a:b].zero_()
                lease.release()
        sync(record(self.ctx.device))  # device-tier gradients: readers wait on this lane's future only

    # ---- reading and writing ranges of the shard (training thread: state dicts, clip) ----------
    def read_shard(self, kind: StateKind) -> torch.Tensor:
        """A host copy of this rank's whole shard of `kind` (its chunks concatenated)."""
        dtype = self.ctx.compute_dtype if kind is StateKind.PARAM else torch.float32
        out = torch.empty(self.shards.shard_numel, dtype=dtype)
        for c in self.shards.chunks:
            lease = self.ctx.states.lease(self.shards.spec(kind, c), Use.HOST, LeaseMode.READ)
            out[c.lo:c.hi].copy_(lease.wait())
            lease.release()
        return out

    def write_shard(self, kind: StateKind, values: torch.Tensor) -> None:
        """Write this rank's whole shard of `kind` (cast like copy_), chunk by chunk."""
        for c in self.shards.chunks:
            lease = self.ctx.states.lease(self.shards.spec(kind, c), Use.HOST, LeaseMode.OVERWRITE)
            lease.wait().copy_(values[c.lo:c.hi])
            lease.release().result()  # the caller reads or gathers the unit next
