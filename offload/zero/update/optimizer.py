"""Optimizers over the runtime's shards: each rank steps its own shard of every unit where the states live.

`offload.AdamW(params)` (and AdamW8bit, Lion) becomes its sharded subclass here when the params belong to an
offload runtime (the dispatch is registered with offload.optim at import; the optim package does not import
the runtime). What the family stores and how a chunk is updated is its schema (offload/optim/schema.py):
nothing below knows Adam.

step() decides what to update, as torch.optim would (param groups, per-parameter step counts, parameters that
got no gradient are not stepped, the clip coefficient is the kernel's grad_scale) and hands it to the
optimizer pipeline (optimizer_pipeline.py), which runs the family's step chunk by chunk on the optimizer lane.
When compute is bf16 the step writes the new bf16 param chunk in the same pass.
"""
from __future__ import annotations


import torch

from ...optim.adamw import ADAMW_BF16, AdamW, _check_hyper
from ...optim.adamw8bit import AdamW8bit
from ...optim.base import SchemaOptimizer, check_groups, register_sharded
from ...optim.lion import Lion
from ..active import current
from . import optim_states
from .optimizer_pipeline import Run


def _placeholders(params):
    """Views of a gathered unit (what model.parameters() yields while a unit is gathered, e.g. persistent
    units) stand for their placeholder parameters."""
    out = []
    for x in params:
        if isinstance(x, dict):
            out.append(dict(x, params=[getattr(p, "_offload_placeholder", p) for p in _as_list(x["params"])]))
        else:
            out.append(getattr(x, "_offload_placeholder", x))
    return out


def _as_list(params):
    return [params] if isinstance(params, torch.Tensor) else list(params)


def _flat_params(params):
    for x in params:
        if isinstance(x, dict):
            yield from _as_list(x["params"])
        else:
            yield x


def wants_sharded(params) -> bool:
    """Params of a sharded model, or meta params of a model built inside an open offload.init block."""
    flat = list(_flat_params(_placeholders(params)))
    if any(hasattr(p, "_offload_unit") for p in flat):
        return True
    return current() is not None and any(isinstance(p, torch.Tensor) and p.device.type == "meta" for p in flat)


def _hyper(group: dict) -> dict:
    """The values of a param group an update uses, copied at step() (a scheduler may change them after: a
    tensor lr in place, as torch's schedulers do, so tensors are copied as the numbers they hold now)."""
    def now(v):
        if isinstance(v, torch.Tensor) and v.numel() == 1:
            return v.item()
        return tuple(now(x) for x in v) if isinstance(v, tuple) else v

    return {k: now(v) for k, v in group.items() if k != "params"}


class ShardedOptimizer:
    """Mixin over an offload optimizer class (its `schema` says what it stores): the runtime steps it."""

    display = "offload optimizer"

    def _build(self, params, defaults: dict) -> None:
        """Link to the runtime that owns `params` (placeholders from `model.parameters()`)."""
        params = _placeholders(list(params))
        name = self.display
        rt = current()
        if rt is not None and any(isinstance(p, torch.Tensor) and p.device.type == "meta"
                                  and not hasattr(p, "_offload_unit") for p in _flat_params(params)):
            rt.materialize_pending()  # built in the block, not used yet: shard it now
        torch.optim.Optimizer.__init__(self, params, defaults)
        runtimes = set()
        for group in self.param_groups:
            for p in group["params"]:
                unit = getattr(p, "_offload_unit", None)
                if unit is None:
                    raise ValueError(
                        f"{name}: a parameter is not owned by an offload runtime; build or rt.wrap() the "
                        "model inside `with offload.init(...)` before creating the optimizer, and pass only "
                        "its parameters"
                    )
                runtimes.add(p._offload_runtime)
        if len(runtimes) > 1:
            raise ValueError(f"{name}: parameters from several offload runtimes")
        self.path = runtimes.pop().updates  # the step's state and hand-off (step.py), not the runtime
        self.path.add_optimizer(self, name)

    # ---- helpers ----------------------------------------------------------------------------
    def _slot_index(self) -> dict:
        """(id(unit), slot) -> (group, param) over every parameter, built once and again only when the groups
        change (add_param_group, load_state_dict): the backward asks for it per unit (update_in_backward)."""
        groups = [(g, g["params"], len(g["params"])) for g in self.param_groups]  # held: no id is reused
        cached = getattr(self, "_slot_cache", None)
        if cached is None or len(cached[0]) != len(groups) or any(
                a[0] is not b[0] or a[1] is not b[1] or a[2] != b[2] for a, b in zip(cached[0], groups)):
            by_slot = {(id(p._offload_unit), p._offload_slot): (g, p) for g in self.param_groups for p in g["params"]}
            self._slot_cache = cached = (groups, by_slot)
        return cached[1]

    def _unit_plan(self, units=None):
        """unit -> [(piece, group, param)] for this rank's shard, in shard order (every unit, or `units`)."""
        by_slot = self._slot_index()
        plan = []
        for unit in self.path.units if units is None else units:
            entries = []
            for piece in unit.layout.pieces(self.path.rank):
                hit = by_slot.get((id(unit), piece.slot))
                if hit is not None:
                    entries.append((piece,) + hit)
            if entries:
                plan.append((unit, entries))
        return plan

    def _live_runs(self, unit, entries, ahead: int, hypers: dict | None = None) -> list[Run]:
        """The kernel runs of `unit`'s pieces that got a gradient, with their hyperparameters as they are now and
        step counts `ahead` past the recorded ones. `hypers`: id(group) -> its values, shared by the units of one
        step() (read once a group, not once a unit)."""
        live = [(pc, g, p) for pc, g, p in entries if unit.has_grad and bool(unit.used[pc.slot])]
        hypers = {} if hypers is None else hypers
        for _, g, _ in live:
            if id(g) not in hypers:
                hypers[id(g)] = _hyper(g)
        return [Run(lo, hi, hypers[id(g)], step) for lo, hi, g, step in _runs(live, self.state, ahead)]

    def holds_all_of(self, unit) -> bool:
        """Every parameter of `unit` that trains is one of this optimizer's."""
        mine = self._slot_index()
        return all((id(unit), slot.index) in mine for slot in unit.layout.slots if slot.requires_grad)

    def backward_runs(self, unit, checked_at_step: bool = False) -> list[Run] | None:
        """An update in the backward: the runs opt.step() will give `unit` (captured now), or None to leave it
        to opt.step(). With several ranks, a parameter with no gradient here may have one on another rank
        (opt.step() ORs the flags first), so only a unit whose every trained parameter got one, unless
        `checked_at_step` (a speculative update: opt.step() compares the runs again and redoes a unit whose runs
        differ)."""
        plan = self._unit_plan([unit])
        if not plan:
            return None
        check_groups(self.display, self.param_groups)  # (before an update runs in the backward)
        trained = [s.index for s in unit.layout.slots if s.requires_grad]
        if self.path.group.distributed and not checked_at_step and not all(bool(unit.used[i]) for i in trained):
            return None
        unit.check_requires_grad()
        return self._live_runs(unit, plan[0][1], ahead=1)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        check_groups(self.display, self.param_groups)  # (a key may have been set since construction)
        path = self.path
        path.check_open("offload.AdamW.step")
        path.check_steppable()
        path.flush_grads()
        path.sync_used()
        plan = [(unit, entries) for unit, entries in self._unit_plan()
                if any(unit.has_grad and bool(unit.used[pc.slot]) for pc, _, _ in entries)]
        for unit, _ in plan:
            unit.check_requires_grad()  # before any unit is stepped: all or nothing
        self._outdate_kept_units_stepped_elsewhere(plan)
        # everything the update needs is read now (a scheduler may change the groups once step() returns), with
        # the step counts this step gives; the backward's updates are checked against it before a count changes
        hypers: dict = {}
        work = [(unit, self._live_runs(unit, entries, ahead=1, hypers=hypers)) for unit, entries in plan]
        path.backward_updates.check_before_step(work)
        self.count_step([unit for unit, _ in plan], plan)
        # path.grad_scale stays: another optimizer over other parameters may step after this one with the same
        # clipping coefficient; the next backward (or rt.zero_grad) resets it.
        path.step_units(work, self.schema)
        return loss

    def _outdate_kept_units_stepped_elsewhere(self, plan) -> None:
        """A unit kept gathered (persistent: a LoRA adapter) whose elements all lie in other ranks' shards has no
        pieces here, so nothing marked its copy outdated, while the ranks that hold them stepped it: they re-gathered
        it before its next use and this rank did not (a collective met another unit's: gloo aborted, on LoRA over an
        MoE base on 2 ranks). Marked here from the gradient flags every rank shares (sync_used)."""
        from ..state_machines import UnitState

        planned, mine = {id(u) for u, _ in plan}, self._slot_index()
        for unit in self.path.units:
            if (unit.persistent and id(unit) not in planned and unit.state is UnitState.UNSHARDED
                    and any(bool(unit.used[s.index]) for s in unit.layout.slots if (id(unit), s.index) in mine)):
                unit.on_shard_written()

    def count_step(self, units, plan=None) -> None:
        """Advance the step count of every parameter of `units` that got a gradient (once each). `plan`: their
        _unit_plan, when the caller has it."""
        counted = set()
        for unit, entries in self._unit_plan(units) if plan is None else plan:
            for piece, group, p in entries:
                if unit.has_grad and bool(unit.used[piece.slot]) and id(p) not in counted:
                    counted.add(id(p))
                    state = self.state[p]
                    state["step"] = state.get("step", 0) + 1

    def zero_grad(self, set_to_none: bool = True):
        """Clear the gradients of this optimizer's parameters only (another optimizer's stay)."""
        self.path.zero_grad_params([p for g in self.param_groups for p in g["params"]], set_to_none)

    # ---- state dict (this rank's shard) -----------------------------------------------------
    def state_dict(self):
        """torch-style state dict of this rank's shard: per parameter its step and the elements of each of the
        family's logical states (AdamW: exp_avg, exp_avg_sq; AdamW8bit: the same, dequantized) that live in
        this rank's shard, as fp32 (1-D, with `shard_range`)."""
        self.path.backward_updates.check_quiet(f"{self.display}.state_dict")
        self.path.quiesce()  # every queued update is in the moments read below
        sd = super().state_dict()
        index = {}
        for group, gsd in zip(self.param_groups, sd["param_groups"]):
            for p, i in zip(group["params"], gsd["params"]):
                index[id(p)] = i
        state = {}
        for unit, entries in self._unit_plan():
            have = unit.shards.moments_registered
            views = {v.name: optim_states.read_view(unit, v.name) for v in self.schema.logical} if have else {}
            for piece, group, p in entries:
                st = self.state.get(p, {})
                if "step" not in st:
                    continue
                state[index[id(p)]] = {
                    "step": torch.tensor(float(st["step"])),
                    **{name: values[piece.lo:piece.hi].clone() for name, values in views.items()},
                    "shard_range": (piece.param_lo, piece.param_lo + piece.hi - piece.lo),
                }
        sd["state"] = state
        sd["world_size"] = self.path.world_size
        return sd

    def full_state_dict(self) -> dict:
        """torch.optim's state dict of the whole run, as torch.optim.AdamW (or the family's torch-side twin) keeps
        it: per parameter its step and each logical state (AdamW: exp_avg, exp_avg_sq, fp32) in the parameter's
        shape. Collective: every rank calls it and gets the whole. `torch.optim.AdamW(params).load_state_dict(
        opt.full_state_dict())` goes on from this run; load_state_dict here takes it back (or torch's own)."""
        self.path.every_rank_calls(f"{self.display}.full_state_dict()")  # collective: refused on one rank, not hung
        sd = self.state_dict()  # this rank's pieces (quiesced)
        names = [v.name for v in self.schema.logical]
        params = [p for g in self.param_groups for p in g["params"]]
        slots = [p._offload_unit.layout.slots[p._offload_slot] for p in params]
        offsets, total = [], 0
        for slot in slots:
            offsets.append(total)
            total += slot.numel
        steps = torch.zeros(len(params), dtype=torch.float64)
        values = torch.zeros(len(names), max(1, total), dtype=torch.float32)
        for i, st in sd["state"].items():
            steps[i] = float(st["step"])
            lo, hi = st["shard_range"]
            for k, n in enumerate(names):
                values[k, offsets[i] + lo:offsets[i] + hi] = st[n]
        if self.path.group.distributed:  # each rank holds its pieces: the others' are zeros here
            from ..collectives import comm

            comm.all_reduce_host_(self.path.group, steps, "max", what="optimizer step counts")
            comm.all_reduce_host_(self.path.group, values, "sum", what="optimizer states")
        state = {}
        for i, slot in enumerate(slots):
            if steps[i] > 0:
                state[i] = {"step": torch.tensor(float(steps[i])),
                            **{n: values[k, offsets[i]:offsets[i] + slot.numel].view(slot.shape).clone()
                               for k, n in enumerate(names)}}
        return {"state": state, "param_groups": sd["param_groups"]}

    def load_state_dict(self, state_dict):
        """This optimizer's own state dict (state_dict(): this rank's shard, or full_state_dict()), or torch.optim's
        of the same parameters (torch.optim.AdamW's, moments in each parameter's shape): each rank takes its
        pieces. A state whose size is not the parameter's is refused naming the parameter and both shapes."""
        where = f"{self.display}.load_state_dict"
        if state_dict.get("world_size", self.path.world_size) != self.path.world_size:
            raise ValueError(f"{where}: saved with world_size {state_dict['world_size']}, loading with "
                             f"{self.path.world_size}")
        groups = state_dict["param_groups"]
        check_groups(self.display, groups, " of the state dict")
        if len(groups) != len(self.param_groups):
            raise ValueError(f"{where}: param group count differs")
        names = [v.name for v in self.schema.logical]
        for saved in state_dict["state"].values():
            missing = [n for n in names if n not in saved]
            if missing:
                raise ValueError(f"{where}: the state dict has no {', '.join(missing)} (saved by another optimizer "
                                 f"family than {self.schema.name!r}?); load it into the optimizer that saved it")
        by_index = {}
        for group, saved in zip(self.param_groups, groups):
            if len(saved["params"]) != len(group["params"]):
                raise ValueError(f"{where}: a param group of the state dict has {len(saved['params'])} parameters, "
                                 f"this optimizer's {len(group['params'])}")
            for p, i in zip(group["params"], saved["params"]):
                by_index[i] = p
        saved_state = state_dict["state"]
        # every piece read and checked against its parameter's shape before anything is written: all or nothing
        loads = []
        for unit, entries in self._unit_plan():
            touched = []
            for piece, _, p in entries:
                i = _index_of(by_index, p)
                if i in saved_state:
                    st = saved_state[i]
                    slot = unit.layout.slots[piece.slot]
                    touched.append((piece, p, int(st["step"]), {n: _piece_of(st, n, piece, slot, where) for n in names}))
            if touched:
                loads.append((unit, touched))
        self.path.backward_updates.check_quiet(f"{self.display}.load_state_dict")  # (would shadow what is loaded)
        self.path.quiesce()  # no update may be running while the moments are replaced
        for group, saved in zip(self.param_groups, groups):
            for key, value in saved.items():
                if key != "params":
                    group[key] = value
        for unit, touched in loads:
            optim_states.register(unit, self.schema)
            views = {n: optim_states.read_view(unit, n) for n in names}
            for piece, p, step, values in touched:
                for n in names:
                    views[n][piece.lo:piece.hi].copy_(values[n])
                self.state[p]["step"] = step
            for n in names:
                optim_states.write_view(unit, n, views[n])


class ShardedAdamW(ShardedOptimizer, AdamW):
    """AdamW for parameters owned by an offload runtime (placeholders from `model.parameters()`)."""

    display = "offload.AdamW"

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, amsgrad=False, *,
                 maximize=False, foreach=None, capturable=False, differentiable=False, fused=None,
                 moments_dtype=torch.float32):
        params = self.__dict__.pop("_offload_params", params)
        del foreach, fused  # accepted like offload.AdamW: always one fused pass per shard range
        if amsgrad or capturable or differentiable:
            raise ValueError("offload.AdamW: amsgrad / capturable / differentiable are not supported")
        _check_hyper(lr, betas, eps, weight_decay, moments_dtype)
        if moments_dtype == torch.bfloat16:
            self.schema = ADAMW_BF16  # (this optimizer's: its states are bf16 moments)
        self._build(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, amsgrad=False,
                                 maximize=maximize, moments_dtype=moments_dtype))


class ShardedAdamW8bit(ShardedOptimizer, AdamW8bit):
    display = "offload.AdamW8bit"


class ShardedLion(ShardedOptimizer, Lion):
    display = "offload.Lion"


register_sharded(AdamW, wants_sharded, ShardedAdamW)
register_sharded(AdamW8bit, wants_sharded, ShardedAdamW8bit)
register_sharded(Lion, wants_sharded, ShardedLion)


def register_family(base: type[SchemaOptimizer]) -> type:
    """Make an optimizer class of another family (a SchemaOptimizer subclass with its schema) step a runtime's
    shards as the built-in ones do; returns its sharded subclass. Nothing else in the runtime changes."""
    sharded = type(f"Sharded{base.__name__}", (ShardedOptimizer, base), {"display": base.display})
    register_sharded(base, wants_sharded, sharded)
    return sharded


def _piece_of(saved: dict, name: str, piece, slot, where: str) -> torch.Tensor:
    """The elements of `piece` in a saved state: a shard's slice (state_dict(): `shard_range`) or the whole
    parameter's (full_state_dict(), torch.optim's), checked against the parameter's shape."""
    value = torch.as_tensor(saved[name])
    n = piece.hi - piece.lo
    if "shard_range" in saved:
        lo, hi = saved["shard_range"]
        if (lo, hi) == (piece.param_lo, piece.param_lo + n) and value.numel() == n:
            return value.reshape(-1)
        raise ValueError(f"{where}: parameter {slot.fqn or slot.index} (shape {tuple(slot.shape)}): the state dict's "
                         f"{name} holds elements [{lo}, {hi}) and this rank's shard [{piece.param_lo}, "
                         f"{piece.param_lo + n}); load a state dict of the same model and world size, or its "
                         "full_state_dict()")
    if value.numel() != slot.numel:
        raise ValueError(f"{where}: parameter {slot.fqn or slot.index} has shape {tuple(slot.shape)} but the state "
                         f"dict's {name} has shape {tuple(value.shape)}; load a state dict of the same model (its "
                         "parameters in the same order)")
    return value.reshape(-1)[piece.param_lo:piece.param_lo + n]


def _index_of(by_index, p):
    for i, q in by_index.items():
        if q is p:
            return i
    return None


def _runs(live, state, ahead: int = 0):
    """Merge adjacent pieces with the same group and step into one kernel call: (lo, hi, group, step)."""
    runs = []
    for piece, group, p in live:
        step = state[p].get("step", 0) + ahead if p in state else ahead
        if runs and runs[-1][1] == piece.lo and runs[-1][2] is group and runs[-1][3] == step:
            runs[-1][1] = piece.hi
        else:
            runs.append([piece.lo, piece.hi, group, step])
    return [tuple(r) for r in runs]
