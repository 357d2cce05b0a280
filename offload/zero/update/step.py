"""The update path: what a step updates, and how each unit's update reaches the optimizer lane.

    opt.step()                       a sharded optimizer (optimizer.py) decides each unit's runs: its pieces
                                     that got a gradient, their hyperparameters and step counts
      -> UpdatePath.step(work, schema, clip)
           the backward's updates (backward_updates.py, Config.update_in_backward) are skipped (the optimizer
           checked them before it changed a step count)
           the schedule orders the rest (the next forward's order) and is told the step happened
           each unit: its states created at its first step (optim_states.register), anything read ahead of
           its shard dropped, and its UnitUpdate queued on the pipeline (optimizer_pipeline.py); a unit's next
           gather waits on its `update` future
    a unit's reduce in the backward (speculative, or Config.update_in_backward: backward_updates.py)
      -> UpdatePath.queue_one(unit, runs, clip, schema, chunks)

It holds what it touches and nothing else: the rank, the schedule, the pipeline, the backward's updates and
the step statistics (no back-pointer to the Runtime).
"""
from __future__ import annotations

import concurrent.futures as cf
import threading
from dataclasses import dataclass

from ...optim.schema import Schema
from . import optim_states
from .backward_updates import BackwardUpdates
from .optimizer_pipeline import OptimizerPipeline, UnitUpdate
from ..schedule import Schedule
from ..units.state import UnitState
from ..step_stats import StepStats


@dataclass
class UpdatePath:
    rank: int
    schedule: Schedule
    pipeline: OptimizerPipeline
    backward_updates: BackwardUpdates
    step_stats: StepStats

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
        if early.armed:  # the backward queued updates, still running: with these, one at a time, the one the next
            # forward needs first (a unit's chunks held resident wait for no I/O: not behind the others' I/O)
            self.pipeline.prefer_forward_order([u.uid for u in order])
            for u in updates:
                speculated = u.unit.update  # (a unit's speculative update and the rest of its chunks: both)
                self.pipeline.submit_one(u)
                if u.chunks is not None and speculated is not None:
                    u.unit.update = _both(speculated, u.done)
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
                          grads_ready=unit.grads, chunks=chunks)

    def taken_back(self, unit) -> None:
        """A speculative update of `unit` was taken back (its param rewritten): what was read of it goes."""
        self._before_update(unit)

    def _before_update(self, unit) -> None:
        self.schedule.drop_prefetched(unit)  # nothing read ahead of a shard about to be written
        if unit.state is UnitState.GATHERING:
            unit.wait_for_unshard()  # a gather ahead that the step did not use: it read the shard, let it land first
        if unit.state is UnitState.UNSHARDED:
            unit.stale = True  # persistent units re-gather before their next use


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
