"""Hugging Face model directories in and out, without ever holding the model whole.

In: `HFModelDir(path)` checks the directory (config.json; model.safetensors, or shards named by
model.safetensors.index.json, every one present) and reads only the safetensors headers; `check(model)`
compares every parameter's name and shape with them before any byte is loaded (through the installed transformers'
conversions where the files' layout is not the model's: per-expert tensors into fused experts, checkpoint_layout.py);
`weights` hands `rt.wrap(model, weights=...)` one tensor at a time, so the runtime streams the file into its store
unit by unit (peak host memory: about one unit plus the budgets, not the model).

Out: `save_pretrained(rt, model, out_dir, ...)` gathers one unit at a time (a collective: every rank
calls it; rank 0 writes), fills safetensors files up to `max_shard_bytes` each (several files get an
index, as transformers writes them), then config.json and the tokenizer. Files are written under a
temporary name and renamed into place, so a reader never sees a half-written file.
"""
from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

import torch
import torch.nn as nn

from ..checkpoint.hf_writer import INDEX_NAME, SINGLE_NAME, write_hf_weights
from ..errors import InputError
from ..zero.units.state_dict import persistent_buffers
from .checkpoint_layout import CheckpointLayout



class ModelDirError(InputError):
    """A model directory that cannot be loaded; the message names the path and the fix."""


def _alias_names(model: nn.Module, rename=None) -> dict[int, list[str]]:
    """id(parameter) -> every qualified name it has (tied weights have several), each through `rename`."""
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(rename(name) if rename is not None else name)
    return names


class HFModelDir:
    def __init__(self, path: str | os.PathLike, flag: str = "--model"):
        self.path = Path(path)
        self.flag = flag
        where = f"{flag} {self.path}"
        if not self.path.is_dir():
            raise ModelDirError(f"{where}: not a directory; give a Hugging Face model directory "
                                "(config.json + model.safetensors, as model.save_pretrained(DIR) writes it)")
        if not (self.path / "config.json").is_file():
            raise ModelDirError(f"{where}: no config.json; a Hugging Face model directory holds config.json and "
                                "model.safetensors (save one with model.save_pretrained(DIR))")
        try:
            quantized = json.loads((self.path / "config.json").read_text()).get("quantization_config")
        except (OSError, ValueError, AttributeError) as exc:
            raise ModelDirError(f"{where}: config.json is not a JSON object ({exc})") from None
        if quantized:  # FP8 / GPTQ / AWQ / bitsandbytes: same names and shapes, other numbers (scales beside)
            method = quantized.get("quant_method", "?") if isinstance(quantized, dict) else "?"
            raise ModelDirError(f"{where}: config.json has a quantization_config (quant_method {method!r}): its "
                                "weights are quantized, with scales the plain read here would drop; give the model "
                                "in bf16 or fp32 (the unquantized release, or one dequantized and saved with "
                                "save_pretrained)")
        index = self.path / INDEX_NAME
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (ValueError, KeyError) as exc:
                raise ModelDirError(f"{where}: {INDEX_NAME} is not a safetensors index ({exc}); re-save the "
                                    "model with save_pretrained") from None
            files = sorted(set(weight_map.values()))
            for f in files:
                if Path(f).is_absolute() or ".." in Path(f).parts:
                    raise ModelDirError(f"{where}: {INDEX_NAME} names {f!r}, outside the directory")
            missing = [f for f in files if not (self.path / f).is_file()]
            if missing:
                raise ModelDirError(f"{where}: {INDEX_NAME} names shard(s) {missing} that are not in the "
                                    "directory; copy the missing files (or download the model again)")
        elif (self.path / SINGLE_NAME).is_file():
            files = [SINGLE_NAME]
        else:
            found = sorted(p.name for p in self.path.iterdir())
            raise ModelDirError(f"{where}: neither {SINGLE_NAME} nor {INDEX_NAME} (found {found}); weights must be "
                                "safetensors (model.save_pretrained(DIR, safe_serialization=True))")
        from safetensors import safe_open

        self.entries: dict[str, tuple[str, tuple[int, ...]]] = {}  # tensor name -> (file, shape)
        for f in files:
            try:
                with safe_open(str(self.path / f), framework="pt") as fh:
                    for name in fh.keys():
                        self.entries[name] = (f, tuple(fh.get_slice(name).get_shape()))
            except Exception as exc:  # safetensors raises its own error types for a bad header
                raise ModelDirError(f"{where}: {f} is not a readable safetensors file ({exc})") from None

    def load_buffers(self, model: nn.Module, rename=None) -> list[str]:
        """The persistent buffers the files hold, copied into `model`'s (after rt.wrap: buffers are replicated, not
        sharded); left at their initial values they were written out so at the save. Returns the names loaded."""
        from safetensors import safe_open

        loaded = []
        for name, buf in persistent_buffers(model):
            hit = rename(name) if rename is not None else name
            if hit in self.entries:
                with safe_open(str(self.path / self.entries[hit][0]), framework="pt") as fh:
                    with torch.no_grad():
                        buf.copy_(fh.get_tensor(hit))
                loaded.append(hit)
        return loaded

    def adopt_generation_config(self, model: nn.Module) -> None:
        """The directory's generation_config.json (sampling defaults, extra end-of-sequence ids) onto `model`, as
        from_pretrained does; a model built from its config alone has defaults derived from the config."""
        if model.can_generate() and (self.path / "generation_config.json").is_file():
            from transformers import GenerationConfig

            model.generation_config = GenerationConfig.from_pretrained(str(self.path))

    def config(self):
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(str(self.path))

    def layout(self, model: nn.Module, rename=None) -> CheckpointLayout:
        """The files' tensors planned into `model`'s layout (checkpoint_layout.py: the installed transformers'
        conversions, e.g. per-expert tensors into fused experts), by the names `rename` gives the model's."""
        from safetensors import safe_open

        def read_file(hit: str) -> torch.Tensor:
            # opened per tensor: the mapping (and the page cache it pins in this process's RSS) goes with it
            with safe_open(str(self.path / self.entries[hit][0]), framework="pt") as fh:
                return fh.get_tensor(hit)

        targets = {n for names in _alias_names(model, rename).values() for n in names}
        return CheckpointLayout(model, self.entries, targets, read_file)

    def check(self, model: nn.Module, rename=None, skip: frozenset = frozenset()) -> list[str]:
        """Raise (naming file, tensor and shapes) unless every parameter of `model` is in the files with its
        shape (directly, or built by the installed transformers' conversion: fused experts from per-expert
        tensors); return the names in the files that the model does not use (ignored, as transformers does).
        rename maps the model's names to the files' (a PEFT model's to its base's); parameters in `skip` (ids) are
        not in the files (new adapters)."""
        errors, used = [], set()
        layout = self.layout(model, rename)
        params = {id(p): p for p in model.parameters()}
        for pid, names in _alias_names(model, rename).items():
            if pid in skip:
                continue
            p = params[pid]
            hit = next((n for n in names if n in layout), None)
            if hit is None:
                errors.append(f"{names[0]} is missing")
                continue
            used.update(layout.sources[hit])
            shape = layout.shapes[hit]
            if shape != tuple(p.shape):
                sources = layout.sources[hit]
                more = f" and {len(sources) - 1} more" if len(sources) > 1 else ""
                where = (f"{hit} in {self.entries[hit][0]}" if sources == [hit]
                         else f"{hit} (built from {sources[0]}{more})")
                got = list(shape) if all(isinstance(d, int) for d in shape) else shape[0]
                errors.append(f"{where} has shape {got} but the config gives {list(p.shape)}")
        for name, buf in persistent_buffers(model):  # loaded too (load_buffers): not ignored
            hit = rename(name) if rename is not None else name
            if hit in self.entries:
                if self.entries[hit][1] != tuple(buf.shape):
                    errors.append(f"buffer {hit} in {self.entries[hit][0]} has shape {list(self.entries[hit][1])} but "
                                  f"the config gives {list(buf.shape)}")
                used.add(hit)
        if errors:
            shown = "; ".join(errors[:8]) + (f"; ... {len(errors) - 8} more" if len(errors) > 8 else "")
            raise ModelDirError(f"{self.flag} {self.path}: the safetensors do not match config.json: {shown}. The "
                                "weights and config.json must come from the same model")
        return sorted(set(self.entries) - used)

    def weights(self, model: nn.Module, rename=None, initialize: frozenset = frozenset()):
        """A callable (name, meta parameter) -> fp32 host tensor, for rt.wrap(model, weights=...); rename as in
        check; None for the parameters in `initialize` (ids), which the runtime initializes. A parameter the
        conversion builds from several tensors (a layer's fused experts) reads just those, when it is asked for."""
        aliases = _alias_names(model, rename)
        layout = self.layout(model, rename)

        def read(name: str, meta: torch.Tensor) -> torch.Tensor | None:
            if id(meta) in initialize:
                return None
            hit = next(n for n in aliases.get(id(meta), [name]) if n in layout)
            return layout.read(hit).to(torch.float32)

        return read


def save_pretrained(rt, model: nn.Module, out_dir: str | os.PathLike, tokenizer=None,
                    max_shard_bytes: int = 2 << 30, dtype: torch.dtype = torch.float32, params=None) -> Path:
    """Write `model` (wrapped by `rt`) as a Hugging Face directory `out_dir`. Collective: every rank takes
    part in the gathers (one unit at a time); rank 0 writes. params: (name, value) pairs to write instead of
    the model's own (a LoRA model's merged base: offload.integrations.lora.merged_params). Returns the directory."""

    def tensors():
        last = None
        for name, value in params if params is not None else rt.iter_full_params(model):  # a unit at a time
            if value is not last:  # a tied weight comes once per name, the same tensor: stored once, under its
                yield name, value.to(dtype)  # first name (as transformers does)
            last = value
        for name, buf in persistent_buffers(model):
            yield name, buf.detach().cpu()

    if rt.rank != 0:
        for _ in tensors():  # the other ranks take part in the gathers only
            pass
        _written(rt, out_dir, None)
        return Path(out_dir)

    def add_files(tmp: Path) -> None:
        config = getattr(model, "config", None)
        if config is not None:
            config = config.__class__.from_dict(config.to_dict())  # a copy: the live model's config stays as is
            config.dtype = dtype
            config.save_pretrained(str(tmp))
        generation = getattr(model, "generation_config", None)
        if generation is not None and model.can_generate():  # sampling defaults, eos ids: as transformers keeps them
            generation.save_pretrained(str(tmp))
        if tokenizer is not None:
            tokenizer.save_pretrained(str(tmp))

    gathering = {"failed": False}

    def values():
        try:
            yield from tensors()
        except BaseException:
            gathering["failed"] = True  # (every rank's gathers fail alike, or the call was refused: no sync)
            raise

    feed = values()
    try:
        written = write_hf_weights(out_dir, feed, max_shard_bytes, add_files)
    except Exception as exc:
        if not gathering["failed"]:  # the writing failed: the others hear of it once the gathers are over
            with contextlib.suppress(Exception):
                for _ in feed:  # the rest of the gathers, which the other ranks are in
                    pass
                _written(rt, out_dir, exc)
        raise
    _written(rt, out_dir, None)
    return written


def _written(rt, out_dir, error) -> None:
    """Every rank leaves save_pretrained once rank 0 has written (or failed to: then every rank raises). Without it
    the others went on to the next collective entry point while rank 0 still wrote its last file (seconds to
    minutes for a 2 GiB shard), and that entry point's meeting (Config.agreement_timeout) refused the call."""
    if rt.world_size <= 1:
        return
    from ..zero.collectives import comm

    flag = torch.tensor([0.0 if error is None else 1.0])
    comm.all_reduce_host_(rt.group, flag, "max", what=f"save_pretrained({out_dir}) written")
    if flag.item() and error is None:
        raise RuntimeError(f"offload: save_pretrained({out_dir}) failed on rank 0 (its error is in rank 0's log); "
                           "nothing complete was written")
