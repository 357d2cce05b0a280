"""Building a model inside `offload.init` without ever holding it whole.

Choice: while the block is open, `nn.Module.register_parameter` is patched so every parameter a module
registers is replaced by a meta tensor of the same shape, dtype and requires_grad (buffers stay real:
they are small and often computed in __init__, e.g. rotary frequencies). Construction therefore costs at
most one real parameter at a time. Models are also recorded as they are created (`nn.Module.__init__`),
so the runtime can find the outermost ones later. The patches are on the classes, so for the whole process
(every thread, every module built meanwhile), from Runtime.open to rt.stop_capturing() or the runtime's close;
ConstructionCapture lists them, and docs/environment.md ("What offload patches") lists every patch offload makes.

When the model is first used (its first forward, `offload.AdamW(model.parameters())`, or `rt.wrap`),
units are materialized one at a time: real tensors for the unit's parameters, each starting as it would in an
eager build, from the value it had when registered where that was kept (3 below), and then initialized by
  1. `_init_weights(module)` of the Hugging Face PreTrainedModel holding the module (their own init scheme; only
     transformers' models: nanoGPT's GPT has a method of that name too, and is rule 5's), with the module's own
     `reset_parameters()` first where that scheme leaves one of its parameters unwritten (eager order), else
  2. `module.reset_parameters()` (every torch.nn layer has one), or torch's private `_reset_parameters()`
     (nn.MultiheadAttention, nn.Transformer: they register `torch.empty` parameters and initialize them after,
     when they are already placeholders), else
  3. the value the parameter had when it was registered, kept for modules whose initializer is not known to
     write every parameter (custom modules, with or without a reset_parameters(); costs their parameters' bytes
     while the block is open),
each module after the modules inside it (post-order, as eager __init__ and HF's `model.apply(_init_weights)`
finish a parent after its children: nn.MultiheadAttention zeroes its out_proj's bias after out_proj's own
init), and then
  4. PEFT's LoRA layers, whose own init (`reset_lora_parameters`: B zero, so a new adapter changes nothing)
     ran on placeholders when `get_peft_model` injected them: it runs again for the adapters in the unit,
     with the `init_lora_weights` of the model's `peft_config` (those that read the base weights, PiSSA,
     OLoRA, LoftQ and the like, and DoRA's magnitudes, are refused: the base is placeholders there),
  5. outside Hugging Face models, the writes the model's own code made on the placeholders while the block was
     open (torch.nn.init's functions and in-place tensor methods, on a parameter or a view of it), other than
     those of the holding module's own reset_parameters (rule 2 runs it), replayed in the order they ran:
     nanoGPT's `self.apply(self._init_weights)` and scaled `c_proj` init in __init__, `w.data.normal_(0, 0.02)`,
     `p.data[pad].zero_()`, `p.copy_(pretrained)` (init_record.py records them; a write reading another
     parameter, which has no values yet, is refused naming rt.wrap),
seeded with `config.seed + unit index` in a forked RNG: every rank computes the same values (so each can
keep its own shard) and the user's RNG streams, the CPU's and the compute GPU's, are untouched. On a GPU a
unit is initialized there when the device has room for it (4x its fp32 bytes free), by the GPU's generator:
a model built inside the block then gets other values (from the same distributions) than on a CPU; models
passed to rt.wrap and loaded weights keep theirs. A parameter shared by several
modules is initialized by the first module that holds it, as in eager construction where the last
assignment (the tie) keeps the first module's tensor. The values therefore differ from an eager build
with the same global seed; `rt.wrap(model)` keeps an existing model's values exactly.

`model.load_state_dict(sd)` (also with assign=True) on a model built in the block and not yet used shards
it first (materializing as above) and then loads `sd` into the shards, so pretrained weights are kept;
`model.state_dict()` on such a model likewise shards it first and returns real values; `model.to(device)`,
`.cuda()`, `.float()` move only its buffers (the parameters are placed when it is sharded; a move or cast the
runtime cannot honour is refused, torch_patches.placed_apply). A parameter no initializer wrote and whose value
was not kept is refused by name when its unit is materialized (it starts as NaN: detected, not assumed).
An in-place update of a real tensor from a placeholder (an EMA copy made before the first use) is refused.
"""
from __future__ import annotations

import contextlib
import sys
import weakref

import torch
import torch.nn as nn

from . import init_record
from .init_record import CALLS_ATTR, INIT_FUNCTIONS, Placeholder, recording_init, replay

_STAGED_ATTR = "_offload_initial_value"
_streamed_build = [0]  # > 0 inside values_from_weights(): registered values are not kept


@contextlib.contextmanager
def values_from_weights():
    """For a model built to be filled from its files (rt.wrap(model, weights=...): offload finetune --model,
    from_pretrained inside offload.init, load_peft_model): the values its modules register are not kept for
    materialization (rule 3 above), since the files give every one. Kept, an MoE's fused experts (registered as
    torch.empty by a module outside torch.nn) held a copy of most of the model in host memory until it was sharded."""
    _streamed_build[0] += 1
    try:
        yield
    finally:
        _streamed_build[0] -= 1


def _compiler_built(module: nn.Module) -> bool:
    """A module torch.compile builds while a wrapped model runs (fx graphs, its tracers' roots): never a user's
    model to shard, and noting it would tell the runtime a model is pending at every call, a recompile each time."""
    return isinstance(module, torch.fx.GraphModule) or torch._guards.TracingContext.try_get() is not None


# See [Note: what is patched, and for how long] in docs/zero-runtime.md
class ConstructionCapture:
    """Context that turns parameter registration into meta placeholders and records created modules.

    What it patches, process-wide (on the classes and the torch.nn.init module, so every thread and every module
    built meanwhile, not only the user's model): nn.Module.register_parameter, __init__, load_state_dict,
    state_dict and _apply (a model built here and not used yet: .to()/.cuda()/.float() reach its buffers,
    on_apply), and torch.nn.init's public in-place functions (INIT_FUNCTIONS). For how long: from __enter__
    (Runtime.open) to stop() (rt.stop_capturing(), Runtime.close), the originals put back then; paused(), while
    the runtime builds modules of its own, puts them back for that time. register_parameter makes every parameter
    registered meanwhile a placeholder (except a compiler-built module's); __init__ notes each module built; the
    others call the original for a module or tensor that is not a placeholder. The placeholders record the writes
    made on them, for materialize_unit to replay (init_record.py)."""

    def __init__(self, on_module=None, on_load=None, on_apply=None):
        self.modules: list[weakref.ref] = []
        self.on_module = on_module  # called after each module is built
        self.on_load = on_load  # called with a still-meta module before load_state_dict fills it
        self.on_apply = on_apply  # (module, fn, recurse) -> module: _apply on a still-meta module
        self._originals: list | None = None  # [(owner, name, original)] while patched
        self._patched: list | None = None

    def __enter__(self):
        capture = self
        orig_register = nn.Module.register_parameter
        orig_init = nn.Module.__init__

        def register_parameter(module, name, param):
            if param is not None and param.device.type != "meta" and not _compiler_built(module):
                meta = Placeholder(torch.empty_like(param, device="meta"), requires_grad=param.requires_grad)
                if _may_leave_unwritten(module) and not _streamed_build[0]:
                    # no initializer known to write every parameter of this module: keep the value (rule 3)
                    setattr(meta, _STAGED_ATTR, param.detach().clone())
                param = meta
            orig_register(module, name, param)

        def module_init(module, *args, **kwargs):
            orig_init(module, *args, **kwargs)
            if _compiler_built(module):
                return
            capture.modules.append(weakref.ref(module))
            if capture.on_module is not None:
                capture.on_module()

        orig_load = nn.Module.load_state_dict

        def load_state_dict(module, state_dict, strict=True, assign=False):
            # Loading into meta placeholders would silently keep nothing (copy_ into meta is a no-op, and the
            # first use would re-initialize): shard the model first, then load through the runtime.
            if capture.on_load is not None and is_meta_model(module):
                capture.on_load(module)
                if getattr(module, "_offload_runtime", None) is not None:
                    return module.load_state_dict(state_dict, strict=strict, assign=assign)
            return orig_load(module, state_dict, strict=strict, assign=assign)

        orig_state_dict = nn.Module.state_dict

        def state_dict(module, *args, **kwargs):
            # the same for reading: a model built in the block and not used yet has only placeholders
            if capture.on_load is not None and is_meta_model(module):
                capture.on_load(module)
                if getattr(module, "_offload_runtime", None) is not None:
                    return module.state_dict(*args, **kwargs)
            return orig_state_dict(module, *args, **kwargs)

        orig_apply = nn.Module._apply

        def _apply(module, fn, recurse=True):
            # model.to(device) right after construction: torch's would copy out of the meta placeholders (an error);
            # the runtime places the parameters when it shards the model, so only the buffers move (as once wrapped)
            if capture.on_apply is not None and is_meta_model(module):
                return capture.on_apply(module, fn, recurse)
            return orig_apply(module, fn, recurse)

        patches = [(nn.Module, "register_parameter", register_parameter), (nn.Module, "__init__", module_init),
                   (nn.Module, "load_state_dict", load_state_dict), (nn.Module, "state_dict", state_dict),
                   (nn.Module, "_apply", _apply)]
        patches += [(nn.init, name, recording_init(name, getattr(nn.init, name))) for name in INIT_FUNCTIONS]
        self._originals = [(owner, name, getattr(owner, name)) for owner, name, _ in patches]
        self._patched = patches
        for owner, name, fn in patches:
            setattr(owner, name, fn)
        init_record.state.recording = True
        return self

    def __exit__(self, *exc):
        self.stop()
        return False

    def stop(self) -> None:
        if self._originals is not None:
            for owner, name, fn in self._originals:
                setattr(owner, name, fn)
            self._originals = self._patched = None
            init_record.state.recording = False

    @contextlib.contextmanager
    def paused(self):
        """Real parameters again (for the runtime's own work inside the block)."""
        if self._originals is None:
            yield
            return
        patched, self._patched = self._patched, None
        for owner, name, fn in self._originals:
            setattr(owner, name, fn)
        init_record.state.recording = False
        try:
            yield
        finally:
            for owner, name, fn in patched:
                setattr(owner, name, fn)
            self._patched = patched
            init_record.state.recording = True

    def forget_dead(self) -> None:
        """Drop the records of modules that no longer exist."""
        self.modules[:] = [r for r in self.modules if r() is not None]

    def roots_holding(self, params) -> list[nn.Module]:
        """Outermost recorded modules that hold any of `params` (meta parameters built in the block)."""
        wanted = {id(p) for p in params}
        alive = [m for m in (r() for r in self.modules) if m is not None]
        children = set()
        for m in alive:
            for c in m.modules():
                if c is not m:
                    children.add(id(c))
        roots = [m for m in alive if id(m) not in children]
        return [m for m in roots if any(id(p) in wanted for p in m.parameters())]


def is_meta_model(module: nn.Module) -> bool:
    return any(p.device.type == "meta" and not hasattr(p, "_offload_unit") for p in module.parameters())


def init_device(compute: torch.device, largest_unit_numel: int, group) -> torch.device:
    """Where units' initial values are computed: the GPU when every rank's has room for the largest one (4x its
    fp32 bytes free: the values, the flat copy, the shard, headroom), else the host. Agreed over ranks (a
    collective): each rank keeps a shard of values every rank computed alike, so all must compute them on the
    same kind of device."""
    if compute.type != "cuda":
        return torch.device("cpu")
    from ..collectives import comm

    free, _ = torch.cuda.mem_get_info(compute)
    least = comm.all_reduce_host_(group, torch.tensor([float(free)], dtype=torch.float64), "min",
                                  what="free memory for initialization")
    return compute if least.item() > 4 * 4 * largest_unit_numel else torch.device("cpu")


def materialize_unit(root: nn.Module, params: list, seed: int, device: torch.device = torch.device("cpu"),
                     lora_layers: dict | None = None, hf_inits: dict | None = None) -> list[torch.Tensor]:
    """Real, initialized values (host, fp32 or the parameter's dtype) for a unit's parameters.

    params: [(meta parameter, [(module, attr)], fqn)]. The modules temporarily hold real parameters while
    their init runs; the caller replaces them with placeholders right after. lora_layers: `lora_layers(root)`,
    hf_inits: `hf_inits(root)`, computed once per model by the caller (rules 4 and 1).
    """
    hf = _hf_inits_of(root) if hf_inits is None else hf_inits  # (the argument shadows the module's hf_inits)
    real: dict[int, torch.Tensor] = {}
    owners: dict[int, nn.Module] = {}  # first module holding each parameter initializes it
    modules: list[nn.Module] = []
    for p, refs, _ in params:
        t = torch.empty(p.shape, dtype=p.dtype, device=device)
        staged = getattr(p, _STAGED_ATTR, None)
        # each parameter starts as eagerly built: its registered value where kept, else NaN, which only a parameter
        # no initializer wrote still holds afterwards (detected below, not assumed)
        if staged is not None:
            t.copy_(staged)
        else:
            t.fill_(float("nan"))
        real[id(p)] = nn.Parameter(t, requires_grad=p.requires_grad)
        for module, attr in refs:
            if module not in modules:
                modules.append(module)
        owners[id(p)] = refs[0][0]
    post_order = {id(m): i for i, m in enumerate(_post_order(root))}
    modules.sort(key=lambda m: post_order.get(id(m), -1))
    saved = {}
    for p, refs, _ in params:
        for module, attr in refs:
            saved[(id(module), attr)] = module._parameters[attr]
            module._parameters[attr] = real[id(p)]
    try:
        gpu = [device] if device.type == "cuda" else []
        with torch.random.fork_rng(devices=gpu):  # restores the generators it seeds: the user's streams go on
            torch.random.default_generator.manual_seed(seed)  # not torch.manual_seed: it seeds every GPU
            if gpu:
                torch.cuda.manual_seed(seed)  # the compute device's generator only (forked above)
            with torch.no_grad():
                for module in modules:
                    mine = {id(v) for v in module._parameters.values() if v is not None}
                    # parameters this module shares but does not own keep their owner's value
                    keep = {pid: real[pid].detach().clone() for pid in real
                            if id(real[pid]) in mine and owners[pid] is not module}
                    _init_module(module, hf.get(id(module)))
                    for pid, value in keep.items():
                        real[pid].data.copy_(value)
                for layer, adapter in _adapters_among(modules, lora_layers or {}):
                    _init_lora(root, layer, adapter, modules)
                for p, refs, fqn in params:  # rule 5: the model's own writes on the placeholders, in their order
                    if id(owners[id(p)]) not in hf:
                        replay(real[id(p)], p.__dict__.get(CALLS_ATTR, ()), fqn)
        for p, refs, fqn in params:
            if getattr(p, _STAGED_ATTR, None) is None and bool(torch.isnan(real[id(p)]).any()):
                owner = owners[id(p)]
                raise RuntimeError(
                    f"offload: parameter {fqn!r} of {type(owner).__name__}, built inside offload.init, was written "
                    "by no initializer (its module's reset_parameters() and torch.nn.init calls left it unset) and "
                    "its registered value was not kept; give the module a reset_parameters() that writes it, or "
                    "build the model before offload.init and pass it to rt.wrap(model)")
    finally:
        for p, refs, _ in params:
            for module, attr in refs:
                module._parameters[attr] = saved[(id(module), attr)]
    return [real[id(p)].detach() for p, _, _ in params]


def hf_inits(root: nn.Module) -> dict[int, object]:
    """id(module) -> `_init_weights` of the outermost Hugging Face PreTrainedModel holding it (rule 1): only
    transformers' own models (a method of that name elsewhere, nanoGPT's, is the model's own code, rule 5)."""
    transformers = sys.modules.get("transformers")
    base = getattr(transformers, "PreTrainedModel", None) if transformers is not None else None
    found: dict[int, object] = {}
    if base is None:
        return found
    for m in root.modules():  # pre-order: the outermost model first
        if isinstance(m, base) and id(m) not in found:
            for sub in m.modules():
                found.setdefault(id(sub), m._init_weights)
    return found


def _init_method(module: nn.Module):
    """The module's own initializer: reset_parameters(), else torch's private _reset_parameters(); or None."""
    for name in ("reset_parameters", "_reset_parameters"):
        fn = getattr(module, name, None)
        if callable(fn):
            return fn
    return None


def _may_leave_unwritten(module: nn.Module) -> bool:
    """Whether a parameter this module registers might be written by no initializer: torch.nn's own layers'
    reset_parameters write all of theirs; any other module's (or a module without one) may not."""
    return _init_method(module) is None or not type(module).__module__.startswith("torch.")


def _post_order(root: nn.Module):
    """Every module under root (root included), each after the modules inside it."""
    for child in root.children():
        yield from _post_order(child)
    yield root


_hf_inits_of = hf_inits  # for materialize_unit, whose keyword of that name holds its result


def _init_module(module: nn.Module, hf_init) -> None:
    init = _init_method(module)
    if hf_init is None:
        if init is not None:
            init()
        return
    hf_init(module)
    if init is not None and any(bool(torch.isnan(v).any()) for v in module._parameters.values()
                                if v is not None and v.is_floating_point()):
        init()  # Hugging Face's scheme left some of them unwritten: eager order, the module's own init first
        hf_init(module)


# PEFT's LoRA initializations that need only the adapter's own shape (the rest read the base layer's weights)
_LORA_INITS = (True, False, "gaussian")


def lora_layers(root: nn.Module) -> dict[int, tuple[nn.Module, str]]:
    """id(module) -> (PEFT LoRA layer, adapter name) for every module holding an adapter's tensors: lora_A/lora_B's
    Linears and the embedding adapters' ParameterDicts (duck-typed: PEFT is not imported). Empty without LoRA."""
    found: dict[int, tuple[nn.Module, str]] = {}
    for layer in root.modules():
        if callable(getattr(layer, "reset_lora_parameters", None)):
            for holder, adapter in _adapter_holders(layer):
                found[id(holder)] = (layer, adapter)
    return found


def _adapter_holders(layer: nn.Module, only: str | None = None):
    """(module holding the tensors, adapter name) for each adapter of a LoRA layer (or only `only`)."""
    for table in ("lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B"):
        holder = getattr(layer, table, None)
        if holder is None:
            continue
        for adapter in list(holder.keys()):
            if only is None or adapter == only:
                yield (holder[adapter] if isinstance(holder, nn.ModuleDict) else holder), adapter


def _adapters_among(modules: list[nn.Module], layers: dict[int, tuple[nn.Module, str]]):
    seen, out = set(), []
    for m in modules:
        hit = layers.get(id(m))
        if hit is not None and (id(hit[0]), hit[1]) not in seen:
            seen.add((id(hit[0]), hit[1]))
            out.append(hit)
    return out


def _init_lora(root: nn.Module, layer: nn.Module, adapter: str, modules: list[nn.Module]) -> None:
    """Rule 4: PEFT's own init of `adapter` in `layer`, writing only this unit's tensors: the adapter's other
    tensors (in units of their own: gathered already, or still placeholders) are meta while it runs, so PEFT's
    writes to them are no-ops; each is initialized when its own unit is."""
    config = getattr(root, "peft_config", {}).get(adapter)
    init = getattr(config, "init_lora_weights", True)
    if getattr(layer, "use_dora", {}).get(adapter, False):
        raise ValueError(f"offload: LoRA adapter {adapter!r} uses DoRA (use_dora=True), whose magnitudes are computed "
                         "from the base weights, which are placeholders inside offload.init; apply PEFT to a model "
                         "built outside the block and rt.wrap(model), or train without DoRA")
    if init not in _LORA_INITS:
        raise ValueError(f"offload: LoraConfig(init_lora_weights={init!r}) computes the adapters from the base "
                         "weights, which are placeholders inside offload.init; use init_lora_weights=True (PEFT's "
                         "default) or \"gaussian\", or apply PEFT to a model built outside the block and "
                         "rt.wrap(model)")
    mine = {id(m) for m in modules}
    hidden = [(holder, name, t) for holder, a in _adapter_holders(layer, adapter) if id(holder) not in mine
              for name, t in holder._parameters.items()
              if t is not None and (name == a or not isinstance(holder, nn.ParameterDict))]  # a dict holds them all
    for holder, name, t in hidden:
        holder._parameters[name] = nn.Parameter(torch.empty_like(t, device="meta"), requires_grad=t.requires_grad)
    try:
        if init is False:  # PEFT keeps the Linears' own init then
            for holder, _ in _adapter_holders(layer, adapter):
                if id(holder) in mine and callable(getattr(holder, "reset_parameters", None)):
                    holder.reset_parameters()
        else:
            layer.reset_lora_parameters(adapter, init)
    finally:
        for holder, name, t in hidden:
            holder._parameters[name] = t
