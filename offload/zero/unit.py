"""One sharded unit: a flat parameter gathered before the unit runs and freed after, its gradient
reduced into this rank's shard.

Bytes per unit and rank:
  home tiers  `u<i>.param` (shard, compute dtype), and when compute is bf16 `u<i>.master` (fp32 shard);
              `u<i>.exp_avg`, `u<i>.exp_avg_sq`, `u<i>.grad` (fp32 shards, optimizer tier; see optimizer.py)
  device      the full flat parameter, only while UNSHARDED (`flat`, storage resized to 0 otherwise);
              the unsharded fp32 gradient accumulator, only inside `rt.no_sync()`.
The modules always hold either views of `flat` (UNSHARDED) or meta placeholders (SHARDED / FREED).
"""
from __future__ import annotations

import torch
import torch.nn as nn

from ..config import format_size
from . import comm
from .layout import FlatLayout
from .state import ALLOWED, UnitState


def _alias(t: torch.Tensor) -> torch.Tensor:
    """A tensor over t's storage with its own version counter: writing the gathered bytes through it does
    not bump the version of the views autograd saved in forward (they see the new bytes, not a 'modified
    in place' error), the same trick as resizing storage under saved tensors."""
    return torch.empty(0, dtype=t.dtype, device=t.device).set_(t.untyped_storage(), 0, (t.numel(),), (1,))


class ShardedUnit:
    def __init__(self, rt, index: int, name: str, module: nn.Module, layout: FlatLayout):
        self.rt = rt
        self.index = index
        self.name = name
        self.module = module
        self.layout = layout
        self.state = UnitState.SHARDED
        self.persistent = False
        self.stale = False  # UNSHARDED copy older than the shard (the optimizer stepped since the gather)
        self.has_grad = False  # a gradient shard exists in storage (since the last zero_grad)
        self.local_grad: torch.Tensor | None = None  # unsharded fp32 accumulator inside rt.no_sync()
        self.used = torch.zeros(len(layout.slots), dtype=torch.bool)
        self.key = f"u{index}"
        dtype = rt.compute_dtype
        self.nbytes_full = layout.padded_numel * dtype.itemsize
        self.flat = torch.empty(layout.padded_numel, dtype=dtype, device=rt.device)
        self.flat.requires_grad_(layout.trainable)
        self.placeholders: list[nn.Parameter] = []
        self.views: list[torch.Tensor] = []
        with torch.enable_grad():  # views keep their autograd link to `flat` even when built under no_grad
            # One split for all slots: its backward concatenates the slots' grads into the flat grad in one
            # pass (per-slot slicing would materialize a zero-filled full-size grad for every parameter).
            sizes = [s.numel for s in layout.slots] + [layout.padded_numel - layout.numel]
            pieces = self.flat.split(sizes)
            frozen = self.flat.detach().split(sizes)
            for slot in layout.slots:
                base = pieces if slot.requires_grad else frozen
                view = base[slot.index].view(slot.shape)
                if slot.requires_grad:
                    view.register_hook(self._used_hook(slot.index))
                self.views.append(view)
        self.flat.untyped_storage().resize_(0)  # views exist; no bytes until the first gather
        if layout.trainable:
            self.flat.register_post_accumulate_grad_hook(self._on_grad)

    @property
    def label(self) -> str:
        return f"unit {self.index} ({self.name or '<root>'})"

    # ---- state transitions (the only writers of self.state) --------------------------------
    def _transition(self, to: UnitState) -> None:
        if (self.state, to) not in ALLOWED:
            raise RuntimeError(f"offload: {self.label}: illegal state change {self.state.name} -> {to.name}")
        self.state = to

    def check_alive(self) -> None:
        if self.state is UnitState.FREED:
            raise RuntimeError(
                f"offload: this model's {self.label} was sharded by an offload.init block that has exited, so its "
                "parameters are freed. Use the model inside the `with offload.init(...)` block, or save it there "
                "with rt.full_state_dict() first."
            )

    def check_requires_grad(self) -> None:
        """requires_grad is fixed when the unit is built (its flat buffer, views and gradient hooks follow it):
        a later change would be ignored silently, so it is refused, naming the parameter."""
        for slot, p, v in zip(self.layout.slots, self.placeholders, self.views):
            if p.requires_grad != slot.requires_grad or v.requires_grad != slot.requires_grad:
                raise RuntimeError(
                    f"offload: parameter {slot.fqn!r} ({self.label}) had requires_grad={slot.requires_grad} when "
                    f"the model was sharded and was changed to {not slot.requires_grad} afterwards, which the "
                    "runtime cannot follow. Set requires_grad before rt.wrap(model) (for a model built inside "
                    "offload.init: before its first forward or offload.AdamW), or rebuild the model."
                )

    def unshard(self) -> None:
        """Gather every rank's shard into the full flat parameter on the compute device; modules see views."""
        self.check_alive()
        self.check_requires_grad()
        if self.state is UnitState.UNSHARDED and not self.stale:
            return
        if self.state is UnitState.SHARDED:
            self.flat.untyped_storage().resize_(self.nbytes_full)
            self.rt._account_gathered(self.nbytes_full)
        shard = self.rt.storage.acquire(f"{self.key}.param", compute=True)
        comm.all_gather_into(self.rt.group, _alias(self.flat), shard)
        self.rt.storage.release(f"{self.key}.param", shard, compute=True)
        del shard
        self.rt.traffic["allgather"] += self.nbytes_full
        self.stale = False
        self._install(self.views)
        if self.state is UnitState.SHARDED:
            self._transition(UnitState.UNSHARDED)

    def reshard(self) -> None:
        """Free the full flat parameter (the shard in its home tier is the truth); modules see placeholders."""
        if self.state is not UnitState.UNSHARDED or self.persistent:
            return
        self._install(self.placeholders)
        self.flat.untyped_storage().resize_(0)
        self.rt._account_gathered(-self.nbytes_full)
        self._transition(UnitState.SHARDED)

    def free(self) -> None:
        """Leave the runtime: drop the flat buffer and accumulators; placeholders stay (meta, no bytes)."""
        if self.state is UnitState.FREED:
            return
        if self.state is UnitState.UNSHARDED:
            self._install(self.placeholders)
            self.flat.untyped_storage().resize_(0)
            self.rt._account_gathered(-self.nbytes_full)
        self.local_grad = None
        self._transition(UnitState.FREED)

    def _install(self, tensors: list[torch.Tensor]) -> None:
        for slot, t in zip(self.layout.slots, tensors):
            for module, attr in slot.refs:
                module._parameters[attr] = t

    # ---- gradients ------------------------------------------------------------------------
    def _used_hook(self, slot: int):
        def hook(grad):
            self.used[slot] = True
            return grad

        return hook

    def _on_grad(self, flat: torch.Tensor) -> None:
        """Autograd has finished accumulating this unit's flat gradient (once per backward, or once per
        inner backward with reentrant checkpointing): fold it into the local accumulator or reduce it."""
        grad, flat.grad = flat.grad, None
        if grad is None:
            return
        g32 = grad.float() if grad.dtype != torch.float32 else grad
        if not self.rt.sync_grads:
            if self.local_grad is None:
                self.local_grad = g32.clone() if g32 is grad else g32
            else:
                self.local_grad.add_(g32)
            return
        if self.local_grad is not None:
            g32 = self.local_grad.add_(g32)
            self.local_grad = None
        self.reduce(g32)

    def reduce(self, full_grad: torch.Tensor) -> None:
        """Mean over ranks of the full fp32 gradient, this rank's shard added into the stored grad shard."""
        shard = comm.reduce_scatter_mean(self.rt.group, full_grad)
        self.rt.traffic["reduce_scatter"] += full_grad.numel() * 4
        shard = shard.to("cpu")
        name = f"{self.key}.grad"
        storage = self.rt.storage
        if not storage.has(name):  # first gradient of this unit: its shard is created in the optimizer tier
            storage.create(name, self.rt.optimizer_tier, "grads", init=shard)
        else:
            acc = storage.acquire(name)
            if self.has_grad:
                acc.add_(shard)
            else:  # zero_grad ran since: overwrite
                acc.copy_(shard)
            storage.release(name, acc, dirty=True)
        self.has_grad = True

    def flush_local_grad(self) -> None:
        """Reduce what no_sync accumulated (called when a step needs gradients no backward has reduced)."""
        if self.local_grad is not None:
            g, self.local_grad = self.local_grad, None
            self.reduce(g)

    def zero_grad(self, slots=None, set_to_none: bool = True) -> None:
        """Clear the gradients of `slots` (slot indices; None: all). set_to_none (torch's default) makes them
        "no gradient": not stepped until a backward reaches them again. set_to_none=False keeps them as zero
        gradients, which torch.optim.AdamW still steps (decay and moment updates)."""
        frozen = {s.index for s in self.layout.slots if not s.requires_grad}  # never have a gradient
        if slots is None or len(set(slots) | frozen) == len(self.layout.slots):
            if set_to_none:
                self.has_grad = False  # the grad shard stays registered; the next reduce overwrites it
                self.local_grad = None
                self.used.zero_()
                return
            slots = range(len(self.layout.slots))
        slots = set(slots)
        if self.local_grad is not None:
            for s in slots:
                slot = self.layout.slots[s]
                self.local_grad[slot.offset:slot.offset + slot.numel].zero_()
        if self.has_grad:  # other slots keep their gradient: zero these ranges of the stored shard
            name = f"{self.key}.grad"
            g = self.rt.storage.acquire(name)
            for piece in self.layout.pieces(self.rt.rank):
                if piece.slot in slots:
                    g[piece.lo:piece.hi].zero_()
            self.rt.storage.release(name, g, dirty=True)
            del g
        if set_to_none:
            for s in slots:
                self.used[s] = False

    def describe(self) -> str:
        return f"{self.label}: {self.layout.numel} params, {format_size(self.nbytes_full)} gathered"
