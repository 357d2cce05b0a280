"""The L2 (or other) norm of each parameter piece of a unit's gradient shard, from its chunks as they pass: what
rt.clip_grad_norm_ sums (update/grad_norm.py), taken by the reduce from the bytes it stores (unit.py) or by a
read-back, the same way in both, so their norms agree bit for bit."""
from __future__ import annotations

import torch


class PieceNorms:
    """Norms of shard pieces (layout.ShardPiece) from the gradient chunks fed in order: a piece inside one chunk
    is a view of it, one spanning chunks is joined into one contiguous copy first. The reduce (from the chunks
    it writes) and the read-back below both use it, so their norms agree bit for bit."""

    def __init__(self, pieces, norm_type: float = 2.0):
        self.pieces = pieces
        self.norm_type = norm_type
        self._parts: dict[int, list] = {}
        self.done: dict[int, torch.Tensor] = {}  # slot -> norm of its piece

    def feed(self, c, g: torch.Tensor) -> None:
        """Chunk c's fp32 gradient values (valid only during the call: spanning parts are copied)."""
        for p in self.pieces:
            a, b = max(p.lo, c.lo), min(p.hi, c.hi)
            if a >= b:
                continue
            inside = p.lo >= c.lo and p.hi <= c.hi
            self._parts.setdefault(p.slot, []).append(g[a - c.lo:b - c.lo] if inside else g[a - c.lo:b - c.lo].clone())
            if p.hi <= c.hi:  # the piece ends in this chunk
                got = self._parts.pop(p.slot)
                whole = got[0] if len(got) == 1 else torch.cat(got)
                self.done[p.slot] = torch.linalg.vector_norm(whole, self.norm_type)
