"""The runtime's work a unit a step does not grow with the unit count (issue 42 section 1: at most 0.3 ms of CPU a
unit a step over 80-160 units). The schedule's end-of-forward decision (keep a unit gathered for its backward, or
free it) scanned every unit to list the gathered ones, and copied the rest of the trace, at every unit's forward:
quadratic in the unit count."""
from __future__ import annotations

import torch
import torch.nn as nn

import offload
from offload.zero.units.unit import ShardedUnit


class Stack(nn.Module):
    def __init__(self, dim: int, layers: int):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(dim, dim) for _ in range(layers))

    def forward(self, x):
        for b in self.blocks:
            x = torch.tanh(b(x))
        return x


def test_a_forward_asks_a_few_units_a_unit_whether_they_are_gathered(monkeypatch):
    units = 48
    cfg = offload.Config(params="cpu", optimizer="cpu", cpu_budget="256MiB", device_budget="256MiB")
    x = torch.randn(2, 8, generator=torch.Generator().manual_seed(0))
    with offload.init(cfg) as rt:
        torch.manual_seed(0)
        model = Stack(8, units)
        opt = offload.AdamW(model.parameters(), lr=1e-3)
        for _ in range(2):  # the first step traces and plans; the second follows the plan
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
        rt.quiesce()
        asked = []
        fresh = ShardedUnit.fresh
        monkeypatch.setattr(ShardedUnit, "fresh", property(lambda u: asked.append(u) or fresh.fget(u)))
        model(x).square().mean().backward()  # the third step's forward and backward, following the plan
        monkeypatch.undo()
        opt.step()
        opt.zero_grad()
    assert len(asked) <= 8 * units, f"{len(asked)} reads of a unit's gathered state for {units} units"
