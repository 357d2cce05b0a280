"""The update path: the step's state, what a step updates, and how each unit's update reaches the optimizer lane.

    opt.step()                       a sharded optimizer (optimizer.py) decides each unit's runs: its pieces
                                     that got a gradient, their hyperparameters and step counts
      -> UpdatePath.step_units(work, schema)
           the backward's updates (backward_updates.py, Config.update_in_backward) are skipped (the optimizer
           checked them before it changed a step count)
           the schedule orders the rest (the next forward's order) and is told the step happened
           each unit: its states created at its first step (optim_states.register), anything read ahead of
           its shard dropped, and its UnitUpdate queued on the pipeline (optimizer_pipeline.py); a unit's next
           gather waits on its `update` future
    a unit's reduce in the backward (speculative, or Config.update_in_backward: backward_updates.py)
      -> UpdatePath.queue_one(unit, runs, clip, schema, chunks)

It owns the step's state: the gradient factor of the next step (the clip coefficient times the loss scale's
1/S), the loss scale (loss_scale.py), the unscaled norm, the optimizers over the run, and the backward's
updates; and the training loop's calls on it (clip, no_sync, unscale, skip, zero_grad; the Runtime's are
delegates). It holds what it touches and nothing else (no back-pointer to the Runtime): the Runtime builds it in
open() once the store and the pipeline exist, and hands it the schedule and the units' context, which call into it
(a new backward, a reduce), once they are built (attach).
"""
from __future__ import annotations

import concurrent.futures as cf
import contextlib
import logging
import math
import threading
import weakref
from typing import TYPE_CHECKING, Callable

import torch

from ...optim.schema import Schema
from ...telemetry import Meter, Queue
from ..collectives import comm
from ..collectives.divergence import SAME_UNITS_FIX
from . import optim_states
from .backward_updates import BackwardUpdates
from .grad_norm import local_norms
from .loss_scale import GradState, LossScale
from .optimizer_pipeline import OptimizerPipeline, UnitUpdate, UpdateFailed
from .speculation import Speculation
from ..state_machines import UnitState

if TYPE_CHECKING:
    from ...config import Config
    from ..context import UnitContext
    from ..schedule import Schedule
    from ..state_store import UnitStateStore
    from ..step_stats import StepStats

log = logging.getLogger("offload")


class UpdatePath:
    def __init__(self, config: Config, group: comm.Group, units: list, meter: Meter, states: UnitStateStore,
                 pipeline: OptimizerPipeline, step_stats: StepStats, sized_schema: Schema,
                 compute_dtype: torch.dtype, after_step: Callable[[], None], quiesce: Callable[[], None],
                 every_rank_calls: Callable[[str], None]):
        self.config = config
        self.group = group
        self.rank, self.world_size = group.rank, group.world_size
        self.units = units  # the Runtime's list of units (wrap appends to it)
        self.meter = meter
        self.states = states
        self.pipeline = pipeline
        self.step_stats = step_stats
        self.sized_schema = sized_schema  # what the placement sized optimizer states for
        self.compute_dtype = compute_dtype
        # the runtime's services the step and the optimizers' state dicts use: its bookkeeping after a step (an
        # "auto" device budget), waiting until no background work is queued, and a collective entry point's meeting
        self._after_step = after_step
        self.quiesce = quiesce
        self.every_rank_calls = every_rank_calls
        self.schedule: Schedule | None = None  # (attach)
        self.ctx: UnitContext | None = None
        self.is_open = True
        # the kernel's factor on every gradient at the next step: the clip coefficient times the loss scale's
        # 1/S (set by clip_grad_norm_ and unscale_grads, used by every optimizer's step, reset by the next backward)
        self.grad_scale = 1.0
        self.loss_scale = LossScale()  # offload.GradScaler's scale, and what this step's gradients carry
        self._unscaled_norm: torch.Tensor | None = None  # unscale_grads' local L2 norm, for the clip that follows
        self._norms_asked = True  # a norm of the gradients was asked for since the last backward began
        self.optimizers: list = []  # weak references to the sharded optimizers over this run, in creation order
        self.backward_updates = BackwardUpdates(
            config.update_in_backward, self,
            Speculation(config.speculative_updates and config.pipeline, states, pipeline))

    def attach(self, schedule: Schedule, ctx: UnitContext) -> None:
        """The schedule and the units' context, built after the path (they call into it)."""
        self.schedule, self.ctx = schedule, ctx

    def close(self) -> None:
        self.is_open = False

    def check_open(self, what: str) -> None:
        if not self.is_open:
            raise RuntimeError(f"offload: {what} needs an open offload.init block (this runtime has exited)")

    # ---- optimizers -------------------------------------------------------------------------
    def add_optimizer(self, optimizer, who: str) -> None:
        """An optimizer over this run's parameters joins (checkpoints save and load every one): refused when its
        family stores more per parameter than the placement sized the optimizer's states for
        (Config.optimizer_states)."""
        schema, sized = optimizer.schema, self.sized_schema
        if schema.bytes_per_element > sized.bytes_per_element:
            raise ValueError(
                f"{who} stores {schema.bytes_per_element:g} bytes of optimizer state per parameter besides the "
                f"master, more than offload.Config.optimizer_states={sized.name!r} sized the placement for "
                f"({sized.bytes_per_element:g}); set Config(optimizer_states={schema.name!r})")
        self.optimizers.append(weakref.ref(optimizer))

    def live_optimizers(self) -> list:
        """The offload optimizers over this run still alive, in creation order."""
        return [o for o in (ref() for ref in self.optimizers) if o is not None]

    # ---- the backward -----------------------------------------------------------------------
    def on_new_backward(self) -> None:
        self.grad_scale = 1.0  # a new backward pass: the last clip coefficient was for the last step
        self.loss_scale.on_new_backward()  # its gradients carry the loss scale, if a GradScaler set one
        self._unscaled_norm = None
        # the drains take the gradients' norms where the last step asked for one (a clip, a GradScaler's check): a
        # run that never clips reads nothing twice; one that starts to reads its gradients back once, the same norms
        self.ctx.take_grad_norms, self._norms_asked = self._norms_asked, False

    @contextlib.contextmanager
    def no_sync(self):
        """Backward passes in here accumulate gradients locally; the next backward outside reduces once."""
        previous, self.ctx.sync_grads = self.ctx.sync_grads, False
        try:
            yield
        finally:
            self.ctx.sync_grads = previous

    @contextlib.contextmanager
    def accumulating(self):
        """Backward passes in here are not their step's last (accumulation that reduces every micro-batch, memory:
        one shard per unit): Config.update_in_backward queues the updates in the backward after them. Elsewhere
        a no-op."""
        previous, self.backward_updates.accumulating = self.backward_updates.accumulating, True
        try:
            yield
        finally:
            self.backward_updates.accumulating = previous

    def flush_grads(self) -> None:
        for unit in self.units:
            unit.flush_local_grad()

    # ---- clipping and loss scaling (offload.GradScaler: grad_scaler.py) -----------------------
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Global gradient norm over every shard on every rank; the optimizer's next step scales gradients
        by min(1, max_norm / (norm + 1e-6)) inside its fused update (as torch.nn.utils.clip_grad_norm_)."""
        self.check_open("rt.clip_grad_norm_")
        if self.loss_scale.state is GradState.SCALED:
            raise RuntimeError("rt.clip_grad_norm_: the gradients still carry the loss scale of offload.GradScaler; "
                               "call scaler.unscale_(optimizer) before clipping (as with torch.amp.GradScaler)")
        if norm_type == 2.0 and self._unscaled_norm is not None:
            local = self._unscaled_norm  # the overflow check took it (without it, gradients read back twice)
        else:
            local = self._local_norm(norm_type)
        with self.meter.waiting(Queue.COLLECTIVE):
            if not self.group.distributed:
                total = local
            elif math.isinf(norm_type):
                total = comm.all_reduce_host_(self.group, local.clone(), "max", what="clip_grad_norm_")
            else:
                total = comm.all_reduce_host_(self.group, local ** norm_type, "sum",
                                              what="clip_grad_norm_") ** (1.0 / norm_type)
        if self.loss_scale.state is GradState.UNSCALED:
            total = total * self.loss_scale.unscale  # (exact for a power-of-two scale: torch's unscaled norm)
        coef = torch.clamp(float(max_norm) / (total + 1e-6), max=1.0)  # fp32, exactly as torch computes it
        self.grad_scale = float(coef) * self.loss_scale.unscale
        self.backward_updates.on_clip(float(coef))
        return total

    def _local_norm(self, norm_type: float) -> torch.Tensor:
        """The norm over this rank's gradient shards, as they are stored (times the loss scale, if any)."""
        self._norms_asked = True
        self.flush_grads()
        norms = local_norms(self.units, self.rank, norm_type)  # on the host (grad_norm._on_host)
        return torch.linalg.vector_norm(torch.stack(norms), norm_type) if norms else torch.zeros(())

    def set_loss_scale(self, scale: float) -> None:
        """GradScaler.scale: the next backward's gradients carry `scale`."""
        self.check_open("offload.GradScaler.scale")
        if self.config.update_in_backward:
            raise ValueError("offload.GradScaler: Config.update_in_backward runs updates before a step's overflow "
                             "check could skip them; set update_in_backward=False (the default speculative "
                             "updates are taken back when a step overflows)")
        self.loss_scale.scale = scale

    def unscale_grads(self) -> bool:
        """GradScaler.unscale_: the next step's factor takes 1 / S; returns whether any gradient on any rank is inf
        or NaN (its parameter's norm is then not finite; once per step, then remembered)."""
        self.check_open("offload.GradScaler.unscale_")
        scaled = self.loss_scale
        if scaled.state is GradState.UNSCALED:
            return scaled.found_inf  # (another optimizer over the same gradients)
        if scaled.state is GradState.PLAIN:
            raise RuntimeError("offload.GradScaler.unscale_: this step's gradients carry no loss scale; call "
                               "scaler.scale(loss).backward() for every backward of the step")
        self._unscaled_norm = self._local_norm(2.0)
        here = not bool(torch.isfinite(self._unscaled_norm))
        found = torch.tensor([1.0 if here else 0.0])
        if self.group.distributed:
            with self.meter.waiting(Queue.COLLECTIVE):
                found = comm.all_reduce_host_(self.group, found, "max", what="GradScaler.unscale_ (overflow)")
        scaled.on_unscaled(bool(found.item()), here)
        self.grad_scale = scaled.unscale
        return scaled.found_inf

    def skip_step(self) -> None:
        """GradScaler.step after an overflow: no update; any the backward speculated is taken back."""
        self.check_open("offload.GradScaler.step")
        if self.loss_scale.skipped:
            return  # (another optimizer's step over the same gradients)
        self.backward_updates.skip_step()
        self.schedule.step_skipped()
        self.loss_scale.on_skipped()
        self.step_stats.end_step(skipped=True)  # the skipped iteration's own window (not the last real step's)

    # ---- clearing gradients -----------------------------------------------------------------
    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear every unit's gradient (set_to_none=False: keep zero gradients, as torch)."""
        self._abandon_step()
        self._unscaled_norm = None
        for unit in self.units:
            unit.zero_grad(None, set_to_none)
        self.grad_scale = 1.0

    def zero_grad_params(self, params, set_to_none: bool = True) -> None:
        """Clear the gradients of `params` only (placeholders, or a gathered unit's views): what
        `module.zero_grad()` and `opt.zero_grad()` do for the parameters they hold."""
        by_unit: dict[int, tuple] = {}
        for p in params:
            p = getattr(p, "_offload_placeholder", p)
            unit = getattr(p, "_offload_unit", None)
            if unit is None or unit.ctx is not self.ctx:  # (another runtime's)
                continue
            by_unit.setdefault(id(unit), (unit, set()))[1].add(p._offload_slot)
        if by_unit:
            self._abandon_step()
            self._unscaled_norm = None
        for unit, slots in by_unit.values():
            unit.zero_grad(slots, set_to_none)

    def _abandon_step(self) -> None:
        """Gradients cleared: a step whose backward queued updates and whose opt.step() did not come is left (a
        backward that raised, a skipped step). Before the gradients' 'received' flags are cleared: the count of
        an update that ran reads them."""
        self.backward_updates.abandon(lambda units: [o.count_step(units) for o in self.live_optimizers()])
        self.group.order.asked.forget_divergence()  # a pass's check found the ranks apart: start level

    # ---- the step ---------------------------------------------------------------------------
    def sync_used(self) -> None:
        """OR the per-parameter 'received a gradient' flags over ranks (params with none are not stepped)."""
        if not self.units or not self.group.distributed:
            return
        flags = torch.tensor([f for u in self.units for f in u.used], dtype=torch.int64)
        # and what each rank asked of the lanes since the last step, compared in the same collective (max of the
        # counts and of their negatives: the most and the fewest over ranks)
        counts, order_hash = self.group.order.asked.take()
        asked = torch.tensor([counts[(lane, u.index)] for u in self.units for lane in ("gather", "reduce")]
                             + [order_hash], dtype=torch.int64)
        both = torch.cat([flags, asked, -asked])
        with self.meter.waiting(Queue.COLLECTIVE):
            comm.all_reduce_host_(self.group, both, "max", what="which parameters got gradients (opt.step)")
        most, fewest = both[len(flags):len(flags) + len(asked)], -both[len(flags) + len(asked):]
        if not torch.equal(most, fewest):
            self._refuse_rank_dependent_collectives(most, fewest)
        offset = 0
        for u in self.units:
            n = len(u.used)
            u.on_used_flags(both[offset:offset + n].tolist())
            offset += n

    def _refuse_rank_dependent_collectives(self, most: torch.Tensor, fewest: torch.Tensor) -> None:
        """sync_used found that the ranks asked for different gathers or reduces this step: raised before anything
        is updated from it (each rank's collectives paired with another's of the same size: the numbers are
        wrong, with no error of their own)."""
        differ = []
        for k, u in enumerate(self.units):
            ways = [f"{done} {int(fewest[2 * k + j])} to {int(most[2 * k + j])} times"
                    for j, done in enumerate(("gathered", "reduced")) if most[2 * k + j] != fewest[2 * k + j]]
            if ways:
                differ.append(f"{u.label} {' and '.join(ways)}")
        what = "; ".join(differ[:4]) + (f" and {len(differ) - 4} more" if len(differ) > 4 else "") if differ else \
            "the same units as often, in another order"
        raise RuntimeError(
            f"offload: the ranks ran different units in this step ({what}, over the ranks): each gather and reduce "
            "is a collective, so one rank's paired with another's for another unit and this step's numbers are wrong; "
            "nothing was updated from it. " + SAME_UNITS_FIX)

    def check_steppable(self) -> None:
        """Before an optimizer's step changes anything (its step counts): refuse gradients that still carry the
        loss scale or overflowed, so a refused step leaves the optimizer as it was."""
        if self.loss_scale.state is GradState.SCALED:
            raise RuntimeError("optimizer.step(): the gradients carry offload.GradScaler's loss scale; step through "
                               "scaler.step(optimizer) (which unscales them and skips a step that overflowed)")
        if self.loss_scale.found_inf:
            raise RuntimeError("optimizer.step(): this step's gradients overflowed (inf or NaN); step through "
                               "scaler.step(optimizer), which skips it")

    def step_units(self, work: list, schema: Schema) -> None:
        """A sharded optimizer's step: [(unit, runs)] with its family's `schema`, queued with this step's clip
        coefficient (check_steppable() passed)."""
        if self.compute_dtype == torch.float16 and self.loss_scale.scale is None and not self.step_stats.steps:
            log.warning("offload: compute_dtype='fp16' without a loss scaler: gradients below fp16's range flush to "
                        "zero and an overflow is stepped on. Train through offload.GradScaler (scaler.scale(loss)"
                        ".backward(); scaler.step(opt); scaler.update()), or compute in bf16.")
        self.step(work, schema, self.grad_scale)
        self._after_step()

    def forget_failed_updates(self) -> None:
        """rt.load_checkpoint is about to replace every state: an update that failed (UpdateFailed) stands no
        longer, nor do the store's moves still failing in its wake (reads ahead of the same bad slots), and the
        units it left part-updated may be gathered again once loaded."""
        repairing = False
        for lane in self.ctx.lanes.all():
            try:
                lane.drain()
            except UpdateFailed:
                repairing = True  # (what this load repairs; any other failure still raises)
        for unit in self.units:
            failed = unit.update is not None and unit.update.done() and unit.update.exception()
            if isinstance(failed, UpdateFailed):
                unit.on_update_repaired()
                repairing = True
        if repairing:
            try:
                self.states.wait_moves()
            except Exception:  # noqa: BLE001 - moves of states the load rewrites (each undid its own residency)
                pass

    def step(self, work: list, schema: Schema, grad_scale: float) -> None:
        """Queue a step's updates: [(unit, runs)] captured at opt.step(), with the optimizer family's `schema`
        and the clip coefficient `grad_scale` (units the backward already queued are checked and skipped)."""
        early = self.backward_updates
        scale = early.scale(grad_scale)
        early.void_unstepped([unit for unit, _ in work])
        updates = []
        for unit, runs in work:
            # the chunks the backward already updated for good (speculative ones: kept only if nothing clipped)
            stepped = early.check_step(unit, runs, grad_scale)
            rest = frozenset(c.index for c in unit.shards.chunks) - stepped
            if rest:
                updates.append(self._update(unit, runs, scale, schema, rest if stepped else None))
        order = self.schedule.before_step([unit for unit, _ in work])  # (the trace: the same order every step)
        rank = {id(u): k for k, u in enumerate(order)}
        updates.sort(key=lambda u: rank[id(u.unit)])
        for u in updates:
            self._before_update(u.unit)
            u.hand_over = True  # after the backward: the next forward gathers it next (Schedule.hand_over)
        if early.armed and early.issued:  # the backward queued updates, still running: with these, one at a time,
            # the one the next forward needs first (a unit's chunks held resident wait for no I/O: not behind the
            # others' I/O). None queued (no chunk of theirs could be speculated): one lane item for all, as unarmed
            self.pipeline.prefer_forward_order([u.uid for u in order])
            for u in updates:
                speculated = u.unit.update  # (a unit's speculative update and the rest of its chunks: both)
                self.pipeline.submit_one(u)
                if u.chunks is not None and speculated is not None:
                    u.unit.on_update_queued(_both(speculated, u.done))
        else:
            self.pipeline.submit(updates)
        self.schedule.after_step()
        early.end_step(grad_scale)
        self.step_stats.end_step()
        if early.last is not None:
            self.step_stats.last["clip"] = early.last  # the coefficient applied and the step's own

    def queue_one(self, unit, runs: list, grad_scale: float, schema: Schema, chunks: frozenset | None) -> UnitUpdate:
        """`unit`'s gradient is final (its reduce is queued): queue its update now, over every chunk
        (Config.update_in_backward), or speculatively over `chunks` (speculation.py)."""
        update = self._update(unit, runs, grad_scale, schema, chunks)
        update.speculative = chunks is not None
        self._before_update(unit)
        self.pipeline.submit_one(update)
        return update

    def _update(self, unit, runs: list, grad_scale: float, schema: Schema, chunks: frozenset | None = None
                ) -> UnitUpdate:
        first = optim_states.register(unit, schema)
        real = sum(p.hi - p.lo for p in unit.layout.pieces(self.rank))
        covered = sum(r.hi - r.lo for r in runs)
        overwrite = not unit.shards.master_is_param and covered == real
        return UnitUpdate(unit, runs, grad_scale, zero_moments=first, param_overwrite=overwrite,
                          grads_ready=unit.grads, grad_chunks=unit.grad_chunks, chunks=chunks)

    def taken_back(self, unit) -> None:
        """A speculative update of `unit` was taken back (its param rewritten): what was read of it goes."""
        self._before_update(unit)

    def _before_update(self, unit) -> None:
        self.schedule.drop_prefetched(unit)  # nothing read ahead of a shard about to be written
        if unit.state is UnitState.GATHERING:
            unit.wait_for_unshard()  # a gather ahead that the step did not use: it read the shard, let it land first
        if unit.state is UnitState.UNSHARDED:
            unit.on_shard_written()  # persistent units re-gather before their next use


def _both(a: cf.Future, b: cf.Future) -> cf.Future:
    """A future that resolves once `a` and `b` have (with the first failure, if either fails)."""
    out: cf.Future = cf.Future()
    lock = threading.Lock()  # (the two callbacks may run at once, on two threads)

    def settle(_):
        with lock:
            if not (a.done() and b.done()) or out.done():
                return
            failed = next((f.exception() for f in (a, b) if f.exception() is not None), None)
            if failed is not None:
                out.set_exception(failed)
            else:
                out.set_result(None)

    a.add_done_callback(settle)
    b.add_done_callback(settle)
    return out
