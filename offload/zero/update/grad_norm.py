"""The per-parameter gradient norms of this rank's shards, for rt.clip_grad_norm_.

Per-parameter norms first, then the norm of those (as torch.nn.utils.clip_grad_norm_ does), so one rank
reproduces torch bit for bit: a parameter whose shard range spans two gradient chunks is joined into one
contiguous copy before its norm is taken. Ranks then combine their partial sums (runtime.py).
When a unit's stored gradient is one reduce's output, the reduce took the L2 norms from the shard it stored
(ShardedUnit.grad_norms), where the last step asked for a norm too (UnitContext.take_grad_norms): nothing is read
back. Otherwise (accumulated by several reduces, partly zeroed, another norm type, the first clip of a run that did
not clip before) the gradient chunks are read here.
"""
from __future__ import annotations

import torch

from ...store import LeaseMode
from ..units.piece_norms import PieceNorms
from ..shards import StateKind
from ..state_store import Use


def local_norms(units, rank: int, norm_type: float) -> list[torch.Tensor]:
    """Norms of every gradient-carrying parameter piece in this rank's shards, in model.parameters() order."""
    found = []
    for unit in units:
        if not unit.has_grad:
            continue
        unit.wait_grads()  # the reduces into these chunks must be over
        pieces = [p for p in unit.layout.pieces(rank) if unit.layout.slots[p.slot].requires_grad]
        if not pieces:
            continue
        if norm_type == 2 and unit.grad_norms is not None:  # taken by the reduce from the bytes it stored
            found += [(unit.layout.slots[p.slot].ordinal, unit.grad_norms[p.slot]) for p in pieces]
            continue
        chunks = unit.shards.chunks
        leases = {}

        def lease(i):
            if i < len(chunks) and i not in leases:
                leases[i] = unit.ctx.states.lease(unit.shards.spec(StateKind.GRAD, chunks[i]), Use.HOST,
                                                  LeaseMode.READ)
            return leases.get(i)

        norms = PieceNorms(pieces, norm_type)
        for i, c in enumerate(chunks):
            lease(i + 1)  # read the next chunk while this one is summed
            norms.feed(c, lease(i).wait())
            leases.pop(i).release()
        for held in leases.values():
            held.release()
        found += [(unit.layout.slots[slot].ordinal, n) for slot, n in norms.done.items()]
    return _on_host([n for _, n in sorted(found, key=lambda x: x[0])])  # model.parameters() order, as torch


def _on_host(norms: list[torch.Tensor]) -> list[torch.Tensor]:
    """The norms as host tensors. Those the reduce took on the device (device-tier gradients) come down in one
    copy, not one per parameter (each a sync of the training thread on a GPU); their values are unchanged."""
    on_device = [i for i, n in enumerate(norms) if n.device.type != "cpu"]
    if not on_device:
        return norms
    host = torch.stack([norms[i] for i in on_device]).cpu()  # final already: the reduce's drain synced them
    out = list(norms)
    for k, i in enumerate(on_device):
        out[i] = host[k]
    return out
