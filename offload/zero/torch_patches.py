"""What a wrapped model's modules do differently, so plain PyTorch code keeps working on it.

Each module of a wrapped model gets, for the model's life (that model only: rt.wrap, patch_model below), a class
of its own: `OffloadModule` before its class in the MRO, as FSDP2's fully_shard does (one class per original
class, made once, with the original's name, so code that reads `type(model).__name__` - Hugging Face's
`architectures` in config.json - sees what it saw before).
On instances only where torch looks there first (the parameter placeholders' refused gradient hooks, wrap.py;
the zero_grad of torch.compile's wrapper, route_compiled_zero_grad below):
  _apply          model.to() / .cuda() / .float() reach only buffers: the runtime places and casts parameters; a
                  move off the compute device or a cast to a dtype it does not train in (.half() under bf16,
                  .double()) is refused, naming Config.compute_dtype (placed_apply; the same for a model built
                  in the block and not used yet, materialize.ConstructionCapture)
  zero_grad       clears the runtime's gradients of the module's parameters (HF Trainer calls model.zero_grad)
  state_dict      real gathered values instead of meta placeholders (state_dict.py)
  load_state_dict written into the shards (state_dict.py)
  device / dtype  where a class has them as properties (Hugging Face's, read from the first parameter, a meta
                  placeholder here): the runtime's compute device and dtype, so `inputs.to(model.device)` works
  deepcopy/pickle refused, naming the fix: the values live in the runtime's shards, not in the module

Process-wide, while at least one runtime is open (ForeignCodeGuards: installed by Runtime.open, removed by its close,
counted over runtimes; the originals are put back when the last one closes), the torch calls that would otherwise
do nothing to a wrapped model in silence, its placeholders having no .grad (each hands anything that is not a
wrapped model's to the original). docs/environment.md ("What offload patches") lists every patch offload makes:
  torch.nn.utils.clip_grad_norm_     (also torch.nn.utils.clip_grad's) over a wrapped model's parameters: routed
                                     to rt.clip_grad_norm_, the same norm and coefficient (Accelerate's
                                     clip_grad_norm_ calls it); over part of them, or mixed with plain parameters
                                     that have gradients, refused naming rt.clip_grad_norm_
  torch.nn.utils.clip_grad_value_,   refused over wrapped parameters (the runtime clips by global norm only);
  clip_grads_with_norm_              the private _clip_grads_with_norm_ too, which catches a clip_grad_norm_
                                     imported before the runtime opened (`from torch.nn.utils import ...`)
  a torch optimizer's step()         a global optimizer step pre-hook (torch.optim's own registry) refuses any
                                     optimizer but offload's over wrapped parameters, naming offload.AdamW
  torch.nn.utils.get_total_norm      (and clip_grad's _get_total_norm, which it is) given a None gradient:
                                     refused naming rt.clip_grad_norm_ (torch's own error was an AttributeError);
                                     a list filtered of the Nones is empty, and its 0 cannot be told from a plain
                                     model's: docs/guide/your-own-loop.md, "A wrapped model's .grad"
  torch.nn.utils.parameters_to_vector, vector_to_parameters: their per-parameter check (convert_parameters.
                                     _check_param_device, looked up at each call, so an import made before the
                                     runtime opened is caught too) refuses a wrapped parameter (the vector was
                                     meta), naming rt.full_state_dict / model.load_state_dict
  torch.amp.GradScaler.unscale_, .step over an offload optimizer (a ShardedOptimizer, possibly inside
                                     Accelerate's wrapper), enabled: refused naming offload.GradScaler (torch's
                                     scaler finds no .grad to check and asserted "No inf checks were recorded")
"""
from __future__ import annotations

import weakref

import torch
import torch.nn as nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

from .units.state_dict import wrapped_load_state_dict, wrapped_state_dict


class OffloadModule:
    """Mixin of every module of a wrapped model. `_offload_runtime` is the runtime that owns it: the one
    back-reference offload sets, on each module of a wrapped model (patch_model) and on each of its parameters
    (wrap.py); docs/environment.md lists every attribute offload sets on objects it does not own."""

    _offload_runtime = None

    def _apply(self, fn, recurse: bool = True):
        """The runtime places and casts parameters (Config.compute_dtype, the compute device), so
        .to()/.cuda()/.float() reach only the buffers; parameters stay placeholders."""
        rt = self._offload_runtime
        return placed_apply(self, fn, recurse, rt.device, rt.compute_dtype)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the runtime's gradients of this module's parameters."""
        self._offload_runtime.zero_grad_params(self.parameters(), set_to_none)

    state_dict = wrapped_state_dict
    load_state_dict = wrapped_load_state_dict

    def __copy__(self):
        """copy.copy stays what it was (a shallow copy sharing the parameters); only __reduce_ex__ is refused."""
        new = object.__new__(type(self))
        new.__setstate__(self.__getstate__())  # torch's own state: drops what is bound to this module (compile's)
        return new

    def __deepcopy__(self, memo):
        raise TypeError(_NO_COPY.format(what="copy.deepcopy of"))

    def __reduce_ex__(self, protocol):
        raise TypeError(_NO_COPY.format(what="pickling (torch.save, multiprocessing) of"))


_NO_COPY = ("offload: {what} a module of a wrapped model is refused: its parameters are placeholders and their "
            "values live in the runtime's shards, which a copy would not take along. Copy the values into a plain "
            "model instead: `plain.load_state_dict(rt.full_state_dict(model))`; to save them, "
            "`torch.save(rt.full_state_dict(model), path)` or `model.save_pretrained(dir)`")


_DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def placed_apply(module: nn.Module, fn, recurse: bool, device: torch.device, compute_dtype: torch.dtype):
    """Module._apply for a model whose parameters the runtime places: `fn` (what .to()/.cuda()/.half() apply to
    each tensor) is tried on a probe of each parameter dtype first; parameters stay placeholders when it keeps
    them on the compute device in fp32 (the masters), the compute dtype or their own dtype, and anything else is
    refused before a buffer moves. Buffers get `fn`, as in torch."""
    params = module.parameters(recurse=recurse)
    seen = set()
    for p in params:
        if not p.is_floating_point() or p.dtype in seen:
            continue
        seen.add(p.dtype)
        out = fn(torch.zeros((), dtype=p.dtype))  # the call's target device and dtype (the same as torch's convert)
        if out.device != device:
            raise RuntimeError(
                f"offload: moving a wrapped model's parameters to {out.device} (model.to / .cuda / .cpu) is refused: "
                f"the runtime keeps them in its shards and computes on {device}; drop the call and put the inputs "
                "on rt.device (read values with rt.full_state_dict(model))")
        if out.dtype not in (p.dtype, torch.float32, compute_dtype):
            want = _DTYPE_NAMES.get(out.dtype)
            fix = (f'set offload.Config(compute_dtype="{want}") instead' if want else
                   "the runtime trains in fp32, bf16 or fp16 (Config.compute_dtype)")
            raise RuntimeError(
                f"offload: casting a wrapped model's parameters to {out.dtype} (model.to / .half / .bfloat16 / "
                f".double) is refused: the runtime keeps fp32 masters and computes in Config.compute_dtype "
                f"({_DTYPE_NAMES.get(compute_dtype, compute_dtype)}), so the cast would not take; {fix} and drop "
                "the cast")
    for m in (module.modules() if recurse else (module,)):
        for key, buf in m._buffers.items():
            if buf is not None:
                out = fn(buf)
                if buf.is_floating_point() and out.dtype != buf.dtype:
                    out = out.to(buf.dtype)  # floating buffers are the runtime's to cast too (compute dtype at wrap)
                m._buffers[key] = out
    return module


_CLASSES: dict[type, type] = {}  # original class -> its offload class


def offload_class(cls: type) -> type:
    """The class a wrapped module of class `cls` gets (made once per class)."""
    if issubclass(cls, OffloadModule):
        return cls
    made = _CLASSES.get(cls)
    if made is None:
        body = {"__module__": cls.__module__, "__qualname__": cls.__qualname__}
        if isinstance(getattr(cls, "device", None), property):
            body["device"] = property(lambda self: self._offload_runtime.device)
        if isinstance(getattr(cls, "dtype", None), property):
            body["dtype"] = property(lambda self: self._offload_runtime.compute_dtype)
        made = type(cls.__name__, (OffloadModule, cls), body)
        _CLASSES[cls] = made
    return made


def patch_model(model: nn.Module, runtime) -> None:
    for m in model.modules():
        m.__class__ = offload_class(type(m))
        m._offload_runtime = runtime


def route_compiled_zero_grad(compiled: nn.Module) -> None:
    """torch.compile(model) returns torch's OptimizedModule around the model: its own zero_grad walks the parameter
    placeholders and clears nothing of the runtime's gradients, which then sum over the steps. Routed to the
    wrapped model's zero_grad (an instance attribute, found before the class's method); anything else: no-op."""
    inner = getattr(compiled, "_orig_mod", None)
    if inner is not None and getattr(inner, "_offload_runtime", None) is not None:
        compiled.__dict__["zero_grad"] = inner.zero_grad


# ---- global guards while a runtime is open -------------------------------------------------------------------

def _runtime_of(p):
    """The runtime owning `p` (a wrapped model's placeholder, or a gathered unit's view), else None."""
    p = getattr(p, "_offload_placeholder", p)
    return getattr(p, "_offload_runtime", None)


_FIX_CLIP = "call rt.clip_grad_norm_(max_norm) (the global norm over every shard and rank)"


def _clip_grad_norm_(parameters, max_norm, norm_type=2.0, error_if_nonfinite=False, foreach=None):
    """torch.nn.utils.clip_grad_norm_, routed to rt.clip_grad_norm_ when the parameters are a wrapped model's."""
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    runtimes = {id(rt): rt for rt in map(_runtime_of, params) if rt is not None}
    if not runtimes:
        return _ORIGINAL["clip_grad_norm_"](params, max_norm, norm_type, error_if_nonfinite, foreach)
    rt = next(iter(runtimes.values()))
    plain = [p for p in params if _runtime_of(p) is None and p.grad is not None]
    given = {id(getattr(p, "_offload_placeholder", p)) for p in params}
    missing = [p for u in rt.units for p in u.placeholders if p.requires_grad and id(p) not in given]
    if len(runtimes) > 1 or plain or missing:
        what = ("parameters of two runtimes" if len(runtimes) > 1 else
                "wrapped parameters together with plain ones that have gradients" if plain else
                f"part of the runtime's parameters ({len(missing)} trainable ones left out)")
        raise RuntimeError(f"offload: torch.nn.utils.clip_grad_norm_ over {what}: the runtime clips all of its "
                           f"gradients by one global norm; {_FIX_CLIP}")
    total = rt.clip_grad_norm_(max_norm, norm_type)
    if error_if_nonfinite and not bool(torch.isfinite(total)):
        raise RuntimeError(f"The total norm of order {norm_type} for gradients from `parameters` is non-finite, so "
                           "it cannot be clipped. To disable this error and scale the gradients by the non-finite "
                           "norm anyway, set `error_if_nonfinite=False`")
    return total


def _refusing(name: str):
    def refuse(parameters, *args, **kwargs):
        params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        if any(_runtime_of(p) is not None for p in params):
            raise RuntimeError(f"offload: torch.nn.utils.{name} over a wrapped model's parameters would change "
                               "nothing (their gradients live in the runtime's shards; .grad is None); "
                               f"{_FIX_CLIP}")
        return _ORIGINAL[name](params, *args, **kwargs)
    return refuse


_ORIGINAL: dict = {}


def _get_total_norm(tensors, *args, **kwargs):
    """torch.nn.utils.get_total_norm, refusing a None gradient with the fix instead of torch's AttributeError."""
    listed = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
    if any(t is None for t in listed):
        raise RuntimeError("offload: torch.nn.utils.get_total_norm got None for a gradient (a parameter without one; "
                           "a wrapped model's parameters always have .grad None, their gradients living in the "
                           "runtime's shards): the global norm over a wrapped model is rt.clip_grad_norm_(max_norm), "
                           "or rt.clip_grad_norm_(float('inf')) to measure it without clipping")
    return _ORIGINAL["get_total_norm"](listed, *args, **kwargs)


def _check_param_device(param, old_param_device):
    """convert_parameters._check_param_device (parameters_to_vector, vector_to_parameters), refusing a wrapped
    model's parameter: a placeholder without values (parameters_to_vector returned a meta vector)."""
    if _runtime_of(param) is not None:
        raise RuntimeError("offload: torch.nn.utils.parameters_to_vector / vector_to_parameters over a wrapped "
                           "model's parameters: they are placeholders without values (the vector would be meta, or "
                           "the writes go nowhere). Read the values with rt.full_state_dict(model) (torch.cat of "
                           "its values, .view(-1), is the vector), write them with model.load_state_dict(...)")
    return _ORIGINAL["_check_param_device"](param, old_param_device)


def _offload_optimizer(optimizer) -> bool:
    from .update.optimizer import ShardedOptimizer

    for _ in range(8):  # Accelerate's (or another) wrapper around it
        if isinstance(optimizer, ShardedOptimizer):
            return True
        optimizer = getattr(optimizer, "optimizer", None)
        if optimizer is None:
            return False
    return False


def _scaler_refusing(name: str):
    original = getattr(torch.amp.GradScaler, name)

    def method(self, optimizer, *args, **kwargs):
        if self.is_enabled() and _offload_optimizer(optimizer):
            raise RuntimeError(f"offload: torch.amp.GradScaler.{name} over an offload optimizer: its gradients live "
                               "in the runtime's shards, where torch's scaler finds none to unscale or check for "
                               "overflow (it asserts 'No inf checks were recorded'); use offload.GradScaler() "
                               "instead, with the same calls (scale, unscale_, step, update): it unscales inside "
                               "the fused update and skips a step that overflows on any rank")
        return original(self, optimizer, *args, **kwargs)

    method.__name__ = method.__qualname__ = name
    method.__wrapped__ = original
    return method


def _refuse_foreign_optimizer(optimizer, args, kwargs) -> None:
    """Global step pre-hook: a torch optimizer over placeholders would step nothing (their .grad stays None)."""
    from .update.optimizer import ShardedOptimizer  # (the update package imports the units)

    if isinstance(optimizer, ShardedOptimizer):
        return
    sizes = tuple(len(g["params"]) for g in optimizer.param_groups)
    if _CHECKED.get(optimizer) == sizes:
        return
    for g in optimizer.param_groups:
        for p in g["params"]:
            if _runtime_of(p) is not None:
                kind = f"{type(optimizer).__name__} ({type(optimizer).__module__})"
                raise RuntimeError(
                    f"offload: the optimizer {kind} over a wrapped model's parameters would step nothing: their "
                    "gradients live in the runtime's shards (.grad stays None). Use offload's optimizers, which step "
                    "the shards: offload.AdamW(model.parameters(), ...) (or offload.AdamW8bit, offload.Lion), and "
                    "rt.clip_grad_norm_ for clipping")
    _CHECKED[optimizer] = sizes


_CHECKED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # optimizer -> group sizes found clean


# See [Note: what is patched, and for how long] in docs/zero-runtime.md
class ForeignCodeGuards:
    """The module docstring's global guards; one handle per open runtime (`remove()` at its close), installed
    while any handle lives."""

    _live = 0
    _step_hook = None

    def __init__(self):
        cls = ForeignCodeGuards
        if cls._live == 0:
            import torch.nn.utils as utils
            from torch.nn.utils import clip_grad

            _ORIGINAL.update(clip_grad_norm_=clip_grad.clip_grad_norm_, clip_grad_value_=clip_grad.clip_grad_value_,
                             clip_grads_with_norm_=clip_grad._clip_grads_with_norm_)
            value, with_norm = _refusing("clip_grad_value_"), _refusing("clip_grads_with_norm_")
            for mod in (utils, clip_grad):
                mod.clip_grad_norm_, mod.clip_grad_value_ = _clip_grad_norm_, value
            utils.clip_grads_with_norm_ = clip_grad._clip_grads_with_norm_ = with_norm
            cls._step_hook = register_optimizer_step_pre_hook(_refuse_foreign_optimizer)
            from torch.nn.utils import convert_parameters

            _ORIGINAL.update(get_total_norm=clip_grad._get_total_norm,
                             _check_param_device=convert_parameters._check_param_device,
                             scaler_unscale_=torch.amp.GradScaler.unscale_, scaler_step=torch.amp.GradScaler.step)
            utils.get_total_norm = clip_grad._get_total_norm = _get_total_norm
            convert_parameters._check_param_device = _check_param_device
            torch.amp.GradScaler.unscale_ = _scaler_refusing("unscale_")
            torch.amp.GradScaler.step = _scaler_refusing("step")
        cls._live += 1
        self._removed = False

    def remove(self) -> None:
        cls = ForeignCodeGuards
        if self._removed:
            return
        self._removed = True
        cls._live -= 1
        if cls._live == 0:
            import torch.nn.utils as utils
            from torch.nn.utils import clip_grad

            for mod in (utils, clip_grad):
                mod.clip_grad_norm_, mod.clip_grad_value_ = _ORIGINAL["clip_grad_norm_"], _ORIGINAL["clip_grad_value_"]
            utils.clip_grads_with_norm_ = clip_grad._clip_grads_with_norm_ = _ORIGINAL["clip_grads_with_norm_"]
            cls._step_hook.remove()
            cls._step_hook = None
            from torch.nn.utils import convert_parameters

            utils.get_total_norm = clip_grad._get_total_norm = _ORIGINAL["get_total_norm"]
            convert_parameters._check_param_device = _ORIGINAL["_check_param_device"]
            torch.amp.GradScaler.unscale_, torch.amp.GradScaler.step = (_ORIGINAL["scaler_unscale_"],
                                                                        _ORIGINAL["scaler_step"])
