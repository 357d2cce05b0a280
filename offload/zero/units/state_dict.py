"""`module.state_dict()` / `module.load_state_dict(sd)` on a wrapped model, so torch.save, HF
save_pretrained-style code and checkpoint loading see real values instead of the meta placeholders.

state_dict: the keys and order torch would give (the module's own state_dict walk, run on the placeholders),
with every parameter replaced by its gathered fp32 value (the master copy when compute is bf16) on the host,
and buffers as they are. load_state_dict: torch's own walk (its key rules and messages, each module's
_load_from_state_dict and load hooks) with assign=True over the placeholders, which only puts each loaded tensor
in its module's place; then each touched unit's full fp32 value is gathered, overwritten with those, and this
rank's shard written back to the master and the compute-dtype param shard (a gathered persistent unit
re-gathers before its next use). Optimizer moments are untouched. Both are collectives (every rank calls
them, with the same keys), and both gather whole units: a submodule's state dict costs its units' gathers. A
call on some ranks only is refused within Config.agreement_timeout (rt.every_rank_calls, collectives/agree.py).
"""
from __future__ import annotations

import contextlib
from collections import OrderedDict

import torch
import torch.nn as nn

from ..collectives import comm
from ..shards import StateKind

_RAW = [0]  # >0 while torch's own state_dict walk runs on wrapped modules (the overrides defer to it)


def persistent_buffers(model: nn.Module):
    """(qualified name, buffer) of the buffers a state dict holds: the non-persistent ones (Llama's rotary inv_freq)
    are rebuilt by the model, and torch's load_state_dict refuses them as unexpected keys."""
    for mod_name, mod in model.named_modules():
        for attr, buf in mod._buffers.items():
            if buf is not None and attr not in mod._non_persistent_buffers_set:
                yield (f"{mod_name}.{attr}" if mod_name else attr), buf


@contextlib.contextmanager
def _raw():
    _RAW[0] += 1
    try:
        yield
    finally:
        _RAW[0] -= 1


def _placeholder_state(module: nn.Module) -> "OrderedDict[str, torch.Tensor]":
    """torch's state_dict of `module` with keep_vars: placeholders (or a gathered unit's views) for params."""
    with _raw():
        return nn.Module.state_dict(module, keep_vars=True)


def _unit_of(t: torch.Tensor):
    p = getattr(t, "_offload_placeholder", t)
    return p, getattr(p, "_offload_unit", None)


def gather_full(rt, unit) -> torch.Tensor:
    """The unit's full padded flat value in fp32 on the host (collective; the runtime is quiet)."""
    shard = unit.read_shard(unit.shards.master_kind())
    return comm.all_gather_host(rt.group, shard, what=f"state dict of {unit.label}")


def write_full(rt, unit, full: torch.Tensor) -> None:
    """Store this rank's shard of `full` (fp32) as the unit's master and compute-dtype param."""
    lo, hi = unit.layout.shard_bounds(rt.rank)
    shard = full[lo:hi]
    unit.write_shard(StateKind.PARAM, shard)  # casts to bf16 for the compute-dtype param
    if not unit.shards.master_is_param:
        unit.write_shard(StateKind.MASTER, shard)
    unit.on_shard_written()  # a gathered (persistent) unit re-gathers before its next use


def wrapped_state_dict(module: nn.Module, *args, destination=None, prefix: str = "", keep_vars: bool = False):
    if _RAW[0]:
        return nn.Module.state_dict(module, *args, destination=destination, prefix=prefix, keep_vars=keep_vars)
    rt = module._offload_runtime
    rt._check_open(f"{type(module).__name__}.state_dict() on a wrapped model")
    rt.every_rank_calls(f"{type(module).__name__}.state_dict()")  # collective: refused on one rank, not hung
    rt.backward_updates.check_quiet("model.state_dict")  # values of a step that may yet clip are not the model's
    rt.quiesce()  # every queued update is in the values read below
    raw = _placeholder_state(module)
    fulls: dict[int, torch.Tensor] = {}
    values: dict[int, torch.Tensor] = {}
    out = OrderedDict() if destination is None else destination
    for unit in rt.units:  # every rank gathers the same units in the same order (collective)
        if any(_unit_of(v)[1] is unit for v in raw.values()):
            fulls[id(unit)] = gather_full(rt, unit)
    for key, v in raw.items():
        p, unit = _unit_of(v)
        if unit is None:
            out[prefix + key] = v if keep_vars else v.detach()
            continue
        if id(p) not in values:
            slot = unit.layout.slots[p._offload_slot]
            values[id(p)] = fulls[id(unit)][slot.offset:slot.offset + slot.numel].view(slot.shape).clone()
        out[prefix + key] = values[id(p)]
    return out


def wrapped_load_state_dict(module: nn.Module, state_dict, strict: bool = True, assign: bool = False):
    """torch's own load_state_dict walk, so its key rules, error messages, each module's _load_from_state_dict and
    its load pre- and post-hooks are what they are without the runtime, run with assign=True over the parameter
    placeholders: each loaded tensor is only put in its module's place, and taken from there into the shards."""
    del assign  # the runtime owns parameter storage: values are always copied into its shards
    rt = module._offload_runtime
    rt._check_open(f"{type(module).__name__}.load_state_dict() on a wrapped model")
    rt.every_rank_calls(f"{type(module).__name__}.load_state_dict()")
    rt.backward_updates.check_quiet("model.load_state_dict")  # a speculated update would shadow what is loaded
    rt.quiesce()  # nothing may be updating the shards written below
    names = {id(m): n for n, m in module.named_modules()}
    refs = [(unit, slot, m, attr) for unit in rt.units for slot in unit.layout.slots for m, attr in slot.refs
            if id(m) in names]
    params = {(id(m), attr): m._parameters[attr] for _, _, m, attr in refs}  # placeholders, or a unit's views
    buffers = {(id(m), attr): b for m in module.modules() for attr, b in m._buffers.items() if b is not None}
    for unit, slot, m, attr in refs:
        m._parameters[attr] = unit.placeholders[slot.index]  # (views are not Parameters: torch refuses them)
    loaded, new_buffers = {}, []
    try:
        with rt._capture.paused() if rt._capture else contextlib.nullcontext():  # the tensors assigned are the
            # state dict's, not parameters to shard
            result = nn.Module.load_state_dict(module, state_dict, strict=strict, assign=True)
        for unit, slot, m, attr in refs:
            value = m._parameters[attr]
            if value is not unit.placeholders[slot.index]:  # loaded (tied: the last module's, as torch copies)
                loaded[(unit, slot.index)] = (_key(names[id(m)], attr), value)
        for m in module.modules():
            for attr, b in m._buffers.items():
                before = buffers.get((id(m), attr))
                if before is not None and b is not before:
                    new_buffers.append((before, b))
    finally:  # what the modules held before, whether the walk ended or raised
        for _, _, m, attr in refs:
            m._parameters[attr] = params[(id(m), attr)]
        for m in module.modules():
            for attr in list(m._buffers):
                if (id(m), attr) in buffers:
                    m._buffers[attr] = buffers[(id(m), attr)]
    meta = [key for key, value in loaded.values() if value.device.type == "meta"]
    if meta:
        raise RuntimeError(f"Error(s) in loading state_dict for {type(module).__name__}: "
                           + "; ".join(f"{key} is a meta tensor (no data)" for key in meta)
                           + ": take the state dict from a real model, or from a wrapped one (its state_dict() "
                             "gathers real values)")
    with torch.no_grad():
        for before, value in new_buffers:
            before.copy_(value)  # replicated, on the compute device in its dtype: copied, not replaced
        for unit in rt.units:  # same order on every rank (collective)
            items = [(index, value) for (u, index), (_, value) in loaded.items() if u is unit]
            if not items:
                continue
            full = gather_full(rt, unit)
            for slot_index, value in items:
                slot = unit.layout.slots[slot_index]
                full[slot.offset:slot.offset + slot.numel].copy_(value.detach().reshape(-1))
            write_full(rt, unit, full)
    return result


def _key(module_name: str, attr: str) -> str:
    return f"{module_name}.{attr}" if module_name else attr
