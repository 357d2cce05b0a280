"""Writes a model's own code makes on its parameters while it is built inside `offload.init`, recorded so that
materialize_unit can replay them on the real values (materialize.py, rule 5); and, once a model is wrapped, the
writes and value reads on its placeholders that would do nothing, refused.

Inside the block every parameter is a meta placeholder until its unit is materialized, so code that initializes
parameters after the submodules exist (nanoGPT's `self.apply(self._init_weights)` and scaled `c_proj` init, a
custom model's `module.weight.data.normal_(0, 0.02)`, `p.data[pad].zero_()`, `p.copy_(pretrained)`) writes
nothing. Each placeholder the capture makes is a `Placeholder` (an nn.Parameter subclass, turned back into a
plain nn.Parameter when its unit takes it, wrap._adopt), whose __torch_function__ sees every torch call on it:
  - an in-place call (a method or function named `..._`, `__setitem__`, `p.data = x`), and any torch.nn.init
    function (replaced in torch.nn.init, for the process, while the block is open: materialize.ConstructionCapture
    installs recording_init for each of INIT_FUNCTIONS; so their own inner calls are not recorded twice), on the
    placeholder or on a view of it is recorded on the placeholder with the views' path, to run in that order
    on the real tensor; one also reading another placeholder is recorded as refused (raised, naming rt.wrap,
    when a model outside Hugging Face's is materialized: its values do not exist yet);
  - a view of it (`.data`, indexing, `.view`, `.t()`, `.detach()`) is a `_View` that remembers its path;
  - an in-place call on a real tensor that reads a placeholder (an EMA copy updated before the model's first use:
    it would read nothing) is refused at once;
  - anything else runs as on a meta tensor.
Calls made from the reset_parameters() of the module holding the parameter are not recorded: materialize_unit
runs that initializer itself (rule 2). Only while a capture records (the block open, not paused).

Once its unit takes it (wrap._adopt: any model, built in the block or passed to rt.wrap) a placeholder is a
`Sharded` parameter: metadata (shape, dtype, numel, requires_grad, .grad) reads as before, and what would silently
do nothing is refused, naming the fix: an in-place write into it or a view of it (`p.data.copy_(x)`,
torch.nn.init, `p.data = x`: model.load_state_dict), and a read of its values (`p.detach().clone()`, `.to()`,
`.cpu()`, an in-place update of a real tensor from it, an EMA: rt.full_state_dict(model)).
"""
from __future__ import annotations

import sys
import threading

import torch
import torch.nn as nn
from torch._C import DisableTorchFunctionSubclass

CALLS_ATTR = "_offload_init_calls"  # [(view path, function, args, kwargs) or (None, refusal message)]
INIT_FUNCTIONS = ("uniform_", "normal_", "trunc_normal_", "constant_", "ones_", "zeros_", "eye_", "dirac_",
                  "xavier_uniform_", "xavier_normal_", "kaiming_uniform_", "kaiming_normal_", "orthogonal_",
                  "sparse_")
_NOT_WRITES = {"requires_grad_", "share_memory_", "retain_grad"}  # in-place on autograd or memory, not on values
_DATA = torch.Tensor.data


class _Self:
    def __repr__(self):
        return "<the recorded call's tensor>"


_SELF = _Self()  # stands for the recorded call's own tensor in its arguments


class _State(threading.local):
    recording = False  # a capture is open and not paused (ConstructionCapture sets it)
    depth = 0  # inside a recorded call: its own inner torch calls are not recorded again


state = _State()


def _origin(t):
    """(placeholder, view path) when `t` is a placeholder (sharded or not yet), or a view of one; else None."""
    if isinstance(t, _Tracked) and isinstance(t, nn.Parameter):
        return (t, ())
    if isinstance(t, _View):
        return t.__dict__.get("_offload_view")
    return None


def _sharded(p) -> bool:
    return "_offload_unit" in p.__dict__


_VALUE_READS = {"clone", "to", "cpu", "cuda", "item", "tolist", "numpy", "copy", "double", "float", "half",
                "bfloat16"}  # calls that would copy a sharded placeholder's (missing) values out


def _sub(values, target):
    """`values` (args tuple or kwargs dict) with `target` replaced by _SELF, by identity."""
    if isinstance(values, dict):
        return {k: _SELF if v is target else v for k, v in values.items()}
    return tuple(_SELF if v is target else v for v in values)


def _put(values, t):
    if isinstance(values, dict):
        return {k: t if v is _SELF else v for k, v in values.items()}
    return tuple(t if v is _SELF else v for v in values)


def _tensors(args, kwargs):
    for v in (*args, *kwargs.values()):
        if isinstance(v, (list, tuple)):
            yield from (x for x in v if isinstance(x, torch.Tensor))
        elif isinstance(v, torch.Tensor):
            yield v


def _target(args, kwargs):
    return args[0] if args else next(iter(kwargs.values()), None)


def _is_write(func) -> bool:
    name = getattr(func, "__name__", "")
    if name == "__set__":
        return getattr(func, "__self__", None) is _DATA
    return name == "__setitem__" or (name.endswith("_") and not name.startswith("_") and name not in _NOT_WRITES)


def record(func, args, kwargs) -> None:
    """Record the write `func(*args, **kwargs)` on the placeholder its target tensor is, or is a view of."""
    target = _target(args, kwargs)
    p, path = _origin(target)
    if _inside_own_init(p):
        return
    calls = p.__dict__.setdefault(CALLS_ATTR, [])
    if any(_origin(t) is not None for t in _tensors(args, kwargs) if t is not target):
        name = getattr(func, "__name__", func)
        calls.append((None, f"{name} on one parameter reads another parameter's values, which do not exist yet"))
        return
    if getattr(func, "__name__", "") == "__set__":  # p.data = x: the values of x
        func, args, kwargs = torch.Tensor.copy_, (target, args[1]), {}
    calls.append((path, func, _sub(args, target), _sub(kwargs, target)))


def replay(real: torch.Tensor, calls: list, fqn: str) -> None:
    """Run the recorded writes on `real` (the parameter's values), in their order."""
    for entry in calls:
        if entry[0] is None:
            raise RuntimeError(f"offload: the model's own code wrote parameter {fqn!r} while it was built inside "
                               f"offload.init in a way that cannot be replayed ({entry[1]}); build the model before "
                               "offload.init and pass it to rt.wrap(model), which keeps its values")
        path, func, args, kwargs = entry
        t = real
        for view, vargs, vkwargs, index in path:
            t = view(*_put(vargs, t), **_put(vkwargs, t))
            if index is not None:
                t = t[index]
        func(*_put(args, t), **_put(kwargs, t))


def _as_view(out, p, path, step):
    if isinstance(out, torch.Tensor) and out.is_meta and not isinstance(out, nn.Parameter):
        try:
            same = out.untyped_storage()._cdata == p.untyped_storage()._cdata
        except RuntimeError:
            return out
        if same:
            view = out.as_subclass(_View)
            view._offload_view = (p, path + (step,))
            return view
    return out


def _refuse_sharded(func, write: bool):
    name = getattr(func, "__name__", func)
    name = "assigning .data" if name == "__set__" else name
    if write:
        raise RuntimeError(f"offload: {name} writes into a parameter of a wrapped model, whose values live in the "
                           "runtime's shards: it would change nothing. Load values with model.load_state_dict(...) "
                           "(written into the shards), or set them before the model is wrapped")
    raise RuntimeError(f"offload: {name} reads a parameter of a wrapped model, a placeholder without values (they "
                       "live in the runtime's shards); take the values from rt.full_state_dict(model) or "
                       "model.state_dict() (an EMA: update it from those after opt.step())")


class _Tracked:
    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if state.depth or (getattr(func, "__name__", "") == "__get__" and getattr(func, "__self__", None) is not _DATA):
            with DisableTorchFunctionSubclass():  # (metadata reads, e.g. .shape, stay cheap)
                return func(*args, **kwargs)
        target = _target(args, kwargs)
        origin = _origin(target)
        write = _is_write(func)
        if origin is None:
            if write and isinstance(target, torch.Tensor) and not target.is_meta:
                sources = [o for o in map(_origin, _tensors(args, kwargs)) if o is not None]
                if any(_sharded(p) for p, _ in sources):
                    _refuse_sharded(func, write=False)  # (an EMA updated from a wrapped model's placeholders)
                if sources and state.recording:
                    raise RuntimeError(
                        f"offload: {getattr(func, '__name__', func)} reads a parameter of a model built inside "
                        "offload.init before its first use, when it has no values yet (an EMA or other copy of the "
                        "parameters made now would hold nothing); make the copy after the first forward (or "
                        "rt.wrap(model)), from rt.full_state_dict(model)")
            with DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        p, path = origin
        if _sharded(p):
            if write or getattr(func, "__name__", "") in _VALUE_READS:
                _refuse_sharded(func, write)
            with DisableTorchFunctionSubclass():
                out = func(*args, **kwargs)
            return _views_of(out, p, path, func, args, kwargs, target)  # (a write through a view is refused too)
        if not state.recording:
            with DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        if write and getattr(func, "__name__", "") == "__set__":
            record(func, args, kwargs)  # p.data = x: not set (the placeholder stays a placeholder), replayed
            return None
        state.depth += 1
        try:
            with DisableTorchFunctionSubclass():
                out = func(*args, **kwargs)
        finally:
            state.depth -= 1
        if write:
            record(func, args, kwargs)  # (after the call: one torch refuses is not recorded)
            return out
        return _views_of(out, p, path, func, args, kwargs, target)


def _views_of(out, p, path, func, args, kwargs, target):
    step_args, step_kwargs = _sub(args, target), _sub(kwargs, target)
    if isinstance(out, (tuple, list)):
        return type(out)(_as_view(o, p, path, (func, step_args, step_kwargs, i)) for i, o in enumerate(out))
    return _as_view(out, p, path, (func, step_args, step_kwargs, None))


# See [Note: placeholders] in docs/zero-runtime.md
class Placeholder(_Tracked, nn.Parameter):
    """A parameter registered inside the block, not sharded yet: meta, its writes recorded (module docstring)."""


class Sharded(_Tracked, nn.Parameter):
    """A wrapped model's parameter (wrap._adopt): writes into it and reads of its values are refused, naming the
    fix (module docstring)."""


class _View(_Tracked, torch.Tensor):
    """A view of a Placeholder (`p.data`, `p[0]`, `p.t()`), which remembers how it was taken from it."""


def recording_init(name: str, original):
    """torch.nn.init.<name> while the block is open: one recorded call, whatever torch ops it is made of."""
    def init_fn(tensor, *args, **kwargs):
        origin = None if state.depth else _origin(tensor)
        if origin is not None and _sharded(origin[0]):
            _refuse_sharded(original, write=True)
        if origin is None or not state.recording:
            return original(tensor, *args, **kwargs)
        state.depth += 1
        try:
            out = original(tensor, *args, **kwargs)
        finally:
            state.depth -= 1
        record(original, (tensor, *args), kwargs)
        return out

    init_fn.__name__ = init_fn.__qualname__ = name
    init_fn.__doc__ = original.__doc__
    init_fn.__wrapped__ = original
    return init_fn


def _inside_own_init(p: torch.Tensor) -> bool:
    """A write on `p` made from the reset_parameters() of a module holding it: materialize_unit runs that
    initializer itself (rule 2), so the write is not recorded."""
    frame = sys._getframe(1)
    for _ in range(40):
        if frame is None:
            return False
        if frame.f_code.co_name in ("reset_parameters", "_reset_parameters"):
            owner = frame.f_locals.get("self")
            if isinstance(owner, nn.Module) and any(v is p for v in owner._parameters.values()):
                return True
        frame = frame.f_back
    return False
