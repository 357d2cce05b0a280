"""`from_pretrained` inside an open runtime: `with offload.init(cfg): model = AutoModelForCausalLM.from_pretrained(DIR)`
(any PreTrainedModel class) builds the model as placeholders and streams DIR's safetensors into the store unit by
unit, so no rank ever holds the whole model (host memory while loading: about the cpu budget plus a few units),
as `rt.wrap(model, weights=...)` does for `offload finetune`. Outside a runtime from_pretrained is transformers'
own. Arguments that would change where or how weights load are refused by name.

What is patched, where and for how long: `transformers.PreTrainedModel.from_pretrained` (the classmethod every
model class inherits), replaced process-wide when this module is first imported (by Runtime.open when transformers
is loaded, or by importing offload.integrations.transformers), and never put back: the replacement asks
offload.zero.runtime.current() at each call and, with no runtime open, calls transformers' own with the same
arguments. A model class that defines its own from_pretrained is not affected. docs/environment.md ("What offload
patches") lists every patch offload makes.
"""
from __future__ import annotations

import functools
import os

import torch
from transformers import PreTrainedModel

from offload.zero.active import current as current_runtime

# from_pretrained arguments that change nothing for a local directory of safetensors (dtype is checked apart)
_FROM_PRETRAINED_HARMLESS = {"cache_dir", "force_download", "local_files_only", "token", "revision", "use_safetensors",
                             "weights_only", "disable_mmap", "trust_remote_code", "low_cpu_mem_usage", "_from_auto",
                             "_commit_hash", "attn_implementation", "dtype", "torch_dtype"}
# ... and these, at these values (what transformers takes when they are not given)
_FROM_PRETRAINED_DEFAULTS = {"ignore_mismatched_sizes": (False,), "fusion_config": (None,), "device_map": (None,),
                             "subfolder": ("", None), "variant": (None,)}
_ADAPTER_LOOKUP = {"revision", "token", "cache_dir", "local_files_only", "_commit_hash"}  # Auto copies these in


def _dtype_ok(value, rt) -> bool:
    if value in (None, "auto"):
        return True
    if isinstance(value, str):
        value = getattr(torch, value, None)
    return value in (torch.float32, rt.compute_dtype)


def _from_pretrained_streamed(rt, cls, path, *model_args, config=None, **kwargs):
    from offload.integrations.hf_model_dir import HFModelDir
    from offload.zero.units.materialize import values_from_weights

    if model_args:
        raise ValueError(f"offload: {cls.__name__}.from_pretrained inside offload.init takes no positional model "
                         "arguments")
    for key, value in kwargs.items():
        if key in ("dtype", "torch_dtype") and not _dtype_ok(value, rt):
            raise ValueError(f"offload: from_pretrained({key}={value}) inside offload.init; the runtime's "
                             f"Config.compute_dtype ({rt.config.compute_dtype}) decides, with an fp32 master copy")
        if key == "adapter_kwargs" and set(value or {}) <= _ADAPTER_LOOKUP:
            continue  # the Auto classes pass the loading options on for an adapter lookup: no adapter asked for
        if key not in _FROM_PRETRAINED_HARMLESS and value not in _FROM_PRETRAINED_DEFAULTS.get(key, ()):
            raise ValueError(f"offload: from_pretrained({key}={value!r}) is not supported inside offload.init (the "
                             "runtime places and loads the weights itself, from a local directory)")
    model_dir = HFModelDir(path, flag=f"{cls.__name__}.from_pretrained")
    if config is None or isinstance(config, (str, os.PathLike)):
        config = model_dir.config() if config is None else type(model_dir.config()).from_pretrained(str(config))
    extra = {"attn_implementation": kwargs["attn_implementation"]} if kwargs.get("attn_implementation") else {}
    with values_from_weights():  # placeholders: nothing is allocated (or kept) until the weights stream in
        model = cls._from_config(config, **extra)
    try:
        model_dir.check(model)  # every parameter's name and shape, before a byte moves
    except ValueError as exc:
        raise type(exc)(f"{exc}. Inside offload.init every parameter must be in the files under its own name: a new "
                        "head, or a base model's class over a task model's directory, is not loaded there yet; "
                        "load it outside offload.init and rt.wrap(model)") from None
    rt.wrap(model, weights=model_dir.weights(model))
    model_dir.load_buffers(model)
    model_dir.adopt_generation_config(model)
    model.eval()  # as transformers' from_pretrained leaves it
    return model


def _install_streaming_from_pretrained() -> None:
    original = PreTrainedModel.from_pretrained.__func__
    if getattr(original, "_offload_streamed", False):
        return

    @functools.wraps(original)
    def from_pretrained(cls, pretrained_model_name_or_path, *model_args, **kwargs):
        rt = current_runtime()
        if rt is None:
            return original(cls, pretrained_model_name_or_path, *model_args, **kwargs)
        return _from_pretrained_streamed(rt, cls, pretrained_model_name_or_path, *model_args, **kwargs)

    from_pretrained._offload_streamed = True
    PreTrainedModel.from_pretrained = classmethod(from_pretrained)


_install_streaming_from_pretrained()
