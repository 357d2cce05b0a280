"""AdamW over the runtime's shards: each rank steps its own shard of every unit where the states live.

Per unit and step: fetch the fp32 master (the param shard itself when compute is fp32), exp_avg,
exp_avg_sq and the grad shard from their tiers (nvme: read into host memory), run the fused kernel
(`offload.optim.step_flat` -> `offload.ops.adamw_step_`) over the ranges of each parameter (grouped by
hyperparameters and step count, so param groups and parameters that got no gradient behave as in
torch.optim.AdamW; the clipping coefficient is the kernel's grad_scale), write the states back, and when
compute is bf16 let the kernel write the new bf16 param shard in the same pass, then store it in its home
tier. The next gather of a unit sees the new values.

`offload.AdamW(params)` returns this class when the params belong to an offload runtime.
"""
from __future__ import annotations

import torch

from ..optim.adamw import AdamW, _check_hyper, step_flat
from .state import UnitState


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


def owned_by_runtime(params) -> bool:
    return any(hasattr(p, "_offload_unit") for p in _flat_params(params))


def wants_sharded(params) -> bool:
    """Params of a sharded model, or meta params of a model built inside an open offload.init block."""
    from .runtime import current

    flat = list(_flat_params(_placeholders(params)))
    if any(hasattr(p, "_offload_unit") for p in flat):
        return True
    return current() is not None and any(isinstance(p, torch.Tensor) and p.device.type == "meta" for p in flat)


class ShardedAdamW(AdamW):
    """AdamW for parameters owned by an offload runtime (placeholders from `model.parameters()`)."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, amsgrad=False, *,
                 maximize=False, foreach=None, capturable=False, differentiable=False, fused=None,
                 moments_dtype=torch.float32):
        params = self.__dict__.pop("_offload_params", params)
        params = _placeholders(list(params))
        del foreach, fused  # accepted like offload.AdamW: always one fused pass per shard range
        if amsgrad or capturable or differentiable:
            raise ValueError("offload.AdamW: amsgrad / capturable / differentiable are not supported")
        _check_hyper(lr, betas, eps, weight_decay, moments_dtype)
        if moments_dtype != torch.float32:
            raise ValueError("offload.AdamW: sharded parameters keep fp32 moments (moments_dtype=torch.float32)")
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, amsgrad=False,
                        maximize=maximize, moments_dtype=moments_dtype)
        from .runtime import current

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
                        "offload.AdamW: a parameter is not owned by an offload runtime; build or rt.wrap() the "
                        "model inside `with offload.init(...)` before creating the optimizer, and pass only "
                        "its parameters"
                    )
                runtimes.add(unit.rt)
        if len(runtimes) > 1:
            raise ValueError("offload.AdamW: parameters from several offload runtimes")
        self.rt = runtimes.pop()

    # ---- helpers ----------------------------------------------------------------------------
    def _unit_plan(self):
        """unit -> [(piece, group, param)] for this rank's shard, in shard order."""
        by_slot = {}
        for group in self.param_groups:
            for p in group["params"]:
                by_slot[(id(p._offload_unit), p._offload_slot)] = (group, p)
        plan = []
        for unit in self.rt.units:
            entries = []
            for piece in unit.layout.pieces(self.rt.rank):
                hit = by_slot.get((id(unit), piece.slot))
                if hit is not None:
                    entries.append((piece,) + hit)
            if entries:
                plan.append((unit, entries))
        return plan

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        rt = self.rt
        rt._check_open("offload.AdamW.step")
        rt.flush_grads()
        rt.sync_used()
        fp32 = rt.compute_dtype == torch.float32
        storage = rt.storage
        stepped_params = set()
        for unit, _ in self._unit_plan():
            unit.check_requires_grad()  # before any unit is stepped: all or nothing
        for unit, entries in self._unit_plan():
            live = [(pc, g, p) for pc, g, p in entries if unit.has_grad and bool(unit.used[pc.slot])]
            if not live:
                continue
            k = unit.key
            master_key = f"{k}.param" if fp32 else f"{k}.master"
            if not storage.has(f"{k}.exp_avg"):  # moments start at zero, in the optimizer tier
                for name in (f"{k}.exp_avg", f"{k}.exp_avg_sq"):
                    storage.create(name, rt.optimizer_tier, "optim", numel=unit.layout.shard_numel,
                                   dtype=torch.float32)
            master = storage.acquire(master_key)
            exp_avg = storage.acquire(f"{k}.exp_avg")
            exp_avg_sq = storage.acquire(f"{k}.exp_avg_sq")
            grad = storage.acquire(f"{k}.grad")
            param = None if fp32 else storage.acquire(f"{k}.param")  # bf16 shard the kernel rewrites
            for piece, group, p in live:
                if id(p) not in stepped_params:
                    stepped_params.add(id(p))
                    state = self.state[p]
                    state["step"] = state.get("step", 0) + 1
            for lo, hi, group, step in _runs(live, self.state):
                step_flat(master[lo:hi], grad[lo:hi], exp_avg[lo:hi], exp_avg_sq[lo:hi],
                          None if param is None else param[lo:hi], group, step, rt.grad_scale)
            storage.release(master_key, master, dirty=True)
            storage.release(f"{k}.exp_avg", exp_avg, dirty=True)
            storage.release(f"{k}.exp_avg_sq", exp_avg_sq, dirty=True)
            storage.release(f"{k}.grad", grad)
            if param is not None:
                storage.release(f"{k}.param", param, dirty=True)
            del master, exp_avg, exp_avg_sq, grad, param
            if unit.state is UnitState.UNSHARDED:
                unit.stale = True  # persistent units re-gather before their next use
        # rt.grad_scale stays: another optimizer over other parameters may step after this one with the same
        # clipping coefficient; the next backward (or rt.zero_grad) resets it.
        return loss

    def zero_grad(self, set_to_none: bool = True):
        """Clear the gradients of this optimizer's parameters only (another optimizer's stay)."""
        self.rt.zero_grad_params([p for g in self.param_groups for p in g["params"]], set_to_none)

    # ---- state dict (this rank's shard) -----------------------------------------------------
    def state_dict(self):
        """torch-style state dict of this rank's shard: per parameter its step and the exp_avg /
        exp_avg_sq elements of the parameter that live in this rank's shard (1-D, with `shard_range`)."""
        sd = super().state_dict()
        index = {}
        for group, gsd in zip(self.param_groups, sd["param_groups"]):
            for p, i in zip(group["params"], gsd["params"]):
                index[id(p)] = i
        state = {}
        for unit, entries in self._unit_plan():
            storage = self.rt.storage
            have = storage.has(f"{unit.key}.exp_avg")
            m = storage.acquire(f"{unit.key}.exp_avg") if have else None
            v = storage.acquire(f"{unit.key}.exp_avg_sq") if have else None
            for piece, group, p in entries:
                st = self.state.get(p, {})
                if "step" not in st:
                    continue
                state[index[id(p)]] = {
                    "step": torch.tensor(float(st["step"])),
                    "exp_avg": m[piece.lo:piece.hi].clone(),
                    "exp_avg_sq": v[piece.lo:piece.hi].clone(),
                    "shard_range": (piece.param_lo, piece.param_lo + piece.hi - piece.lo),
                }
            if have:
                storage.release(f"{unit.key}.exp_avg", m)
                storage.release(f"{unit.key}.exp_avg_sq", v)
        sd["state"] = state
        sd["world_size"] = self.rt.world_size
        return sd

    def load_state_dict(self, state_dict):
        if state_dict.get("world_size", self.rt.world_size) != self.rt.world_size:
            raise ValueError("offload.AdamW.load_state_dict: saved with world_size "
                             f"{state_dict['world_size']}, loading with {self.rt.world_size}")
        groups = state_dict["param_groups"]
        if len(groups) != len(self.param_groups):
            raise ValueError("offload.AdamW.load_state_dict: param group count differs")
        by_index = {}
        for group, saved in zip(self.param_groups, groups):
            for key, value in saved.items():
                if key != "params":
                    group[key] = value
            for p, i in zip(group["params"], saved["params"]):
                by_index[i] = p
        saved_state = state_dict["state"]
        storage = self.rt.storage
        for unit, entries in self._unit_plan():
            touched = [(pc, p) for pc, g, p in entries if _index_of(by_index, p) in saved_state]
            if not touched:
                continue
            k = unit.key
            if not storage.has(f"{k}.exp_avg"):
                for name in (f"{k}.exp_avg", f"{k}.exp_avg_sq"):
                    storage.create(name, self.rt.optimizer_tier, "optim", numel=unit.layout.shard_numel,
                                   dtype=torch.float32)
            m = storage.acquire(f"{k}.exp_avg")
            v = storage.acquire(f"{k}.exp_avg_sq")
            for piece, p in touched:
                st = saved_state[_index_of(by_index, p)]
                m[piece.lo:piece.hi].copy_(st["exp_avg"])
                v[piece.lo:piece.hi].copy_(st["exp_avg_sq"])
                self.state[p]["step"] = int(st["step"])
            storage.release(f"{k}.exp_avg", m, dirty=True)
            storage.release(f"{k}.exp_avg_sq", v, dirty=True)

def _index_of(by_index, p):
    for i, q in by_index.items():
        if q is p:
            return i
    return None


def _flat_params(params):
    for x in params:
        if isinstance(x, dict):
            yield from _as_list(x["params"])
        else:
            yield x


def _runs(live, state):
    """Merge adjacent pieces with the same group and step into one kernel call: (lo, hi, group, step)."""
    runs = []
    for piece, group, p in live:
        step = state[p]["step"]
        if runs and runs[-1][1] == piece.lo and runs[-1][2] is group and runs[-1][3] == step:
            runs[-1][1] = piece.hi
        else:
            runs.append([piece.lo, piece.hi, group, step])
    return [tuple(r) for r in runs]
