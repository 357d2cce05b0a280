"""An "auto" device budget fitted after the first step (zero/device_budget_fit.py): once, by the rule of
store/budget.py fit_auto_device_budget applied to what the step measured, the same on every rank, and on a GPU
lowered below the start's budget when the first step's activations took the device's memory."""
from __future__ import annotations

import os
import sys
import textwrap

import pytest
import torch
import torch.nn as nn

import offload
from offload.store import AUTO_FRACTION
from offload.store.budget import fit_auto_device_budget
from offload.zero.device_budget_fit import DeviceBudgetFit

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from zero_common import run_rank_script, small_config  # noqa: E402


def mlp(layers: int = 3, width: int = 256) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(layers)])


def steps(model, rt, n: int, fits: list, width: int = 256, batch: int = 64) -> list[float]:
    """n AdamW steps; after each, what rt.stats() says of the fit and the device budget."""
    opt = offload.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(n):
        x = torch.randn(batch, width, generator=g).to(rt.device)
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        s = rt.stats()
        fits.append((s["memory"]["device_budget_fit"], s["budgets"]["device"]))
        losses.append(loss.item())
    return losses


def test_the_auto_device_budget_is_fitted_once_after_the_first_step_by_the_rule():
    model = mlp()
    with offload.init(small_config(device_budget="auto")) as rt:
        rt.wrap(model)
        assert rt.stats()["memory"]["device_budget_fit"] is None  # nothing measured before a step
        fits = []
        steps(model, rt, 3, fits)
        gathered_bound = rt.gathered_bound()
    fit, budget = fits[0]
    assert fits[1] == fits[2] == fits[0]  # once: later steps keep the first fit
    assert budget == fit["budget_after"] <= fit["budget_before"]
    assert fit["free_at_peak"] > 0 and 0 <= fit["tier_in_use"] <= fit["tier_peak"]
    assert 0 <= fit["gathered_later"] <= gathered_bound
    assert fit["budget_after"] == pytest.approx(  # the rule, to the page the tier rounds to
        fit_auto_device_budget(fit["budget_before"], fit["tier_in_use"], fit["tier_peak"],
                               fit["free_at_peak"] - fit["gathered_later"]), abs=4096)


def test_a_working_set_the_first_step_left_no_room_for_is_flagged():
    mib = 1 << 20
    roomy = DeviceBudgetFit(1000 * mib, 550 * mib, 600 * mib, 100 * mib, 300 * mib, gathered_later=100 * mib)
    tight = DeviceBudgetFit(1000 * mib, 300 * mib, 300 * mib, 100 * mib, 300 * mib, gathered_later=100 * mib)
    assert not roomy.short_of_working_set  # 100 + 0.9 x (600 - 100) = 550 >= 300
    assert tight.short_of_working_set  # 100 + 0.9 x (300 - 100) = 280 < 300: its floor set the limit


def test_a_device_left_full_by_the_first_step_holds_the_tier_to_its_working_set(monkeypatch, caplog):
    """The device as the first step left it, nearly full (its free-memory report, device_memory.free_at_peak, says
    1 MiB: the one thing not measured here): the tier's limit drops to its own peak in that step, a warning names
    the fixes, and the run trains on under it, bit for bit as with the budget given."""
    import offload.zero.device_budget_fit as fitting

    def run(device_budget):
        model = mlp()
        with offload.init(small_config(params="device", device_budget=device_budget)) as rt:
            rt.wrap(model)
            fits = []
            losses = steps(model, rt, 4, fits)
            weights = rt.full_state_dict(model)
            peak = rt.stats()["memory"]["budgets_peak_bytes"]["device"]
        return losses, weights, fits, peak

    given = run("64MiB")
    monkeypatch.setattr(fitting, "free_at_peak", lambda device: 1 << 20)
    with caplog.at_level("WARNING", logger="offload"):
        fitted = run("auto")
    fit, budget = fitted[2][0]
    assert 0 < fit["tier_peak"] == budget < fit["budget_before"], fit  # the floor: its own working set
    assert fitted[3] <= budget  # later steps kept within it
    assert any("next to no room" in r.getMessage() for r in caplog.records)
    assert fitted[0] == given[0] and all(torch.equal(fitted[1][k], given[1][k]) for k in given[1])


def test_a_device_budget_given_is_kept():
    model = mlp()
    with offload.init(small_config(device_budget="64MiB")) as rt:
        rt.wrap(model)
        fits = []
        steps(model, rt, 2, fits)
    assert fits == [(None, 64 << 20)] * 2


def test_two_ranks_fit_the_same_budget(tmp_path):
    """Each rank measures its own room; they take the smallest fit (placement and prefetch plan with the same
    numbers on every rank), and train on."""
    code = textwrap.dedent(f"""
        import os, sys, torch
        sys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r})
        import offload
        from offload.store.budget import fit_auto_device_budget
        from test_device_budget_fit import mlp, steps
        from zero_common import small_config
        rank = int(os.environ["RANK"])
        model = mlp()
        with offload.init(small_config(device_budget="auto")) as rt:
            rt.wrap(model)
            fits = []
            losses = steps(model, rt, 2, fits)
        fit, budget = fits[-1]
        own = fit_auto_device_budget(fit["budget_before"], fit["tier_in_use"], fit["tier_peak"],
                                     fit["free_at_peak"] - fit["gathered_later"])
        with open(os.path.join({str(tmp_path)!r}, f"rank{{rank}}.txt"), "w") as f:  # (stdouts interleave)
            f.write(f"{{budget}} {{own}} {{fit['budget_after']}} {{losses[-1]}}")
    """)
    run_rank_script(code, tmp_path)
    got = [(tmp_path / f"rank{r}.txt").read_text().split() for r in range(2)]
    budgets = {int(g[0]) for g in got}
    assert len(budgets) == 1, got  # one budget on both ranks
    budget = budgets.pop()
    assert all(budget == int(g[2]) <= int(g[1]) + 4096 for g in got), got  # the smaller rank's own fit (or less)
    assert all(float(g[3]) == float(g[3]) for g in got)  # trained on (a finite loss)


class HeavyForward(nn.Module):
    """A block whose forward keeps `nbytes` of the device saved for its backward: activations that take most
    of what the device had free when the runtime opened."""

    def __init__(self, width: int, nbytes: int):
        super().__init__()
        self.lin = nn.Linear(width, width)
        self.nbytes = nbytes

    def forward(self, x):
        y = self.lin(x)
        big = torch.ones(self.nbytes // 4, device=x.device)
        return y * big[: y.numel()].view_as(y)  # autograd saves the view: all of big stays until the backward


@pytest.mark.cuda
def test_on_the_gpu_activations_that_take_the_memory_lower_the_auto_budget(tmp_path):
    """The first step's forward holds all but about 2 GiB of what the GPU had free at open: the "auto" device
    budget (90% of that free memory) drops to what the tier held plus 90% of what the step left free, and the
    next steps train within it (the tier's peak over them under the fitted limit)."""
    dev = torch.device("cuda", torch.cuda.current_device())
    free, _ = torch.cuda.mem_get_info(dev)
    heavy = free - (2 << 30)
    width = 1024
    torch.manual_seed(0)
    model = nn.Sequential(HeavyForward(width, heavy), nn.Linear(width, width), nn.Linear(width, width))
    cfg = offload.Config(params="cpu", optimizer="cpu", cpu_budget="2GiB", device_budget="auto")
    with offload.init(cfg) as rt:
        rt.wrap(model)
        fits = []
        losses = steps(model, rt, 3, fits, width=width, batch=8)
        tier_peak_later = rt.stats()["memory"]["budgets_peak_bytes"]["device"]
    fit, budget = fits[0]
    from cuda_common import record_figure

    record_figure("device_budget_fit", free_at_open=free, heavy_forward=heavy, tier_peak_later=tier_peak_later, **fit)
    assert fit["budget_before"] >= AUTO_FRACTION["device_cuda"] * free * 0.95  # the start's "auto": ~90% free
    assert budget == fit["budget_after"] < fit["budget_before"] / 2, fit  # what the activations left
    assert fit["free_at_peak"] < 4 << 30, fit
    room = fit["free_at_peak"] - fit["gathered_later"]
    assert budget <= max(fit["tier_peak"], fit["tier_in_use"] + AUTO_FRACTION["device_cuda"] * room) + 512
    assert tier_peak_later <= max(budget, fit["tier_peak"]), (tier_peak_later, fit)
    assert all(loss == loss for loss in losses)
