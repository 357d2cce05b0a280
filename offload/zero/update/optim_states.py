"""A unit's optimizer states, as its family's schema (offload/optim/schema.py) declares them: created at the
unit's first step, and read or written whole as per-element fp32 views (state dicts, checkpoints). The
optimizer pipeline steps them chunk by chunk; this is the training thread's whole-shard access."""
from __future__ import annotations

import torch

from ...optim.schema import Schema
from ...store import LeaseMode
from ..state_store import Use


def register(unit, schema: Schema) -> bool:
    """Create `unit`'s states for `schema` (their first update fills them: nothing is read) if this is its first
    step; True if it was. A unit keeps one family: stepping it with another is refused."""
    have = unit.shards.schema
    if have is not None:
        if have is not schema:
            raise ValueError(
                f"{unit.label}: its optimizer states are {have.name!r} and an optimizer of family {schema.name!r} "
                "steps it now; one unit's parameters take one optimizer family (split them into other units, or "
                "use one optimizer class for them)")
        return False
    for s in schema.states:
        for c in unit.shards.chunks:
            unit.ctx.states.register(unit.shards.spec(s, c)).result()  # the first update leases them next
    unit.shards.schema = schema
    return True


def read_view(unit, name: str) -> torch.Tensor:
    """This rank's whole shard of the logical state `name` as fp32 (exp_avg of AdamW8bit: dequantized)."""
    out = torch.empty(unit.shards.shard_numel, dtype=torch.float32)
    for c in unit.shards.chunks:
        read_view_chunk(unit, name, c, out=out[c.lo:c.hi])
    return out


def read_view_chunk(unit, name: str, chunk, out: torch.Tensor | None = None) -> torch.Tensor:
    """One chunk of the logical state `name` as fp32: into `out`, or a new tensor (a checkpoint streams them)."""
    view = unit.shards.schema.view(name)
    leases = _lease(unit, view.stored, chunk, LeaseMode.READ)
    try:
        t = {n: lease.wait() for n, lease in leases.items()}
        values = t[name] if view.identity else view.unpack(t)
        if out is not None:
            return out.copy_(values)
        return values.clone() if view.identity else values  # (the lease's bytes go back below)
    finally:
        for lease in leases.values():
            lease.release()


def write_view(unit, name: str, values: torch.Tensor) -> None:
    """Write this rank's whole shard of the logical state `name` from fp32 `values` (quantized where stored so)."""
    view = unit.shards.schema.view(name)
    for c in unit.shards.chunks:
        leases = _lease(unit, view.stored, c, LeaseMode.OVERWRITE)
        try:
            t = {n: lease.wait() for n, lease in leases.items()}
            if view.identity:
                t[name].copy_(values[c.lo:c.hi])
            else:
                view.pack(values[c.lo:c.hi], t)
        finally:
            for lease in leases.values():
                lease.release().result()  # the caller steps or gathers the unit next


def reset(unit) -> None:
    """Every state back to its value before the first step (a checkpoint saved before the unit was stepped)."""
    schema = unit.shards.schema
    for c in unit.shards.chunks:
        leases = _lease(unit, [s.name for s in schema.states], c, LeaseMode.OVERWRITE)
        try:
            schema.fill_({n: lease.wait() for n, lease in leases.items()})
        finally:
            for lease in leases.values():
                lease.release().result()


def _lease(unit, names, chunk, mode: LeaseMode) -> dict:
    schema = unit.shards.schema
    return {n: unit.ctx.states.lease(unit.shards.spec(schema.state(n), chunk), Use.HOST, mode) for n in names}
