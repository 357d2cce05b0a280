"""One record per unit's shards: what this rank keeps of a unit, in which tier, in which pieces.

A unit's shard (its `shard_numel` elements of the flat layout) is cut into chunks of at most
`Placement.chunk_numel` elements. Every state is stored per chunk, so the optimizer pipeline, the reads
ahead of a gather and the write-behind all move bounded, equal-sized pieces:

    PARAM       compute dtype; the gather's source. With fp32 compute it is also the master.
    MASTER      fp32 master copy (only when compute is bf16)
    GRAD        fp32 reduced gradient      registered at the unit's first reduce
    the optimizer's states                 registered at the unit's first optimizer step, as its family's
                                           schema declares them (offload/optim/schema.py: StoredState, e.g.
                                           AdamW's fp32 exp_avg and exp_avg_sq, AdamW8bit's codes and scales)

Keys are records (ShardKey), stable across runs: the unit id is its module's qualified name; the kind is a
StateKind or the schema's StoredState.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from ..optim.schema import Schema, StoredState
from ..store import Tier


class StateKind(enum.Enum):
    __hash__ = object.__hash__  # members are singletons: hashed by identity, in C (Enum's hashes its name in Python)
    PARAM = "param"
    MASTER = "master"
    GRAD = "grad"


@dataclass(frozen=True)
class ShardKey:
    unit: str  # the unit's stable id
    kind: StateKind | StoredState
    chunk: int
    spare: bool = False  # the slot a speculative update writes beside the shard's (update/speculation.py)

    def __str__(self) -> str:
        return f"{self.unit or '<root>'}/{self.kind.value}[{self.chunk}]" + ("~spare" if self.spare else "")


@dataclass(frozen=True)
class Chunk:
    index: int
    lo: int  # shard-local element range [lo, hi)
    hi: int

    @property
    def numel(self) -> int:
        return self.hi - self.lo


def chunk_bounds(shard_numel: int, chunk_numel: int) -> list[tuple[int, int]]:
    """[lo, hi) of each chunk of a shard of shard_numel elements cut every chunk_numel (one empty chunk for an
    empty shard)."""
    step = max(1, chunk_numel)
    return [(lo, min(lo + step, shard_numel)) for lo in range(0, shard_numel, step)] or [(0, 0)]


@dataclass(frozen=True)
class StateTiers:
    """Home tier of each state class (the placement's decision)."""

    params: Tier
    optimizer: Tier  # master and moments
    grads: Tier


# swap file per state class (one file per class and rank); the optimizer's own states go with the master
_TIER_CLASS = {StateKind.PARAM: "params", StateKind.MASTER: "optim", StateKind.GRAD: "grads"}


@dataclass(frozen=True)
class ShardSpec:
    key: ShardKey
    numel: int
    dtype: torch.dtype
    home: Tier
    tier_class: str

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    def spare(self) -> "ShardSpec":
        """The same shard's spare: a second nvme slot of its size, which a speculative update writes beside
        the shard's own (exchanged with it, update/speculation.py)."""
        return ShardSpec(ShardKey(self.key.unit, self.key.kind, self.key.chunk, spare=True), self.numel, self.dtype,
                         Tier.NVME, self.tier_class)


@dataclass
class UnitShards:
    uid: str
    shard_numel: int
    chunks: tuple[Chunk, ...]
    compute_dtype: torch.dtype
    tiers: StateTiers
    schema: Schema | None = None  # the optimizer family whose states were created at the unit's first step
    grads_registered: bool = False  # created at the unit's first reduce
    # (id(kind), chunk index) -> (kind, its ShardSpec): asked for several times a unit a step on every lane; one
    # record a shard, so the store's and the lanes' tables find their key by identity
    _specs: dict = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def build(cls, uid: str, shard_numel: int, chunk_numel: int, compute_dtype: torch.dtype,
              tiers: StateTiers) -> "UnitShards":
        chunks = tuple(Chunk(i, lo, hi) for i, (lo, hi) in enumerate(chunk_bounds(shard_numel, chunk_numel)))
        return cls(uid, shard_numel, chunks, compute_dtype, tiers)

    @property
    def master_is_param(self) -> bool:
        """fp32 compute: the param shard is the master the optimizer updates in place."""
        return self.compute_dtype == torch.float32

    @property
    def moments_registered(self) -> bool:
        """The optimizer's states exist (the unit has been stepped, or loaded from a checkpoint)."""
        return self.schema is not None

    def kinds(self) -> list:
        """Every state kind this unit has (the optimizer's once registered)."""
        out = [StateKind.PARAM] + ([] if self.master_is_param else [StateKind.MASTER])
        return out + list(self.schema.states if self.schema else ()) + [StateKind.GRAD]

    def spec(self, kind: StateKind | StoredState, chunk: Chunk | int) -> ShardSpec:
        index = chunk if isinstance(chunk, int) else chunk.index
        got = self._specs.get((id(kind), index))
        if got is None or got[0] is not kind:  # (the kind held beside it: an id is never another kind's)
            got = self._specs[(id(kind), index)] = (kind, self._new_spec(kind, self.chunks[index]))
        return got[1]

    def _new_spec(self, kind: StateKind | StoredState, c: Chunk) -> ShardSpec:
        key = ShardKey(self.uid, kind, c.index)
        if isinstance(kind, StoredState):
            return ShardSpec(key, kind.numel(c.numel), kind.dtype, self.tiers.optimizer, "optim")
        if kind is StateKind.MASTER and self.master_is_param:
            raise ValueError(f"unit {self.uid!r}: fp32 compute has no separate master (the param is the master)")
        dtype = self.compute_dtype if kind is StateKind.PARAM else torch.float32
        home = {StateKind.PARAM: self.tiers.params, StateKind.GRAD: self.tiers.grads}.get(kind, self.tiers.optimizer)
        return ShardSpec(key, c.numel, dtype, home, _TIER_CLASS[kind])

    def master_kind(self) -> StateKind:
        return StateKind.PARAM if self.master_is_param else StateKind.MASTER

    def chunks_over(self, lo: int, hi: int) -> list[tuple[Chunk, int, int]]:
        """(chunk, chunk-local lo, chunk-local hi) covering shard elements [lo, hi), in order."""
        out = []
        for c in self.chunks:
            a, b = max(lo, c.lo), min(hi, c.hi)
            if a < b:
                out.append((c, a - c.lo, b - c.lo))
        return out

    def nbytes(self, kind: StateKind) -> int:
        return sum(self.spec(kind, c).nbytes for c in self.chunks)
