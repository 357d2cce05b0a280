"""Forward and backward hooks: each event is one call into the runtime's Schedule (schedule.py).

forward pre-hook   gather the unit (the next one is gathered ahead by the schedule); route its
                   grad-requiring inputs through `_PostBackward`
forward hook       register the pre-backward hook on its outputs; free the gathered parameter (or keep it
                   for a backward that comes right after)
pre-backward       (first gradient reaching any output) gather again for backward
_PostBackward      (gradient reaching the unit's inputs, i.e. its backward is done) free it again
final callback     (end of the backward pass) free whatever is still gathered, e.g. units whose inputs
                   need no gradient (the root), so nothing leaks into the next step
Gradients are reduced by the flat parameter's post-accumulate-grad hook (unit.py).
Inside backward (activation checkpointing re-running a unit's forward) the forward hooks only make sure
the unit is gathered: it is already gathered for its backward and must stay so.
inside-unit check  (pre-hook of every other module holding the unit's parameters) a call while the unit is not
                   gathered and fresh gathers it without gradients and raises with them: the module would compute
                   on meta placeholders or outdated values
"""
from __future__ import annotations

import sys

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from ..state_machines import UnitState
from .unit import ShardedUnit


def in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


class _PostBackward(torch.autograd.Function):
    """Identity on the unit's inputs whose backward runs once gradients w.r.t. those inputs exist."""

    @staticmethod
    def forward(ctx, unit, schedule, *inputs):
        ctx.unit, ctx.schedule = unit, schedule
        return inputs if len(inputs) != 1 else inputs[0]

    @staticmethod
    def backward(ctx, *grads):
        ctx.schedule.post_backward(ctx.unit)
        return (None, None) + grads


def _tensors(tree) -> list[torch.Tensor]:
    if isinstance(tree, torch.Tensor):  # (a block's hidden state) no pytree walk: its recursive helper is cyclic
        return [tree]  # garbage, nine objects a unit a forward for the collector
    leaves, _ = tree_flatten(tree)
    found = [x for x in leaves if isinstance(x, torch.Tensor)]
    if not found and hasattr(tree, "values"):  # ModelOutput-like mappings pytree does not know
        for value in tree.values():
            found.extend(_tensors(value))
    return found


def install(unit: ShardedUnit, schedule) -> list:
    """`schedule` is the runtime's Schedule (schedule.py). Under torch.compile both hooks run eagerly (Dynamo
    cannot trace the lanes, futures and locks behind them): each unit's forward is compiled between them."""

    @torch.compiler.disable(reason="offload: a unit's gather runs eagerly, between compiled graphs")
    def pre_forward(module, args, kwargs):
        if in_backward():
            schedule.recompute(unit)
            return None
        schedule.pre_forward(unit)
        if not torch.is_grad_enabled():
            return None
        if not kwargs and all(isinstance(x, torch.Tensor) for x in args):  # tensors only (a block's hidden state):
            leaves, spec = list(args), None  # no pytree walk
        else:
            leaves, spec = tree_flatten((args, kwargs))
        idx = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor) and x.requires_grad]
        if not idx:
            return None
        outs = _PostBackward.apply(unit, schedule, *[leaves[i] for i in idx])
        if len(idx) == 1:
            outs = (outs,)
        for i, t in zip(idx, outs):
            leaves[i] = t
        return (tuple(leaves), kwargs) if spec is None else tree_unflatten(leaves, spec)

    @torch.compiler.disable(reason="offload: a unit's free runs eagerly, between compiled graphs")
    def post_forward(module, args, kwargs, output):
        if in_backward():
            return None
        if output is None and sys.exc_info()[1] is not None:  # (always_call: the forward raised, torch runs it
            schedule.forward_failed(unit)  # inside its `except`)
            return None
        if torch.is_grad_enabled():
            outs = [t for t in _tensors(output) if t.requires_grad]
            if len(outs) == 1:  # (a block's hidden state) its node runs once a backward: its own hook, not torch's
                outs[0].register_hook(pre_backward)  # once-per-backward wrapper, lock and handle around it
            elif outs:
                torch.autograd.graph.register_multi_grad_hook(outs, pre_backward, mode="any")
        schedule.post_forward(unit)
        return None

    def pre_backward(grad) -> None:  # the first gradient reaching one of the unit's outputs in a backward
        schedule.pre_backward(unit)

    def inside_unit(module, args):  # traced by torch.compile: inside the unit's forward it reads True
        check_call(unit, module, schedule)

    holders = {id(m): m for slot in unit.layout.slots for m, _ in slot.refs}.values()
    return [
        unit.module.register_forward_pre_hook(pre_forward, with_kwargs=True),
        unit.module.register_forward_hook(post_forward, with_kwargs=True, always_call=True),
    ] + [m.register_forward_pre_hook(inside_unit) for m in holders if m is not unit.module]


def check_call(unit: ShardedUnit, module, schedule) -> None:
    """The pre-hook of every parameter-holding module inside a unit but its root (also run by hand for a call
    that wrapped the model, whose hooks came too late for it): the unit's values must be there and current."""
    if unit.state is not UnitState.UNSHARDED or unit.stale:
        _called_outside(unit, module, schedule)


@torch.compiler.disable(reason="offload: a call outside its unit gathers or raises eagerly")
def _called_outside(unit: ShardedUnit, module, schedule) -> None:
    """Without gradients (generate() of an encoder-decoder model calls its encoder, a PeftModel's calls the base
    model's), the unit is gathered for the call and stays so until its own next forward frees it; with gradients
    the call would bypass the unit's backward (its reduce and free): refused."""
    if not torch.is_grad_enabled() and not in_backward() and unit.state is not UnitState.FREED:
        schedule.gather_for_call(unit)
        return
    inner = next((n for n, m in unit.module.named_modules() if m is module), "?")
    name = ".".join(x for x in (unit.name, inner) if x)
    why = ("the runtime has exited" if unit.state is UnitState.FREED else
           "its values are outdated (updated since it was gathered)" if unit.state is UnitState.UNSHARDED else
           "its parameters are placeholders without values")
    raise RuntimeError(
        f"offload: module {name!r} was called outside the forward of its {unit.label}, which holds its parameters "
        f"sharded: {why}, and the result would be meaningless with gradients on. Call the whole model (or the "
        f"unit's module, {unit.name or 'the model itself'!r}), or make the call under torch.no_grad(), where the "
        "unit is gathered for it; to read the weights, rt.full_state_dict(model)")
