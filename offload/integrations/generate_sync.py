"""`generate()` of a Hugging Face model wrapped by an offload runtime, at world size > 1: with synced ranks.

Each forward of a wrapped model gathers its units (collectives: every rank must run as many forwards, in one order).
Greedy or sampled generation stops on each rank when its own sequences end (eos, or a per-rank max_new_tokens), so a
rank that stops first leaves the others' next gathers unpaired (a hang), or pairs them with its own next collectives
(units of the same size: wrong numbers, no error). transformers runs the ranks in step, a rank that finished feeding
dummy forwards until every rank has (`synced_gpus=True`), but turns it on by itself only for DeepSpeed ZeRO-3
(`is_deepspeed_zero3_enabled()`) or FSDP models (`is_fsdp_managed_module(model)`: the `_is_fsdp_managed_module`
attribute, which torch.compile also reads, so offload does not set it). So while a runtime with more than one rank
is open, `GenerationMixin.generate` given no `synced_gpus` takes `synced_gpus=True` for a model holding an open
runtime's parameters (wrapped, or built in the block and not used yet); an explicit `synced_gpus` is kept. Installed
by the runtime when it opens with transformers loaded, or when transformers is loaded later (a module built in the
block, `rt.wrap`), removed when the last such runtime closes.
"""
from __future__ import annotations

import functools

from transformers.generation.utils import GenerationMixin

_INSTALLED: list = []  # the open runtimes' hooks; the patch stays while any is installed
_ORIGINAL = GenerationMixin.__dict__["generate"]
_SYNCED_AT = 6  # synced_gpus's position in generate(self, inputs, generation_config, logits_processor, ...)


def _runtime_of(model):
    """The runtime whose parameters `model` holds (placeholders of its units), or for a model built in the block and
    not used yet (meta parameters, wrapped at its first forward) the current one."""
    meta = False
    for p in model.parameters():
        rt = getattr(p, "_offload_runtime", None)
        if rt is not None:
            return rt
        meta = meta or p.is_meta
    if meta:
        from offload.zero.active import current

        return current()
    return None


@functools.wraps(_ORIGINAL)
def _generate(self, *args, **kwargs):
    if kwargs.get("synced_gpus") is None and len(args) < _SYNCED_AT:
        rt = _runtime_of(self)
        if rt is not None and rt.is_open and rt.group.distributed:
            kwargs["synced_gpus"] = True  # every rank runs forwards until all are done (the module's docstring)
    return _ORIGINAL(self, *args, **kwargs)


# See [Note: what is patched, and for how long] in docs/zero-runtime.md
class SyncedGenerate:
    """The patch's life, one per open runtime (remove() at close)."""

    def __init__(self):
        if not _INSTALLED:
            GenerationMixin.generate = _generate
        _INSTALLED.append(self)

    def remove(self) -> None:
        if self in _INSTALLED:
            _INSTALLED.remove(self)
        if not _INSTALLED and GenerationMixin.__dict__.get("generate") is _generate:
            GenerationMixin.generate = _ORIGINAL
