"""What an optimizer keeps per parameter, declared once.

An optimizer family is a `Schema`: the states it stores (each a dtype and a shape rule), how each state reads
as per-element fp32 values (state dicts and checkpoints), and the function that updates one chunk. The
runtime's shards, the optimizer pipeline, the placement, checkpoints, state dicts, `offload plan` and the
budgets iterate over the schema, so adding an optimizer is one file that declares one, registers it, and hands
its optimizer class (a SchemaOptimizer, optim/base.py) to the runtime (tests/test_optimizer_families.py does):

    SGDM = register(Schema("sgdm", (StoredState("momentum_buffer", torch.float32),), _sgdm_chunk))
    class SGDMomentum(SchemaOptimizer): schema = SGDM; ...
    offload.zero.update.optimizer.register_family(SGDMomentum)

Shape rules: `per` elements of the shard share one stored value. 1 is a value per element (Adam's moments);
256 is a value per block of 256 (the absmax scale of a block-quantized moment). Blocks are anchored at the
start of each chunk the pipeline steps, so a chunk's states are self-contained.

`step_chunk(master, grad, states, out, lo, hi, hyper, step, grad_scale)` updates elements [lo, hi) of one
chunk in place: master fp32, grad fp32/bf16/fp16, `states` {name: the chunk's stored tensor}, `out` (None or
the compute-dtype param chunk to write), `hyper` the param group's values at opt.step(), `step` the count
after this update, `grad_scale` the clip/unscale coefficient (hyper's `maximize`, where the family has it, flips
its sign inside the step function).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch


@dataclass(frozen=True)
class StoredState:
    """One tensor an optimizer stores per chunk: `per` elements of the shard share one value of `dtype`;
    `fill` is its value before the first step (a zero moment's stored form)."""

    name: str
    dtype: torch.dtype
    per: int = 1
    fill: float = 0.0

    @property
    def value(self) -> str:
        """Names the state in shard keys and swap slots (as StateKind.value does)."""
        return self.name

    def numel(self, elements: int) -> int:
        """Stored values for `elements` elements of the shard."""
        return -(-elements // self.per)

    @property
    def bytes_per_element(self) -> float:
        return self.dtype.itemsize / self.per


@dataclass(frozen=True)
class LogicalState:
    """A per-element fp32 view of one or more stored states (state dicts, checkpoints): exp_avg of AdamW is
    its stored exp_avg; exp_avg of AdamW8bit is its codes times its block scales. unpack({name: chunk
    tensor}) -> fp32 values; pack(values, {name: chunk tensor}) writes them. None for both: the view is the
    single stored fp32 per-element state of the same name."""

    name: str
    stored: tuple[str, ...]
    unpack: Callable | None = None
    pack: Callable | None = None

    @property
    def identity(self) -> bool:
        return self.unpack is None


@dataclass(frozen=True)
class Schema:
    name: str
    states: tuple[StoredState, ...]
    step_chunk: Callable
    logical: tuple[LogicalState, ...] = ()  # default: one identity view per stored state
    # What its step costs the host, for `offload plan`: bytes of memory traffic per element (the gradient read
    # included; the fused fp32 AdamW: 28), and, where compute rather than memory bounds it, the elements one
    # core steps per second (None: memory-bound like the fp32 kernel)
    update_bytes: float = 28.0
    update_core_rate: float | None = None

    def __post_init__(self):
        if not self.logical:
            object.__setattr__(self, "logical", tuple(LogicalState(s.name, (s.name,)) for s in self.states))
        names = {s.name for s in self.states}
        for view in self.logical:
            missing = [n for n in view.stored if n not in names]
            if missing or (view.identity and (len(view.stored) != 1 or self.state(view.stored[0]).per != 1
                                              or self.state(view.stored[0]).dtype != torch.float32)):
                raise ValueError(f"optimizer schema {self.name!r}: logical state {view.name!r} needs unpack/pack "
                                 f"(stored as {view.stored}, unknown: {missing})")

    def state(self, name: str) -> StoredState:
        for s in self.states:
            if s.name == name:
                return s
        raise KeyError(f"optimizer schema {self.name!r} has no state {name!r}")

    def view(self, name: str) -> LogicalState:
        for v in self.logical:
            if v.name == name:
                return v
        raise KeyError(f"optimizer schema {self.name!r} has no logical state {name!r}")

    @property
    def bytes_per_element(self) -> float:
        """Bytes of optimizer state per parameter element, besides the fp32 master."""
        return sum(s.bytes_per_element for s in self.states)

    def fill_(self, states: dict) -> None:
        """Set a chunk's stored states to their value before the first step."""
        for s in self.states:
            states[s.name].fill_(s.fill)

    def fill_range_(self, states: dict, lo: int, hi: int) -> None:
        """The same for a chunk's elements [lo, hi) only: per-element states over the range, shared ones (a block's
        scale) where their whole block lies inside it (a block's other elements keep the values they stand for)."""
        n = next(states[s.name].numel() for s in self.states if s.per == 1)  # the chunk's elements
        for s in self.states:
            first = -(-lo // s.per)
            last = -(-hi // s.per) if hi == n else hi // s.per  # (the chunk's last block may be short)
            if first < last:
                states[s.name][first:last].fill_(s.fill)


# Filled by each family's module as it is imported; the package (offload/optim/__init__.py) imports the built-in
# ones, so any import of this module has them registered (a package runs before its modules).
_REGISTRY: dict[str, Schema] = {}


def register(schema: Schema) -> Schema:
    """Make `schema` known by name (Config.optimizer_states, checkpoints, `offload plan`)."""
    known = _REGISTRY.get(schema.name)
    if known is not None and known != schema:
        raise ValueError(f"an optimizer schema named {schema.name!r} is already registered")
    _REGISTRY[schema.name] = schema
    return schema


def by_name(name: str, setting: str = "optimizer_states") -> Schema:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"{setting}={name!r}: unknown optimizer state schema; known: "
                         f"{', '.join(sorted(_REGISTRY))}") from None


def names() -> list[str]:
    return sorted(_REGISTRY)
