"""Unit discovery: which modules become units, and which parameters each unit owns.

Policies (offload.Config):
- default: every element of a ModuleList whose elements are >= 2 blocks of one class holding parameters
  (HF decoder layers, nn.TransformerEncoderLayer stacks); the outermost such lists win. Then every other
  module holding at least as many parameters as the smallest block (an untied embedding, an LM head) is a
  unit too, children first: left in the root, it would be gathered for the whole step, and the root's
  update would hold back the next forward.
- unit_classes: every instance of the named classes (outermost wins, no nesting).
- unit_min_bytes: post-order, every submodule whose not-yet-claimed parameters reach the threshold.
Trainable islands (every policy): in a unit whose parameters are nearly all frozen, each outermost submodule whose
parameters all train is a unit of its own (LoRA's adapters inside a frozen block), so the frozen unit has no
gradient, no optimizer state and is never written back, and only the islands train. Islands stay gathered (as
units under persist_threshold do): adapters are small, and a gather of each per forward and backward costs more
than it saves.
Everything else belongs to the root unit (the wrapped model). A parameter reachable from two units (a
weight shared between blocks, or between a block and the root) is owned by the root, so it is gathered
for the whole forward and backward and every user sees the same storage.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch.nn as nn

from ...config import Config, parse_size


@dataclass
class UnitSpec:
    name: str  # qualified module name ("" for the root)
    module: nn.Module
    params: list  # [(param, [(module, attr)], fqn)] owned by this unit, in first-seen order
    island: bool = False  # a trainable island (module docstring): small, kept gathered


def _matches(module: nn.Module, classes: tuple) -> bool:
    for cls in classes:
        if isinstance(cls, type) and isinstance(module, cls):
            return True
        if isinstance(cls, str) and type(module).__name__ == cls:
            return True
    return False


def _has_params(module: nn.Module) -> bool:
    return any(True for _ in module.parameters())


# Containers whose entries are called or read by another module, never called themselves (PEFT calls
# `lora_A["default"]` and reads `lora_embedding_A["default"]`): as a unit, their hooks would never run.
_CONTAINERS = (nn.ModuleDict, nn.ModuleList, nn.ParameterDict, nn.ParameterList)


def choose_unit_modules(root: nn.Module, cfg: Config) -> list[tuple[str, nn.Module]]:
    """(qualified name, module) of the non-root units, in module order."""
    chosen: list[tuple[str, nn.Module]] = []
    taken: set[int] = set()

    def inside_taken(name: str) -> bool:
        return any(name == t or name.startswith(t + ".") for t, _ in chosen)

    if cfg.unit_min_bytes is not None:
        threshold = parse_size(cfg.unit_min_bytes, "unit_min_bytes")
        width = cfg.torch_compute_dtype.itemsize
        claimed: set[int] = set()
        picked: list[tuple[str, nn.Module]] = []

        def visit(name: str, module: nn.Module) -> None:
            for child_name, child in module.named_children():
                visit(f"{name}.{child_name}" if name else child_name, child)
            if module is root or isinstance(module, _CONTAINERS):
                return  # (a container is never called: its parameters go to the module that calls its entries)
            free = [p for p in module.parameters() if id(p) not in claimed]
            if sum(p.numel() for p in free) * width >= threshold and free:
                picked.append((name, module))
                claimed.update(id(p) for p in free)

        visit("", root)
        order = {id(m): i for i, (_, m) in enumerate(root.named_modules())}
        return sorted(picked, key=lambda nm: order[id(nm[1])])

    for name, module in root.named_modules():
        if module is root or inside_taken(name) or id(module) in taken:
            continue
        if cfg.unit_classes:
            if _matches(module, cfg.unit_classes) and _has_params(module):
                chosen.append((name, module))
                taken.add(id(module))
        elif isinstance(module, nn.ModuleList):
            kids = list(module)
            if len(kids) >= 2 and len({type(k) for k in kids}) == 1 and all(_has_params(k) for k in kids):
                for i, kid in enumerate(kids):
                    if id(kid) not in taken:
                        chosen.append((f"{name}.{i}" if name else str(i), kid))
                        taken.add(id(kid))
    if chosen and not cfg.unit_classes:
        chosen += _large_leftovers(root, chosen)
        order = {id(m): i for i, (_, m) in enumerate(root.named_modules())}
        chosen.sort(key=lambda nm: order[id(nm[1])])
    return chosen


def _numel(params) -> int:
    return sum(p.numel() for p in params)


def _large_leftovers(root: nn.Module, blocks: list[tuple[str, nn.Module]]) -> list[tuple[str, nn.Module]]:
    """Modules outside the blocks holding at least the smallest block's parameter count (of parameters no
    module outside them shares: a tied embedding and head stay in the root), children first."""
    claimed = {id(p) for _, b in blocks for p in b.parameters()}
    threshold = min(_numel(b.parameters()) for _, b in blocks)
    block_ids = {id(b) for _, b in blocks}
    holders: dict[int, set] = {}  # parameter -> the modules holding it directly (a tied weight has several)
    for module in root.modules():
        for p in module._parameters.values():
            if p is not None:
                holders.setdefault(id(p), set()).add(id(module))
    picked: list[tuple[str, nn.Module]] = []

    def visit(name: str, module: nn.Module) -> None:
        if id(module) in block_ids:
            return
        for child_name, child in module.named_children():
            visit(f"{name}.{child_name}" if name else child_name, child)
        if module is root or isinstance(module, _CONTAINERS) or any(id(m) in block_ids for m in module.modules()):
            return  # the root, a container (never called), or one of blocks: its leftovers stay in the root
        inside = {id(m) for m in module.modules()}
        free = [p for p in module.parameters() if id(p) not in claimed and holders[id(p)] <= inside]  # not tied out
        if free and _numel(free) >= threshold:
            picked.append((name, module))
            claimed.update(id(p) for p in free)

    visit("", root)
    return picked


def _all_train(module: nn.Module) -> bool:
    params = list(module.parameters())
    return bool(params) and all(p.requires_grad for p in params)


def trainable_islands(root: nn.Module, units: list[tuple[str, nn.Module]]) -> list[tuple[str, nn.Module]]:
    """(name, module) of each outermost submodule, not a unit already nor a container (_CONTAINERS), whose
    parameters all train and whose enclosing unit (the innermost of `units` holding it, else the root) is mostly
    frozen."""
    if all(p.requires_grad for p in root.parameters()):
        return []
    modules = dict(root.named_modules())
    unit_names = {n for n, _ in units}

    def enclosing(name: str) -> nn.Module:
        best = ""
        for n in unit_names:
            if (name == n or name.startswith(n + ".")) and len(n) > len(best):
                best = n
        return modules[best] if best else root

    def callable_island(module: nn.Module) -> bool:  # a container is never called: its hooks would never run
        return _all_train(module) and not isinstance(module, _CONTAINERS)

    picked: list[tuple[str, nn.Module]] = []
    for name, module in root.named_modules():
        if module is root or name in unit_names or not callable_island(module):
            continue
        parent = name.rpartition(".")[0]
        if callable_island(modules[parent] if parent else root) or any(name.startswith(n + ".") for n, _ in picked):
            continue  # not the outermost such module
        if _mostly_frozen(enclosing(name)):
            picked.append((name, module))
    return picked


ISLAND_RATIO = 32  # islands only where the frozen parameters outnumber the trainable ones this many times


def _mostly_frozen(module: nn.Module) -> bool:
    """The frozen parameters under `module` outnumber the trainable ones ISLAND_RATIO times: a block LoRA adapts
    (a 4096-wide layer with r=8 adapters: over 1000 times), where the states and write-backs the islands save
    outweigh their units' own cost. A block that freezes half its weights, or a model that freezes a table,
    keeps its units as they are."""
    frozen = sum(p.numel() for p in module.parameters() if not p.requires_grad)
    return frozen > 0 and frozen >= ISLAND_RATIO * sum(p.numel() for p in module.parameters() if p.requires_grad)


def discover_units(root: nn.Module, cfg: Config) -> list[UnitSpec]:
    """Units with the parameters each owns; index 0 is the root unit."""
    blocks = choose_unit_modules(root, cfg)
    islands = trainable_islands(root, blocks)
    if islands:
        order = {id(m): i for i, (_, m) in enumerate(root.named_modules())}
        blocks = sorted(blocks + islands, key=lambda nm: order[id(nm[1])])
    block_prefixes = [(n, i + 1) for i, (n, _) in enumerate(blocks)]
    island_ids = {id(m) for _, m in islands}
    specs = [UnitSpec("", root, [])] + [UnitSpec(n, m, [], id(m) in island_ids) for n, m in blocks]

    def owner_of(module_name: str) -> int:
        best, best_len = 0, -1
        for prefix, idx in block_prefixes:
            if (module_name == prefix or module_name.startswith(prefix + ".")) and len(prefix) > best_len:
                best, best_len = idx, len(prefix)
        return best

    seen: dict[int, tuple] = {}  # id(param) -> (param, refs, fqn, owners)
    order: list[int] = []
    for mod_name, module in root.named_modules(remove_duplicate=False):
        for pname, p in list(module._parameters.items()):
            if p is None:
                continue
            key = id(p)
            if key not in seen:
                seen[key] = (p, [], f"{mod_name}.{pname}" if mod_name else pname, set())
                order.append(key)
            entry = seen[key]
            if (module, pname) not in [(m, n) for m, n in entry[1]]:
                entry[1].append((module, pname))
            entry[3].add(owner_of(mod_name))
    for key in order:
        p, refs, fqn, owners = seen[key]
        owner = next(iter(owners)) if len(owners) == 1 else 0
        specs[owner].params.append((p, refs, fqn))
    return specs
