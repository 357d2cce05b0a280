"""What a wrapped model's modules do differently, so plain PyTorch code keeps working on it.

Each module of a wrapped model gets a class of its own: `OffloadModule` before its class in the MRO, as
FSDP2's fully_shard does (one class per original class, made once, with the original's name, so code that
reads `type(model).__name__` - Hugging Face's `architectures` in config.json - sees what it saw before).
Nothing is patched globally, and on instances only where torch looks there first (the parameter placeholders'
refused gradient hooks, wrap.py; the zero_grad of torch.compile's wrapper, route_compiled_zero_grad below):
  _apply          model.to() / .cuda() / .float() reach only buffers: the runtime places and casts parameters
  zero_grad       clears the runtime's gradients of the module's parameters (HF Trainer calls model.zero_grad)
  state_dict      real gathered values instead of meta placeholders (state_dict.py)
  load_state_dict written into the shards (state_dict.py)
  device / dtype  where a class has them as properties (Hugging Face's, read from the first parameter, a meta
                  placeholder here): the runtime's compute device and dtype, so `inputs.to(model.device)` works
  deepcopy/pickle refused, naming the fix: the values live in the runtime's shards, not in the module
"""
from __future__ import annotations

import torch.nn as nn

from .state_dict import wrapped_load_state_dict, wrapped_state_dict


class OffloadModule:
    """Mixin of every module of a wrapped model; `_offload_runtime_ref` is the runtime that owns it."""

    _offload_runtime_ref = None

    def _apply(self, fn, recurse: bool = True):
        """The runtime places and casts parameters (Config.compute_dtype, the compute device), so
        .to()/.cuda()/.float() reach only the buffers; parameters stay placeholders."""
        if recurse:
            for child in self.children():
                child._apply(fn)
        for key, buf in self._buffers.items():
            if buf is not None:
                self._buffers[key] = fn(buf)
        return self

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the runtime's gradients of this module's parameters."""
        self._offload_runtime_ref.zero_grad_params(self.parameters(), set_to_none)

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


_CLASSES: dict[type, type] = {}  # original class -> its offload class


def offload_class(cls: type) -> type:
    """The class a wrapped module of class `cls` gets (made once per class)."""
    if issubclass(cls, OffloadModule):
        return cls
    made = _CLASSES.get(cls)
    if made is None:
        body = {"__module__": cls.__module__, "__qualname__": cls.__qualname__}
        if isinstance(getattr(cls, "device", None), property):
            body["device"] = property(lambda self: self._offload_runtime_ref.device)
        if isinstance(getattr(cls, "dtype", None), property):
            body["dtype"] = property(lambda self: self._offload_runtime_ref.compute_dtype)
        made = type(cls.__name__, (OffloadModule, cls), body)
        _CLASSES[cls] = made
    return made


def patch_model(model: nn.Module, runtime) -> None:
    for m in model.modules():
        m.__class__ = offload_class(type(m))
        m._offload_runtime_ref = runtime


def route_compiled_zero_grad(compiled: nn.Module) -> None:
    """torch.compile(model) returns torch's OptimizedModule around the model: its own zero_grad walks the parameter
    placeholders and clears nothing of the runtime's gradients, which then sum over the steps. Routed to the
    wrapped model's zero_grad (an instance attribute, found before the class's method); anything else: no-op."""
    inner = getattr(compiled, "_orig_mod", None)
    if inner is not None and getattr(inner, "_offload_runtime_ref", None) is not None:
        compiled.__dict__["zero_grad"] = inner.zero_grad
