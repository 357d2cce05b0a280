"""The flat layout of one unit: its parameters laid end to end in one padded buffer, cut into
world_size equal shards.

Slot = one distinct parameter (tied / shared parameters appear once, referenced by several
(module, name) pairs). Padding makes the total a multiple of world_size * ALIGN elements, so every shard
has the same length and starts on a 1 KiB boundary (fp32) for the vectorized optimizer kernels, and on a
quantization block of the 8-bit moments (ops/adam8bit.py: blocks anchored at each chunk, chunks a multiple of
a block): every block is then the same 256 elements at any world size, and a checkpoint resharded to
another one re-quantizes each block from exactly its own values, losing nothing.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn as nn

ALIGN = 256  # elements per shard boundary: one 8-bit quantization block (ops.adam8bit.BLOCK)


@dataclass
class Slot:
    index: int
    shape: torch.Size
    numel: int
    offset: int  # in the full flat buffer
    requires_grad: bool
    refs: list = field(default_factory=list)  # [(module, attribute name)] that hold this parameter
    fqn: str = ""  # first qualified name (for messages and state dicts)
    ordinal: int = 0  # position in model.parameters() (clip_grad_norm_ combines norms in this order)


@dataclass
class ShardPiece:
    """Where a slot meets this rank's shard: shard[lo:hi] holds slot elements [param_lo, param_lo + hi - lo)."""

    slot: int
    lo: int
    hi: int
    param_lo: int


class FlatLayout:
    def __init__(self, params: list[tuple[nn.Parameter, list, str]], world_size: int):
        """params: [(parameter, [(module, name), ...], qualified name)] in layout order."""
        self.slots: list[Slot] = []
        offset = 0
        for i, (p, refs, fqn) in enumerate(params):
            n = p.numel()
            self.slots.append(Slot(i, p.shape, n, offset, p.requires_grad, list(refs), fqn))
            offset += n
        self.numel = offset
        self.world_size = world_size
        quantum = world_size * ALIGN
        self.padded_numel = max(quantum, -(-offset // quantum) * quantum)
        self.shard_numel = self.padded_numel // world_size
        self._pieces: dict[int, tuple[ShardPiece, ...]] = {}  # rank -> pieces(rank): asked a few times a unit a step

    def shard_bounds(self, rank: int) -> tuple[int, int]:
        return rank * self.shard_numel, (rank + 1) * self.shard_numel

    def pieces(self, rank: int) -> tuple[ShardPiece, ...]:
        """The slots that overlap this rank's shard, in order, with shard-local ranges (the slots are fixed once
        laid out: computed once a rank)."""
        got = self._pieces.get(rank)
        if got is None:
            lo, hi = self.shard_bounds(rank)
            out = []
            for s in self.slots:
                a, b = max(lo, s.offset), min(hi, s.offset + s.numel)
                if a < b:
                    out.append(ShardPiece(s.index, a - lo, b - lo, a - s.offset))
            got = self._pieces[rank] = tuple(out)
        return got

    @property
    def trainable(self) -> bool:
        return any(s.requires_grad for s in self.slots)

    def flatten(self, tensors: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        """The full padded flat buffer from one tensor per slot, on their device (the host when there are none)."""
        device = tensors[0].device if tensors else torch.device("cpu")
        flat = torch.zeros(self.padded_numel, dtype=dtype, device=device)
        for s, t in zip(self.slots, tensors):
            flat[s.offset:s.offset + s.numel].copy_(t.detach().reshape(-1))
        return flat
