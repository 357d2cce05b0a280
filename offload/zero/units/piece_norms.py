"""The L2 (or other) norm of each parameter piece of a unit's gradient shard, from its chunks as they pass: what
rt.clip_grad_norm_ sums (update/grad_norm.py), taken by the reduce from the bytes it stores (unit.py) or by a
read-back, the same way in both, so their norms agree bit for bit."""
from __future__ import annotations

import torch


class PieceNorms:
    """Norms of shard pieces (layout.ShardPiece) from the gradient chunks fed in order: a piece inside one chunk
    is a view of it, one spanning chunks is copied part by part into one contiguous buffer of its own size (one
    copy of the piece at most: parts cloned and then concatenated held it twice, 8.4 GB for a 70B LM head). The
    reduce (from the chunks it writes) and the read-back below both use it, so their norms agree bit for bit."""

    def __init__(self, pieces, norm_type: float = 2.0):
        self.pieces = pieces
        self.norm_type = norm_type
        self._joined: dict[int, torch.Tensor] = {}  # slot -> the spanning piece's buffer, filled as chunks pass
        self.done: dict[int, torch.Tensor] = {}  # slot -> norm of its piece

    def feed(self, c, g: torch.Tensor) -> None:
        """Chunk c's fp32 gradient values (valid only during the call: spanning parts are copied)."""
        for p in self.pieces:
            a, b = max(p.lo, c.lo), min(p.hi, c.hi)
            if a >= b:
                continue
            if p.lo >= c.lo and p.hi <= c.hi:  # inside this chunk
                self.done[p.slot] = torch.linalg.vector_norm(g[a - c.lo:b - c.lo], self.norm_type)
                continue
            joined = self._joined.get(p.slot)
            if joined is None:
                joined = self._joined[p.slot] = torch.empty(p.hi - p.lo, dtype=g.dtype, device=g.device)
            joined[a - p.lo:b - p.lo].copy_(g[a - c.lo:b - c.lo])
            if p.hi <= c.hi:  # the piece ends in this chunk
                self.done[p.slot] = torch.linalg.vector_norm(self._joined.pop(p.slot), self.norm_type)
