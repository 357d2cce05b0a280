"""The tensors of a Hugging Face directory in the layout of the model being built, one parameter at a time.

A checkpoint's names and layout are not always the model's: Hub MoE checkpoints (and transformers' own
save_pretrained) hold one tensor per expert (`mlp.experts.3.gate_proj.weight`, Mixtral's
`block_sparse_moe.experts.3.w1.weight`) where the installed transformers' model has the experts fused into one
parameter (`mlp.experts.gate_up_proj`, [experts, 2 * intermediate, hidden]); older names get renamed. The
installed transformers declares these conversions itself (transformers.conversion_mapping: the model's
WeightRenaming / WeightConverter list, as its from_pretrained applies it); this module plans them over the
files' headers once, then builds each of the model's parameters on demand from just the file tensors it needs
(a fused expert tensor: that layer's experts), so a caller streaming a unit at a time holds about one unit's
worth of sources and result, never the model.

Shapes are planned without reading a byte: the conversion's operations run on meta tensors of the files' shapes.
A model whose layout is the files' (dense models, an MoE with one module per expert) gets the identity plan.
"""
from __future__ import annotations

import functools
from collections.abc import Callable
from copy import deepcopy

import torch
import torch.nn as nn


def _pretrained_of(model: nn.Module):
    """The transformers PreTrainedModel inside `model` (itself, or a PEFT model's base); None for another module."""
    try:
        from transformers import PreTrainedModel
    except ImportError:  # pragma: no cover - transformers is a declared dependency
        return None
    if isinstance(model, PreTrainedModel):
        return model
    base = getattr(model, "get_base_model", None)
    base = base() if callable(base) else None
    return base if isinstance(base, PreTrainedModel) else None


def _conversions(model: nn.Module) -> tuple[list, list]:
    """(renamings, converters): the installed transformers' key and weight conversions for `model`."""
    pretrained = _pretrained_of(model)
    if pretrained is None:
        return [], []
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming
    except ImportError:  # a transformers without conversion mappings: names are taken as they are
        return [], []
    mapping = get_model_conversion_mapping(pretrained)
    return ([m for m in mapping if isinstance(m, WeightRenaming)],
            [m for m in mapping if isinstance(m, WeightConverter)])


def _unlist(value):
    return value[0] if isinstance(value, list) else value


class CheckpointLayout:
    """How each of the model's tensors (by its name in the files' namespace: `targets`) is built from the files.

    entries: the files' tensor name -> (file, shape); targets: the names the model needs; read_file(name) -> the
    tensor `name` of the files. After construction: `shapes` (target -> shape it will have), `sources` (target ->
    file names it is built from), `unused` (file names no target takes)."""

    def __init__(self, model: nn.Module, entries: dict[str, tuple[str, tuple[int, ...]]], targets: set[str],
                 read_file: Callable[[str], torch.Tensor]):
        self._model = _pretrained_of(model)
        self._read_file = read_file
        renamings, converters = _conversions(model)
        by_pattern = {pattern: c for c in converters for pattern in c.source_patterns}
        prefix = getattr(self._model, "base_model_prefix", None) or None
        wanted = dict.fromkeys(targets, True)  # (transformers looks names up in a state dict: only presence counts)
        # target -> [converter template or None, [(file name, source pattern)]]; `first` names the target whose
        # conversion also yields a one-to-many converter's other targets
        self._plan: dict[str, list] = {}
        self._first: dict[str, str] = {}
        from transformers.core_model_loading import dot_natural_key, rename_source_key

        self.unused: list[str] = []
        for key in sorted(entries, key=dot_natural_key):  # experts 0, 1, ..., 10: the order they are stacked in
            renamed, pattern = rename_source_key(key, renamings, converters, prefix, wanted)
            if renamed not in wanted and key in wanted:  # already in the model's layout (as transformers decides)
                renamed, pattern = key, None
            if renamed not in wanted:
                self.unused.append(key)
                continue
            converter = by_pattern[pattern] if pattern is not None else None
            step = self._plan.setdefault(renamed, [converter, []])
            step[1].append((key, pattern if pattern is not None else key))
            if converter is not None:
                for other in converter.target_patterns[1:]:  # a one-to-many conversion (qkv -> q, k, v)
                    self._first.setdefault(renamed.replace(converter.target_patterns[0], other), renamed)
        self.sources = {t: [k for k, _ in step[1]] for t, step in self._plan.items()}
        for other, first in self._first.items():
            self.sources.setdefault(other, self.sources[first])
        self.shapes: dict[str, tuple[int, ...]] = {}
        for target, (converter, files) in self._plan.items():
            if converter is None:
                self.shapes[target] = tuple(entries[files[0][0]][1])
                continue
            try:
                built = self._convert(target, converter, files, lambda k: torch.empty(entries[k][1], device="meta"))
            except Exception as exc:  # shapes the conversion cannot combine: reported by the caller as a mismatch
                self.shapes[target] = ("cannot be built from " + ", ".join(k for k, _ in files[:3])
                                       + f" ({type(exc).__name__}: {exc})",)
                continue
            for name, value in built.items():
                self.shapes.setdefault(name, tuple(value.shape))
        self._spare: dict[str, torch.Tensor] = {}  # a one-to-many conversion's other outputs, until asked for

    def __contains__(self, target: str) -> bool:
        return target in self.shapes

    def _convert(self, target: str, converter, files, read) -> dict[str, torch.Tensor]:
        step = deepcopy(converter)  # (transformers too converts each target with its own copy)
        for key, pattern in files:
            step.add_tensor(target, key, pattern, functools.partial(read, key))
        config = getattr(self._model, "config", None)
        return {name: _unlist(value) for name, value in step.convert(target, model=self._model, config=config).items()}

    def read(self, target: str) -> torch.Tensor:
        """The tensor `target`, built from the files (in the files' dtype)."""
        if target in self._spare:
            return self._spare.pop(target)
        first = self._first.get(target, target)
        converter, files = self._plan[first]
        if converter is None:
            return self._read_file(files[0][0])
        built = self._convert(first, converter, files, self._read_file)
        value = built.pop(target)
        self._spare.update((name, v) for name, v in built.items() if name in self.shapes)
        return value
