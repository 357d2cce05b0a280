"""The patches a wrapped model gets on torch's own objects, so plain PyTorch code keeps working on it.

Per module of a wrapped model (instance attributes, nothing global):
  _apply          model.to() / .cuda() / .float() reach only buffers: the runtime places and casts parameters
  zero_grad       clears the runtime's gradients of the module's parameters (HF Trainer calls model.zero_grad)
  state_dict      real gathered values instead of meta placeholders (state_dict.py)
  load_state_dict written into the shards (state_dict.py)
"""
from __future__ import annotations

import types

import torch.nn as nn

from .state_dict import wrapped_load_state_dict, wrapped_state_dict


def _apply_to_buffers_only(module: nn.Module, fn, recurse: bool = True):
    """Module._apply for a wrapped model: the runtime places and casts parameters (Config.compute_dtype,
    the compute device), so .to()/.cuda()/.float() reach only the buffers; parameters stay placeholders."""
    if recurse:
        for child in module.children():
            child._apply(fn)
    for key, buf in module._buffers.items():
        if buf is not None:
            module._buffers[key] = fn(buf)
    return module


def _zero_grad_wrapped(module: nn.Module, set_to_none: bool = True) -> None:
    """Module.zero_grad for a wrapped model: clears the runtime's gradients of this module's parameters."""
    module._offload_runtime_ref.zero_grad_params(module.parameters(), set_to_none)


def patch_model(model: nn.Module, runtime) -> None:
    for m in model.modules():
        m._apply = types.MethodType(_apply_to_buffers_only, m)
        m.zero_grad = types.MethodType(_zero_grad_wrapped, m)
        m._offload_runtime_ref = runtime
        m.state_dict = types.MethodType(wrapped_state_dict, m)
        m.load_state_dict = types.MethodType(wrapped_load_state_dict, m)
