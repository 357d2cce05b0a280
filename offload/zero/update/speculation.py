"""Speculative exact updates (Config.speculative_updates, on by default): the update of a step that does not clip
runs under its backward, and the results stay bitwise those of the exact path.

By default a unit's update waits for opt.step(), after the whole backward, because global-norm clipping needs
every gradient first; with the optimizer states on nvme, their reads and writes then crowd into the gap before
the next forward while the disk idled under the backward. But when clipping does not fire, the coefficient is
exactly 1.0, and a gradient scaled by 1.0 is the gradient, bit for bit. So at a step whose previous step did not
clip, each unit's update is queued right after its gradient reduce (as Config.update_in_backward does), as if the
coefficient were 1, with one difference: the fp32 master and optimizer states it writes go *beside* the old
ones, into the shard's spare nvme slot (the two slots are exchanged once the old bytes are read:
TieredStore.exchange_slots). The compute-dtype param it writes in place: nothing reads it before the next
forward, and it is the master's cast.

With offload.GradScaler (fp16) the gradients carry the loss scale S: the speculative update applies 1/S, the
factor of a step that neither clips nor overflows.

At opt.step(), per unit:
    commit  the coefficient is exactly 1.0 (the step's factor exactly the 1/S speculated with) and the
            hyperparameters and step counts are those the backward captured: the update stands; nothing moves
            (the new states are already in the shard's slot).
    miss    clipping fired, or a hyperparameter changed in between: once its writes have landed the slots are
            exchanged back (the old states are the shard's again) and the update runs again at opt.step(),
            from the old states, with the real coefficient: the exact path's update, paid twice.
    void    the step does not come for this backward (a GradScaler step skipped for an overflow, which counts as
            a step that clipped; zero_grad() before a step, a state dict or checkpoint in
            between, or another forward or backward that gathers the unit first: accumulation outside
            rt.accumulating()): exchanged back, and the param rewritten from the old master (its cast, exactly
            as every update writes it), before anything reads it.
While steps clip, speculation waits: it runs at a step only when the one before it did not clip, so a run that
clips every step never speculates and one that never clips always commits (rt.stats()["speculation"]). A miss
doubles the calm it waits for next time (steps in a row that did not clip: 1, then 2, 4, ... up to MAX_CALM); a
commit brings it back to 1. So a run whose clipping comes and goes (every other step, say) stops paying twice:
on the emulated bench, a miss every other step moved 46% more nvme bytes per step (benchmarks/RESULTS.md).

What is speculated: the chunks of a unit whose master (the param itself with fp32 compute) and optimizer states
are on nvme and not held resident; chunks held in the cpu tier are updated at opt.step(), in memory, without I/O.
The spare slots take nvme budget beside the states (registered at a chunk's first speculation; refused by the
budget, speculation stops for the run, with one warning).
"""
from __future__ import annotations

import concurrent.futures as cf
import logging
from dataclasses import dataclass

from ...store import LeaseMode, SwapSpaceError, Tier
from ..state_store import Use
from ..shards import StateKind

log = logging.getLogger("offload")

MAX_CALM = 64  # the most steps in a row without clipping that speculation waits for after misses


@dataclass
class SpeculationCounts:
    """Cumulative counts for rt.stats()["speculation"]: steps that speculated, and unit updates by outcome."""

    steps: int = 0  # steps whose backward speculated
    committed: int = 0  # unit updates that stood at opt.step()
    missed: int = 0  # run again at opt.step() (clipping fired, or hyperparameters changed)
    voided: int = 0  # taken back without a step (zero_grad, a state dict, another gather first)


class Speculation:
    """When to speculate, which chunks, and how a speculative update is taken back. The training thread calls it
    (from BackwardUpdates and the update path); the optimizer lane does the speculative updates themselves
    (optimizer_pipeline.py: UnitUpdate.speculative)."""

    def __init__(self, enabled: bool, states, pipeline):
        self.enabled = enabled
        self._states = states  # UnitStateStore
        self._pipeline = pipeline  # OptimizerPipeline (its states read ahead)
        self.calm = 0  # steps in a row, up to the last, whose coefficient was exactly 1.0
        self.calm_needed = 1  # what the next speculation waits for: doubled by a miss, 1 again after a commit
        self.counts = SpeculationCounts()
        self.refused = False  # the nvme budget had no room for spare slots: off for the run
        self.last_speculated = False  # the last step's backward queued speculative updates

    def allowed(self) -> bool:
        """The next backward may speculate: on, and the last calm_needed steps did not clip."""
        return self.enabled and not self.refused and self.calm >= self.calm_needed

    def may_choose(self, unit) -> bool:
        """chunks_for(unit) may choose a chunk: its master and optimizer states are homed on nvme (a cheap check by
        the unit's tiers, before anything is registered; residency is chunks_for's)."""
        shards = unit.shards
        return (shards.moments_registered and not self.refused and shards.tiers.optimizer is Tier.NVME
                and (not shards.master_is_param or shards.tiers.params is Tier.NVME))

    def chunks_for(self, unit) -> frozenset:
        """Indices of `unit`'s chunks to update in the backward: those whose master and optimizer states are all
        on nvme and not resident (their spares registered here, on first use)."""
        shards = unit.shards
        if not shards.moments_registered or self.refused:
            return frozenset()
        states = self._states
        kinds = [shards.master_kind()] + list(shards.schema.states)
        chosen = []
        for c in shards.chunks:
            specs = [shards.spec(kind, c) for kind in kinds]
            if not all(s.home is Tier.NVME and not states.is_resident(s) for s in specs):
                continue
            try:
                for s in specs:
                    if not states.has(s.spare()):
                        states.register(s.spare()).result()  # a slot reserved, nothing written
            except SwapSpaceError as exc:
                self.refused = True
                log.warning("offload: speculative updates are off for this run: the nvme budget has no room for "
                            "the spare slots they write into (%s). Raise nvme_budget by the optimizer states' size "
                            "to use them, or set Config.speculative_updates=False to silence this.", exc)
                break
            chosen.append(c.index)
        return frozenset(chosen)

    def end_step(self, clipped: bool, speculated: bool) -> None:
        """A step ended (or was skipped: `clipped`); `speculated`: its backward queued speculative updates."""
        if speculated:  # a miss backs off; a commit shows the run is calm again
            self.calm_needed = min(2 * self.calm_needed, MAX_CALM) if clipped else 1
        self.calm = 0 if clipped else self.calm + 1
        self.last_speculated = speculated
        self.counts.steps += int(speculated)

    def undo(self, update) -> None:
        """Take a speculative update back: once it and its writes are over, the exchanged slots go back, so the
        shard's slots hold the states from before it. Blocks the caller (a miss or a void: not the common path)."""
        cf.wait([update.done])  # the lane's update is over (its writes are all listed then)
        cf.wait(update.written)  # and they landed, or failed
        states = self._states

        def exchange_back():
            for spec in update.exchanged:
                states.exchange(spec, spec.spare())  # the new states (or a failed write's) go to the spare

        # a read ahead of these states since (a forward before the step reads the next update's) holds the new
        # bytes: given back, and none may start again until the slots are back
        self._pipeline.take_back_read_ahead([spec.key for spec in update.exchanged], exchange_back)
        update.exchanged.clear()
        update.done.result()  # a failed update fails the step that takes it back
        for written in update.written:
            written.result()

    def void(self, update) -> None:
        """Undo, and the compute-dtype param of the chunks it stepped rewritten from the old master: the param is
        the master's cast (every update writes it so; torch's rounding), so this is its value before the update."""
        self.undo(update)
        self.counts.voided += 1
        shards = update.unit.shards
        if shards.master_is_param:
            return  # the param is the master: its old bytes are back in its slot
        states = self._states
        for c in shards.chunks:
            ranges = update.runs_in(c) if c.index in update.chunks else []
            if not ranges:
                continue
            master = states.lease(shards.spec(StateKind.MASTER, c), Use.HOST, LeaseMode.READ)
            param = states.lease(shards.spec(StateKind.PARAM, c), Use.HOST, LeaseMode.UPDATE)
            try:
                m, p = master.wait(), param.wait()
                for a, b, _ in ranges:
                    p[a:b].copy_(m[a:b])
            finally:
                master.release()
                param.release().result()  # the unit's next gather reads it

    def report(self) -> dict:
        c = self.counts
        decided = c.committed + c.missed
        return {"enabled": self.enabled and not self.refused, "steps": c.steps, "committed": c.committed,
                "missed": c.missed, "voided": c.voided,
                "commit_rate": c.committed / decided if decided else None}
