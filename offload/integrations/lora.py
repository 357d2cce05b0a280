"""LoRA over an offloaded base: loading a PEFT model whose base streams from safetensors into the store, and
saving what it trained, without ever gathering the whole base.

    with offload.init(cfg) as rt:
        model = load_peft_model("path/to/base", LoraConfig(r=16, lora_alpha=32, target_modules=["q_proj", "v_proj"]))
        ...train the adapters...
        save_adapter(rt, model, "out")   # PeftModel.from_pretrained(base, "out") loads it

The adapters must exist before the model is sharded (the runtime cuts units and their gradient and optimizer
states by what trains), so PEFT is applied to placeholders: `get_peft_model` over a model built inside the block,
then the base's weights streamed in under their PEFT names (`base_model.model.` and `.base_layer` are PEFT's
wrappers), the adapters initialized by PEFT's own rule (offload/zero/units/materialize.py, rule 4). Each adapter is a
unit of its own (offload/zero/units/discover.py, trainable islands): the frozen blocks get no gradient, no optimizer state
and are never written back. `merged_params` gives the base with the adapters merged, one unit at a time, for
a full Hugging Face directory.
"""
from __future__ import annotations

import contextlib
import os
import re
import shutil
from pathlib import Path

import torch.nn as nn

from offload.zero.active import current as current_runtime

_PEFT_WRAPPERS = re.compile(r"^base_model\.model\.|\.base_layer(?=\.)")


def base_name(name: str) -> str:
    """A PEFT model's parameter name as the base model names it ("base_model.model.x.q_proj.base_layer.weight" ->
    "x.q_proj.weight")."""
    return _PEFT_WRAPPERS.sub("", name)


def is_peft_model(model: nn.Module) -> bool:
    """A PEFT PeftModel (duck-typed, so callers need not import peft)."""
    return callable(getattr(type(model), "get_base_model", None)) and hasattr(model, "peft_config")


def _check_config(peft_config) -> None:
    kind = str(getattr(peft_config, "peft_type", ""))
    if not kind.endswith("LORA"):
        raise ValueError(f"offload: load_peft_model takes a LoraConfig (got {type(peft_config).__name__}); other PEFT "
                         "methods: build the PEFT model outside offload.init and rt.wrap(model)")
    if getattr(peft_config, "modules_to_save", None):
        raise ValueError(f"offload: LoraConfig(modules_to_save={peft_config.modules_to_save}) trains copies of base "
                         "modules, initialized from the base's weights, which are placeholders inside offload.init; "
                         "leave modules_to_save unset, or build the PEFT model outside the block and rt.wrap(model)")


def load_peft_model(path: str | os.PathLike, peft_config, model_class=None, adapter_name: str = "default"):
    """Inside an open `offload.init`: the base model of Hugging Face directory `path` (config.json + safetensors)
    with PEFT's LoRA adapters, sharded as it loads: the base streams from the files unit by unit (host memory about
    the cpu budget plus a few units), the adapters are initialized as PEFT does. model_class: default
    AutoModelForCausalLM. Returns the PeftModel."""
    from peft import get_peft_model

    from offload.integrations.hf_model_dir import HFModelDir
    from offload.zero.units.materialize import values_from_weights

    rt = current_runtime()
    if rt is None:
        raise RuntimeError("offload: load_peft_model streams the base into an open runtime: call it inside "
                           "`with offload.init(config):` (outside, use transformers' from_pretrained and "
                           "peft.get_peft_model)")
    _check_config(peft_config)
    if model_class is None:
        from transformers import AutoModelForCausalLM as model_class
    model_dir = HFModelDir(path, flag="load_peft_model")
    with values_from_weights():  # placeholders: nothing allocated (or kept) until the weights stream
        base = model_class.from_config(model_dir.config())
    model_dir.check(base)  # every base parameter's name and shape, before a byte moves
    model = get_peft_model(base, peft_config, adapter_name=adapter_name)
    rt.wrap(model, weights=base_weights(model_dir, model))
    return model


def base_weights(model_dir, model: nn.Module):
    """rt.wrap's `weights` for a PEFT model over the base in `model_dir` (an HFModelDir): the base's tensors under
    their PEFT names; None for the adapters (what trains), which the runtime initializes."""
    adapters = frozenset(id(p) for p in model.parameters() if p.requires_grad)
    return model_dir.weights(model, rename=base_name, initialize=adapters)


def save_adapter(rt, model: nn.Module, out_dir: str | os.PathLike) -> Path:
    """Write the adapters of PeftModel `model` (wrapped by `rt`) as PEFT's directory (adapter_config.json +
    adapter_model.safetensors), gathering only the units that train. Collective: every rank calls it; rank 0
    writes, into a temporary directory first, then moves each file over its old one (never a half-written file)."""
    names = {name for name, p in model.named_parameters() if p.requires_grad}
    from offload.integrations.hf_model_dir import _written

    trained = {n: v for n, v in rt.iter_full_params(model, trainable_only=True) if n in names}
    out = Path(out_dir)
    if rt.rank != 0:
        _written(rt, out, None)  # every rank leaves once rank 0 has written (the next entry point's meeting)
        return out
    try:
        out.mkdir(parents=True, exist_ok=True)
        tmp = out / f".partial-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        model.save_pretrained(str(tmp), state_dict=trained)  # PEFT picks the adapters' keys and names them its way
        for f in tmp.iterdir():
            os.replace(f, out / f.name)
        tmp.rmdir()
    except Exception as exc:
        with contextlib.suppress(Exception):
            _written(rt, out, exc)  # the others raise too
        raise
    _written(rt, out, None)
    return out


def merged_params(rt, model: nn.Module):
    """(base name, fp32 tensor) of PeftModel `model`'s base with its active adapters merged into their layers'
    weights (W + scaling * B @ A, as PEFT's merge_and_unload), one unit at a time. Collective, as
    rt.iter_full_params."""
    layers = {name: m for name, m in model.named_modules() if callable(getattr(m, "reset_lora_parameters", None))}
    for name, layer in layers.items():
        if not isinstance(layer.get_base_layer(), nn.Linear) or layer.lora_variant:
            raise ValueError(f"offload: merging LoRA into {name} ({type(layer.get_base_layer()).__name__}): only "
                             "plain LoRA on nn.Linear is merged here; save the adapter and merge with PEFT")
    trained = {name for name, p in model.named_parameters() if p.requires_grad}  # the adapters
    # the units holding them (the adapters' own, or their blocks where the adapters are not islands: a small model)
    adapters = {n: v for n, v in rt.iter_full_params(model, trainable_only=True) if n in trained}
    for name, value in rt.iter_full_params(model):  # the PeftModel's names (its root unit is the PeftModel's)
        if name in trained:
            continue
        layer_name, _, attr = name.rpartition(".base_layer.")
        layer = layers.get(layer_name) if attr else None
        if layer is not None:
            for a in layer.active_adapters:
                if attr == "weight":
                    delta = adapters[f"{layer_name}.lora_B.{a}.weight"] @ adapters[f"{layer_name}.lora_A.{a}.weight"]
                    value = value + (delta.T if layer.fan_in_fan_out else delta) * layer.scaling[a]
                elif attr == "bias" and layer.lora_bias.get(a, False):
                    value = value + adapters[f"{layer_name}.lora_B.{a}.bias"] * layer.scaling[a]
        yield base_name(name), value
