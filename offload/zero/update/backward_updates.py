"""Updates queued in the backward, each when its unit's gradient is final, in one of two modes.

Speculative (the default, Config.speculative_updates; speculation.py): at a step whose previous step did not
clip, the updates run in the backward as if the coefficient were 1.0, their new states written beside the old;
opt.step() keeps them if it is exactly 1.0, else takes them back and updates from the old states. Exact, bitwise,
in every case; the contract below does not apply (a breach takes the updates back instead of raising).

Config.update_in_backward (opt-in): by default a unit's update waits for opt.step(), after the whole backward,
because global-norm clipping needs every gradient first: the optimizer's nvme reads and writes then run while
the disk would be idle only under the next forward, never under the backward. This mode queues unit u's update
right after u's gradient reduce, so the update's I/O and the fused AdamW overlap the rest of the backward.

What it costs, stated: the clip coefficient of step t is not known during step t's backward, so an update
queued there is scaled by step t-1's coefficient, min(1, max_norm / (norm_{t-1} + 1e-6)) (1 when step t-1
did not clip). Without clipping nothing is stale: results are bitwise those of the default path. The first
step of a run is exact (it has no previous coefficient) and arms the mode for the next.

The contract, each breach raised where it is seen (never trained through):
  - one final gradient reduce per unit per step: the backward passes before a step's last run inside
    rt.no_sync() (local accumulation) or rt.accumulating() (reduced, not final); a second reduce of a unit
    whose update already ran (a second backward, or a step skipped) raises;
  - the hyperparameters the update read during the backward (lr, betas, eps, weight decay, step counts)
    are those opt.step() sees: an LR scheduler steps after opt.step(); a change in between raises;
  - checkpoints and optimizer state dicts are taken after opt.step(), not between a backward and its step.
A step left before its opt.step() (gradients cleared after a backward that raised, or to skip a batch) cannot
take back the updates that already ran: their units keep them, with their step counts advanced, and a warning
names them (abandon); the next backward starts a new step.
Both modes arm only with one offload optimizer over the runtime (each optimizer's step() ends a step of its
own), after a step whose backward reduced each unit once. Units with trained parameters outside it, or (with
several ranks) that did not give every parameter a gradient on this rank, are updated at opt.step() as usual,
with the same coefficient: whether a step is armed is decided from what every rank saw alike (the last step's
reduces and clip coefficient, which are collectives).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

from .speculation import Speculation

log = logging.getLogger("offload")


@dataclass(frozen=True)
class Issued:
    """An update queued in the backward: what opt.step() must find the same."""

    unit: object  # ShardedUnit
    runs: tuple  # optimizer_pipeline.Run, captured when queued
    speculative: object = None  # the UnitUpdate of a speculative update (speculation.py); None: update_in_backward's
    factor: float = 1.0  # the gradient factor a speculative update applied: the loss scale's 1/S (else 1.0)


class BackwardUpdates:
    """The mode's bookkeeping for one runtime: when it is armed, which units it updated this step, and the
    clip coefficient it applies. Called from the training thread only (reduce hooks, clip, opt.step)."""

    def __init__(self, enabled: bool, path, speculation: Speculation):
        self.enabled = enabled
        # the update path (step.py) that owns this: it queues one unit's update on the optimizer lane
        # (queue_one), knows the live optimizers and the loss scale's 1/S the gradients carry (1.0: none), and
        # drops what was read of a unit whose speculative update is taken back (taken_back)
        self._path = path
        self.speculation = speculation  # without update_in_backward: updates in the backward at steps that do not
        #                                 clip, taken back if the step clips after all (speculation.py)
        self._previous_coef: float | None = None  # the last finished step's clip coefficient (None: no step yet)
        self._single_reduce = False  # the last finished step reduced every unit at most once
        self._armed: bool | None = None  # decided at this step's first reduce
        self._reduced: set[str] = set()  # unit uids reduced since the last opt.step()
        self._reduced_twice = False
        self.issued: dict[int, Issued] = {}  # id(unit) -> the update queued in this step's backward
        self._clip_coef: float | None = None  # this step's own coefficient (rt.clip_grad_norm_), for the next
        self.last: dict | None = None  # the last step's coefficients, for rt.stats()
        self._warned = False
        self.accumulating = False  # inside rt.accumulating(): this backward is not its step's last
        self._speculated = False  # this step's backward queued a speculative update
        self._missed = False  # and opt.step() ran one of them again (a clip, or other hyperparameters)

    @property
    def armed(self) -> bool:
        """This step's updates are queued in the backward: with the previous step's coefficient
        (update_in_backward), or speculatively with 1.0 (speculation.py)."""
        return bool(self._armed)

    def scale(self, exact: float) -> float:
        """The clip coefficient the updates opt.step() queues use: the previous step's when update_in_backward
        is armed, else `exact`."""
        return self._previous_coef if self.armed and self.enabled else exact

    def _may_arm(self) -> bool:
        """Every condition of arming but the optimizer count: a step before, whose backward reduced each unit once,
        and the mode on (speculation: that step did not clip)."""
        return (self._previous_coef is not None and self._single_reduce
                and (self.enabled or self.speculation.allowed()))

    def expects_updates_in_backward(self) -> bool:
        """The next backward will (most likely) queue updates: the schedule reads their states ahead under the
        forward instead of the backward. Speculation: if the last step's did (some chunk qualified)."""
        return self._may_arm() and (self.enabled or self.speculation.last_speculated)

    def on_reduce(self, unit) -> None:
        """Unit `unit`'s gradient reduce was just queued (its `grads` future is the reduce)."""
        if unit.uid in self._reduced:
            self._reduced_twice = True
            if id(unit) in self.issued and self.issued[id(unit)].speculative is not None:
                self.void(unit)  # its gradient changes again: the step will update it from scratch
            elif id(unit) in self.issued:
                raise RuntimeError(
                    f"offload.Config.update_in_backward: {unit.label}'s gradient was reduced again after its update "
                    "ran in the backward (a second backward, or gradient accumulation outside rt.no_sync() / "
                    "rt.accumulating(), or a backward whose opt.step() was skipped). Run the micro-batches before "
                    "a step's last inside `with rt.accumulating():` (or rt.no_sync()) and call opt.step() after "
                    "the last, or set update_in_backward=False.")
            return
        if self.accumulating:
            return  # not the step's last backward: the update waits for the reduce that makes the gradient final
        self._reduced.add(unit.uid)
        optimizers = self._path.live_optimizers() if self._armed is None or self._armed else []
        if self._armed is None:
            self._armed = self._may_arm() and len(optimizers) == 1
        if not self._armed:
            return
        opt = optimizers[0]
        if not self.enabled and not self.speculation.may_choose(unit):
            return  # no chunk of it can be speculated (its states in memory): its runs would go unused
        runs = opt.backward_runs(unit, checked_at_step=not self.enabled) if opt.holds_all_of(unit) else None
        if not runs:
            return
        if self.enabled:
            self._path.queue_one(unit, runs, self._previous_coef, opt.schema, None)
            self.issued[id(unit)] = Issued(unit, tuple(runs))
            return
        chunks = self.speculation.chunks_for(unit)
        if chunks:
            factor = self._path.loss_scale.unscale  # as if the step does not clip (nor overflow)
            update = self._path.queue_one(unit, runs, factor, opt.schema, chunks)
            self.issued[id(unit)] = Issued(unit, tuple(runs), update, factor)
            self._speculated = True

    def on_clip(self, coefficient: float) -> None:
        self._clip_coef = coefficient

    # ---- speculative updates taken back (speculation.py) ----------------------------------------------------
    def void(self, unit) -> None:
        """`unit`'s speculative update is taken back: its step is not coming for this backward's gradient."""
        entry = self.issued.pop(id(unit))
        self.speculation.void(entry.speculative)
        self._path.taken_back(unit)

    def void_all(self) -> None:
        for key in [k for k, e in self.issued.items() if e.speculative is not None]:
            self.void(self.issued[key].unit)

    def before_gather(self, unit) -> None:
        """A gather of `unit` is about to be issued: one between its speculative update and opt.step() (a forward
        or backward before the step: accumulation outside rt.accumulating(), eval, a skipped step) must read
        the param as it was, so the update is taken back first."""
        entry = self.issued.get(id(unit)) if self.issued else None
        if entry is not None and entry.speculative is not None:
            self.void(unit)

    def check_before_step(self, work) -> None:
        """opt.step() is about to step [(unit, runs)], before it changes anything (a step count): update_in_backward's
        updates must be among them with the same runs, else it raises, and the step can be retried or abandoned
        (zero_grad). Speculative updates are not checked here: a difference takes them back (check_step)."""
        runs_of = {id(unit): tuple(runs) for unit, runs in work}
        for key, entry in self.issued.items():
            if entry.speculative is not None:
                continue
            if key not in runs_of:
                raise RuntimeError(
                    f"offload.Config.update_in_backward: {entry.unit.label} was updated during the backward but "
                    "opt.step() does not step it now (its gradient was cleared or changed in between, e.g. "
                    "zero_grad() before opt.step()). Leave the gradients alone between loss.backward() and "
                    "opt.step(), or set update_in_backward=False.")
            if runs_of[key] != entry.runs:
                raise RuntimeError(
                    f"offload.Config.update_in_backward: {entry.unit.label} was updated during the backward with "
                    "hyperparameters or step counts that differ from those opt.step() sees now (an LR or weight "
                    "decay changed between loss.backward() and opt.step()). Change them before the backward (step "
                    "LR schedulers after opt.step()), or set update_in_backward=False. Nothing was stepped: put "
                    "them back and call opt.step() again, or clear the gradients (opt.zero_grad()) to leave the "
                    "step, whose updates in the backward then stay.")

    def void_unstepped(self, units) -> None:
        """opt.step() steps `units`: a speculative update of any other unit is taken back (its gradient is not
        stepped now)."""
        stepped = {id(u) for u in units}
        for key in [k for k, e in self.issued.items() if e.speculative is not None and k not in stepped]:
            self.void(self.issued[key].unit)

    def abandon(self, count_step) -> None:
        """The gradients are cleared before this step's opt.step() (zero_grad after a backward that raised, or a
        step left): speculative updates are taken back; update_in_backward's already ran and cannot be, so their
        units keep them, with their step counts advanced to match (`count_step(units)`), and a warning names
        them. The next backward starts a new step (else every later reduce of these units raised)."""
        self.void_all()
        if not self.issued:
            return
        units = [e.unit for e in self.issued.values()]
        count_step(units)
        log.warning("offload: Config.update_in_backward: the gradients were cleared before opt.step() (after a "
                    "backward that raised, or a step left out); %d unit(s) had already been updated in that backward "
                    "and keep the update, their step counts advanced: %s", len(units),
                    ", ".join(u.label for u in units))
        self._forget_step()

    def check_step(self, unit, runs, coefficient: float) -> frozenset:
        """opt.step() is about to update `unit` with `runs` and clip `coefficient`: the indices of its chunks the
        backward already updated for good (empty: the step updates them all). update_in_backward: every chunk
        (check_before_step compared the runs). Speculative: the chunks it stepped if
        the coefficient is exactly 1.0 and the runs are the same (commit), else none, once it is taken back
        (miss)."""
        done = self.issued.get(id(unit))
        if done is None:
            return frozenset()
        if done.speculative is not None:
            if coefficient == done.factor and tuple(runs) == done.runs:
                self.speculation.counts.committed += 1
                return done.speculative.chunks
            self.speculation.undo(done.speculative)
            self.speculation.counts.missed += 1
            self._missed = True
            del self.issued[id(unit)]
            return frozenset()
        return frozenset(c.index for c in unit.shards.chunks)  # (check_before_step compared the runs)

    def end_step(self, coefficient: float) -> None:
        """opt.step() has queued every update of this step, with clip `coefficient` (rt.grad_scale)."""
        exact = self._clip_coef if self._clip_coef is not None else 1.0
        # any miss backs speculation off, not only a clip's (an LR scheduler stepped before opt.step() misses
        # every step: without it each step paid its updates twice)
        clipped = coefficient != self._path.loss_scale.unscale or self._missed
        self.speculation.end_step(clipped=clipped, speculated=self._speculated)
        if self.enabled:
            self.last = {"applied": self.scale(exact), "exact": exact, "in_backward": len(self.issued)}
        self._previous_coef = exact
        self._single_reduce = not self._reduced_twice
        if self.enabled:
            if self._reduced_twice and not self._warned:
                self._warned = True
                log.warning("offload: Config.update_in_backward stays off while a step reduces a unit's gradient "
                            "more than once (gradient accumulation outside rt.accumulating() / rt.no_sync()): "
                            "updates wait for opt.step(). Run the micro-batches before a step's last inside "
                            "`with rt.accumulating():` to use it.")
        self._forget_step()

    def skip_step(self) -> None:
        """The step is skipped (its gradients overflowed: offload.GradScaler): the backward's speculative updates
        are taken back, and speculation waits as after a step that clipped."""
        self.void_all()
        assert not self.issued, "update_in_backward's updates cannot be skipped (GradScaler refuses the mode)"
        self.speculation.end_step(clipped=True, speculated=self._speculated)
        self._single_reduce = not self._reduced_twice
        self._forget_step()

    def _forget_step(self) -> None:
        self._armed, self._reduced, self._reduced_twice = None, set(), False
        self.issued, self._clip_coef, self._speculated, self._missed = {}, None, False, False

    def check_quiet(self, what: str) -> None:
        """`what` reads optimizer states: between a backward that updated units and its opt.step(), speculative
        updates are taken back (the states are the step's before); update_in_backward's are refused."""
        self.void_all()
        if self.issued:
            raise RuntimeError(
                f"offload: {what} was called between a backward whose updates already ran "
                "(Config.update_in_backward) and its opt.step(); the states are a step ahead of the step counts "
                "there. Call it after opt.step().")
