"""Sharding a model into units: discover them, place their states, materialize or take their values unit by
unit, keep this rank's shard in the store, and put placeholders, hooks and torch patches on the modules.
Called by Runtime.wrap (`rt` is the open Runtime: its config, store, lanes, schedule and unit list), which
writes its own fields from what this returns: the placement (Placed, before any unit is built: a unit
gathered here reads it), each unit as it is built (`adopt`), and the model's record at the end (Wrapped).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn

from ..config import parse_size
from .collectives import comm
from . import placement
from .torch_patches import patch_model
from .units import hooks
from .units.discover import discover_units
from .units.init_record import Sharded
from .units.layout import FlatLayout
from .units.materialize import hf_inits, init_device, is_meta_model, lora_layers, materialize_unit
from .shards import StateKind, UnitShards
from .units.unit import ShardedUnit


@dataclass
class Placed:
    """Where a model's new units go (placement.plan), decided before any is built."""

    specs: list  # discover.UnitSpec of each new unit, in order
    sizes: list[placement.UnitSize]  # their sizes, in the same order
    placement: placement.Placement


@dataclass
class Wrapped:
    """A model sharded: what the Runtime takes in once its units are built."""

    parameters: int  # the model's parameters, numbered from the runtime's count so far (their ordinals)
    hooks: list  # handles the Runtime removes at close


def place_model(rt, model: nn.Module) -> Placed:
    """Discover `model`'s units and place their states beside the runtime's units so far (reads the runtime only)."""
    cfg = rt.config
    specs = [s for s in discover_units(model, cfg) if s.params]
    for spec in specs:  # the shards hold fp32 masters and compute-dtype copies: other parameter dtypes would change
        for p, _, fqn in spec.params:
            if p.dtype == torch.float64 or not p.is_floating_point():  # (complex ones are not floating point)
                raise ValueError(f"offload: parameter {fqn} is {p.dtype}; the runtime trains parameters in "
                                 f"offload.Config.compute_dtype ({cfg.compute_dtype}) with fp32 masters, so its "
                                 "values would change silently. Cast the model (model.float()) before rt.wrap, or "
                                 "keep this parameter outside the wrapped model")
    persist = parse_size(cfg.persist_threshold, "persist_threshold")
    width = rt.compute_dtype.itemsize
    sizes = [placement.UnitSize(u.index, u.name, type(u.module).__name__, u.layout,
                                u.name == "" or u.persistent) for u in rt.units]
    new = []
    for k, s in enumerate(specs):
        layout = FlatLayout(s.params, rt.world_size)
        new.append(placement.UnitSize(len(rt.units) + k, s.name, type(s.module).__name__, layout,
                                      s.name == "" or s.island or layout.padded_numel * width <= persist))
    in_use = {t: rt.states.nbytes_in(t) for t in ("device", "cpu")}
    place = placement.plan(sizes + new, new, rt.params_tier, rt.optimizer_tier, rt.budgets, in_use,
                           rt.compute_dtype, cfg.bytes_of("chunk_size"), cfg.nvme_path, grads=cfg.grads,
                           device_budget_given=cfg.device_budget != "auto", machine=rt.machine,
                           update_in_backward=cfg.update_in_backward, schema=rt.sized_schema)
    return Placed(specs, new, place)


def shard_model(rt, model: nn.Module, placed: Placed, adopt: Callable[[ShardedUnit], None],
                weights=None) -> Wrapped:
    """Shard `model` into units in place, as `placed` says; `adopt(unit)` takes each into the runtime as it is
    built (before a persistent one is gathered). Models built inside the block are materialized unit by unit;
    an existing model keeps its values (rank 0's, broadcast). `weights`, a callable (qualified name, meta
    parameter) -> host tensor, gives every parameter's value instead (each rank reads its own copy, unit by
    unit: a model streamed from safetensors never exists whole in memory); where it returns None (a parameter the
    files do not hold: PEFT's new adapters) the parameter is initialized as a model built in the block is."""
    cfg, specs, new, place = rt.config, placed.specs, placed.sizes, placed.placement
    width = rt.compute_dtype.itemsize
    persist = parse_size(cfg.persist_threshold, "persist_threshold")
    meta = is_meta_model(model)
    where = torch.device("cpu")
    if meta and weights is None:  # one decision for all units, the same on every rank (collective)
        where = init_device(rt.device, max((s.layout.numel for s in new), default=0), rt.group)
    adapters = lora_layers(model) if meta else {}
    hf = hf_inits(model) if meta or weights is not None else {}
    model_tag = f"model{len(rt.models)}:" if rt.models else ""  # unit ids stay unique across models
    base = len(rt.units)
    ordinal = {id(p): i + rt._ordinal_base for i, p in enumerate(model.parameters())}
    with rt._capture.paused() if rt._capture else contextlib.nullcontext():
        for k, (spec, size) in enumerate(zip(specs, new)):
            index, layout = base + k, size.layout
            if weights is not None:
                values = [weights(fqn, p) for p, _, fqn in spec.params]
                fresh = [i for i, v in enumerate(values) if v is None]
                if fresh:  # not in the files: initialized as if built in the block (same seed on every rank)
                    made = materialize_unit(model, [spec.params[i] for i in fresh], cfg.seed + index, where, adapters,
                                            hf)
                    for i, v in zip(fresh, made):
                        values[i] = v
            elif meta:
                values = materialize_unit(model, spec.params, cfg.seed + index, where, adapters, hf)
            else:
                values = [p.detach() for p, _, _ in spec.params]
            full = layout.flatten(values, torch.float32)
            del values
            if not meta and weights is None:  # every rank must start from the same values
                comm.broadcast_host_(rt.group, full, 0, what=f"initial values of unit {spec.name or '<root>'}")
            lo, hi = layout.shard_bounds(rt.rank)
            shard = full[lo:hi].clone()
            del full
            uid = model_tag + (spec.name or "<root>")
            shards = UnitShards.build(uid, layout.shard_numel, place.chunk_of(layout.shard_numel),
                                      rt.compute_dtype, place.tiers)
            _register_unit(rt, shards, shard)
            del shard
            unit = ShardedUnit(rt.ctx, index, uid, spec.name, spec.module, layout, shards)
            if shards.tiers.grads is not shards.tiers.optimizer and layout.trainable:  # (a frozen unit has none)
                unit.register_grads()  # now, so the next wrap's placement sees their bytes in use
            _adopt(rt, unit, spec, ordinal)
            adopt(unit)  # the runtime's unit list and the schedule's, before the unit's hooks can run
            hooks.install(unit, rt.schedule)
            if spec.island or layout.padded_numel * width <= persist:
                unit.unshard()
                unit.persistent = True
    # Buffers are replicated, not sharded: moved to the compute device, and floating ones cast to the
    # compute dtype (what model.to(torch.bfloat16) would do).
    for name, buf in list(model.named_buffers()):
        dtype = rt.compute_dtype if buf.is_floating_point() else buf.dtype
        if buf.is_meta:
            raise RuntimeError(f"offload: the model's buffer {name!r} has no values (meta): a loader built it deferred "
                               "(transformers' from_pretrained, imported after offload.init opened, does); import "
                               "transformers before `with offload.init(...)`, or load outside and rt.wrap(model)")
        if buf.device != rt.device or buf.dtype != dtype:
            mod_name, _, attr = name.rpartition(".")
            model.get_submodule(mod_name)._buffers[attr] = buf.to(rt.device, dtype)
    patch_model(model, rt)
    refuse = torch.compiler.disable(lambda module, _: refuse_unmanaged(module),
                                    reason="offload: the check of unmanaged parameters runs eagerly")
    watch_tokens = rt.step_stats.tokens.watch(model, sum(size.layout.numel for size in new))  # tokens/s, TFLOPS
    return Wrapped(len(ordinal), [model.register_forward_pre_hook(refuse, prepend=True), watch_tokens])


def _register_unit(rt, shards: UnitShards, shard: torch.Tensor) -> None:
    futs = []
    for c in shards.chunks:
        values = shard[c.lo:c.hi]
        futs.append(rt.states.register(shards.spec(StateKind.PARAM, c), init=values.to(rt.compute_dtype)))
        if not shards.master_is_param:
            futs.append(rt.states.register(shards.spec(StateKind.MASTER, c), init=values))
    for f in futs:
        f.result()  # the home copies hold the values before the init tensor goes


def _hook_refused(fqn: str):
    """A placeholder's register_hook / register_post_accumulate_grad_hook: such a hook would never run."""
    def refuse(*args, **kwargs):
        raise RuntimeError(
            f"offload: a gradient hook on parameter {fqn!r} of a wrapped model would never run: its gradient goes to "
            "the runtime's shards, not to the parameter (its .grad stays None). Clip with rt.clip_grad_norm_; a "
            "per-parameter gradient hook has no equivalent in offload yet")
    return refuse


def _adopt(rt, unit: ShardedUnit, spec, ordinal: dict) -> None:
    layout = unit.layout
    for slot, (p, _, _) in zip(layout.slots, spec.params):
        slot.ordinal = ordinal[id(p)]
    for slot, (p, _, _) in zip(layout.slots, spec.params):
        if p.device.type != "meta":
            torch.utils.swap_tensors(p, nn.Parameter(torch.empty_like(p, device="meta"),
                                                     requires_grad=p.requires_grad))
        for attr in ("_offload_initial_value", "_offload_init_calls"):  # (materialize.py's, used by now)
            if attr in p.__dict__:
                delattr(p, attr)
        p.__class__ = Sharded  # writes into it and reads of its values are refused from now on (init_record.py)
        p._offload_unit = unit
        p._offload_slot = slot.index
        p._offload_runtime = rt  # the one back-reference, as on the modules (torch_patches.patch_model)
        p.register_hook = p.register_post_accumulate_grad_hook = _hook_refused(slot.fqn)
        unit.placeholders.append(p)
        unit.views[slot.index]._offload_placeholder = p  # model.parameters() while gathered (later views: unit)
    unit._install(unit.placeholders)
    spec.module._offload_unit_obj = unit


def refuse_unmanaged(model: nn.Module) -> None:
    """Raise, naming them and the fix, if `model` holds parameters no unit manages: modules added after it was
    wrapped (PEFT's get_peft_model on a wrapped model) would train outside the runtime, or not at all."""
    def managed(p) -> bool:  # a unit's placeholder, or (gathered) its view
        return hasattr(p, "_offload_unit") or hasattr(p, "_offload_placeholder")

    if all(managed(p) for p in model.parameters()):
        return
    names = [n for n, p in model.named_parameters() if not managed(p)]
    shown = ", ".join(names[:3]) + (f", ... ({len(names)} in all)" if len(names) > 3 else "")
    raise RuntimeError(
        f"offload: the model has parameters the runtime does not manage ({shown}): they were added after the model "
        "was sharded (PEFT's get_peft_model on a model that rt.wrap, a first forward or from_pretrained inside "
        "offload.init had sharded already). Add adapters before the model is sharded: inside the block "
        "`model = offload.integrations.lora.load_peft_model(DIR, LoraConfig(...))` streams DIR's weights under "
        "the adapters, or `get_peft_model(AutoModelForCausalLM.from_config(config), lora_config)` then rt.wrap(model); "
        "outside the block, get_peft_model on the loaded model, then rt.wrap(model) or OffloadTrainer(model=...)")
