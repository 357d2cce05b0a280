"""offload.AdamW as a drop-in torch.optim.Optimizer: parity with torch.optim.AdamW, low-precision
params through the fp32 master, state_dict round trips, LR schedulers, bf16 moments."""
from __future__ import annotations

import copy
import io
import textwrap

import pytest
import torch

import offload
from offload import _ext
from _fallback import run_without_extension
from offload.optim import step_flat

RTOL = 1e-5  # and an absolute floor of 1e-5 * lr: see tests/test_adam_kernel.py


def _mlp(dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 33), torch.nn.Tanh(), torch.nn.Linear(33, 7)).to(dtype)


def _data(seed=1):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(64, 16, generator=gen), torch.randn(64, 7, generator=gen)


def _train(model, opt, steps, x, y, sched=None):
    dtype = next(model.parameters()).dtype
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = ((model(x.to(dtype)).float() - y) ** 2).mean()
        loss.backward()
        opt.step()
        if sched is not None:
            sched.step()
        losses.append(loss.item())
    return losses


def _groups(model, lr):
    # Two groups with different hyperparameters (weight decay off on biases, as usual).
    weights = [p for n, p in model.named_parameters() if n.endswith("weight")]
    biases = [p for n, p in model.named_parameters() if n.endswith("bias")]
    return [dict(params=weights), dict(params=biases, weight_decay=0.0, betas=(0.8, 0.95), lr=lr * 2)]


def _close(a, b, lr):
    torch.testing.assert_close(a, b, rtol=RTOL, atol=lr * 1e-5)


def test_defaults_match_torch():
    p = torch.nn.Parameter(torch.zeros(3))
    ours, theirs = offload.AdamW([p]).defaults, torch.optim.AdamW([p]).defaults
    for k in ("lr", "betas", "eps", "weight_decay", "maximize"):
        assert ours[k] == theirs[k], k
    assert ours["moments_dtype"] == torch.float32


def _fixed_grads(model, steps, seed=2):
    # The same grad sequence for both optimizers: compares the optimizers, not the (chaotic) feedback
    # of 1-ulp differences through a model's forward and backward.
    gen = torch.Generator().manual_seed(seed)
    return [[torch.randn(p.shape, generator=gen) for p in model.parameters()] for _ in range(steps)]


def _apply(model, opt, grads, sched=None):
    for step_grads in grads:
        for p, g in zip(model.parameters(), step_grads):
            p.grad = g.to(p.dtype)
        opt.step()
        if sched is not None:
            sched.step()


@pytest.mark.parametrize("maximize", [False, True])
def test_fp32_params_match_torch_adamw_over_20_steps(maximize):
    ours_model, ref_model = _mlp(), _mlp()
    ours = offload.AdamW(_groups(ours_model, 1e-2), lr=1e-2, weight_decay=0.1, maximize=maximize)
    ref = torch.optim.AdamW(_groups(ref_model, 1e-2), lr=1e-2, weight_decay=0.1, maximize=maximize)
    grads = _fixed_grads(ours_model, 20)
    _apply(ours_model, ours, grads)
    _apply(ref_model, ref, grads)
    for a, b in zip(ours_model.parameters(), ref_model.parameters()):
        _close(a, b, 2e-2)
        sa, sb = ours.state[a], ref.state[b]
        assert set(sa) == {"step", "exp_avg", "exp_avg_sq"} and sa["step"].item() == 20
        _close(sa["exp_avg"], sb["exp_avg"], 0)
        _close(sa["exp_avg_sq"], sb["exp_avg_sq"], 0)
    # And it trains a model like torch does (here feedback through the model is part of the loop).
    x, y = _data()
    m1, m2 = _mlp(), _mlp()
    l1 = _train(m1, offload.AdamW(m1.parameters(), lr=1e-2), 20, x, y)
    l2 = _train(m2, torch.optim.AdamW(m2.parameters(), lr=1e-2), 20, x, y)
    assert l1[-1] < 0.9 * l1[0]
    torch.testing.assert_close(torch.tensor(l1), torch.tensor(l2), rtol=1e-4, atol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_low_precision_params_step_an_fp32_master(dtype):
    # Reference: torch.optim.AdamW on an fp32 copy fed the same (upcast) low-precision grads.
    x, y = _data()
    model = _mlp(dtype)
    ref_params = [p.detach().float().clone().requires_grad_(True) for p in model.parameters()]
    ours = offload.AdamW(model.parameters(), lr=1e-2, weight_decay=0.05)
    ref = torch.optim.AdamW(ref_params, lr=1e-2, weight_decay=0.05)
    for _ in range(20):
        ours.zero_grad()
        ((model(x.to(dtype)).float() - y) ** 2).mean().backward()
        for p, r in zip(model.parameters(), ref_params):
            r.grad = p.grad.float()
        ours.step()
        ref.step()
        for p, r in zip(model.parameters(), ref_params):
            master = ours.state[p]["master"]
            assert master.dtype == torch.float32
            _close(master.view(p.shape), r.detach(), 1e-2)
            # The param the model uses is its master rounded to nearest-even, written in the same pass.
            assert torch.equal(p.detach().view(torch.int16), master.view(p.shape).to(dtype).view(torch.int16))


def _roundtrip(opt_factory, dtype, moments_dtype):
    x, y = _data()
    model = _mlp(dtype)
    opt = opt_factory(model.parameters(), moments_dtype)
    _train(model, opt, 5, x, y)
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
    # Resume in a fresh model/optimizer from the bytes, then both run 5 more identical steps.
    buf.seek(0)
    ckpt = torch.load(buf, weights_only=True)
    model2 = _mlp(dtype, seed=123)
    model2.load_state_dict(ckpt["model"])
    opt2 = opt_factory(model2.parameters(), moments_dtype)
    opt2.load_state_dict(ckpt["opt"])
    for p in model2.parameters():
        st = opt2.state[p]
        assert st["exp_avg"].dtype == moments_dtype and st["exp_avg_sq"].dtype == moments_dtype
        if dtype != torch.float32:
            assert st["master"].dtype == torch.float32
    _train(model, opt, 5, x, y)
    _train(model2, opt2, 5, x, y)
    for a, b in zip(model.parameters(), model2.parameters()):
        assert torch.equal(a, b)
    for a, b in zip(model.parameters(), model2.parameters()):
        for key in opt.state[a]:
            assert torch.equal(opt.state[a][key], opt2.state[b][key]), key


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("moments_dtype", [torch.float32, torch.bfloat16], ids=str)
def test_state_dict_round_trip_resumes_identically(dtype, moments_dtype):
    _roundtrip(lambda params, mdt: offload.AdamW(params, lr=1e-2, moments_dtype=mdt), dtype, moments_dtype)


def test_state_dict_loads_into_and_from_torch_adamw():
    # fp32 state uses torch's keys and layout: a torch.optim.AdamW checkpoint resumes in offload.AdamW.
    a, b = _mlp(), _mlp()
    ta, tb = torch.optim.AdamW(a.parameters(), lr=1e-2), torch.optim.AdamW(b.parameters(), lr=1e-2)
    grads = _fixed_grads(a, 6)
    _apply(a, ta, grads[:3])
    _apply(b, tb, grads[:3])
    ours = offload.AdamW(b.parameters(), lr=1e-2)
    ours.load_state_dict(ta.state_dict())
    _apply(a, ta, grads[3:])
    _apply(b, ours, grads[3:])
    back = torch.optim.AdamW(b.parameters(), lr=1e-2)
    back.load_state_dict(ours.state_dict())
    assert back.state[b[0].weight]["step"].item() == 6
    for p, q in zip(a.parameters(), b.parameters()):
        _close(q, p, 1e-2)


def test_lr_scheduler_changes_the_step_lr():
    x, y = _data()
    ours_model, ref_model = _mlp(), _mlp()
    ours = offload.AdamW(ours_model.parameters(), lr=1e-2)
    ref = torch.optim.AdamW(ref_model.parameters(), lr=1e-2)
    s1 = torch.optim.lr_scheduler.StepLR(ours, step_size=2, gamma=0.1)
    s2 = torch.optim.lr_scheduler.StepLR(ref, step_size=2, gamma=0.1)
    grads = _fixed_grads(ours_model, 6)
    _apply(ours_model, ours, grads, s1)
    _apply(ref_model, ref, grads, s2)
    assert ours.param_groups[0]["lr"] == pytest.approx(1e-5)
    for a, b in zip(ours_model.parameters(), ref_model.parameters()):
        _close(a, b, 1e-2)
    # A schedule that drops lr to 0 after the first step freezes the params from then on.
    model = _mlp()
    opt = offload.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda epoch: 1.0 if epoch == 0 else 0.0)
    _train(model, opt, 1, x, y, sched)
    frozen = [p.detach().clone() for p in model.parameters()]
    _train(model, opt, 3, x, y, sched)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), frozen))
    assert opt.state[model[0].weight]["step"].item() == 4


def test_bf16_moments_loss_curve_stays_within_tolerance_of_fp32():
    # 2-layer MLP regression, 200 full-batch steps. Stated tolerance: every point of the bf16-moment
    # loss curve within 3% (relative) of the fp32-moment curve, the final loss within 2%.
    # Measured here: max deviation 0.8%, final 0.3%.
    def curve(moments_dtype):
        torch.manual_seed(1)
        x = torch.randn(2048, 16)
        y = torch.sin(3 * (x @ (torch.randn(16, 1) / 4))) + 0.1 * torch.randn(2048, 1)
        model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
        opt = offload.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01, moments_dtype=moments_dtype)
        return torch.tensor(_train(model, opt, 200, x, y))

    fp32, bf16 = curve(torch.float32), curve(torch.bfloat16)
    assert fp32[-1] < fp32[0] / 5  # it actually learns
    assert ((bf16 - fp32).abs() / fp32).max() < 0.03
    assert abs(bf16[-1] - fp32[-1]) / fp32[-1] < 0.02


def test_step_flat_is_the_per_buffer_update():
    # What a sharded optimizer calls on a flat shard: same result as the class on the same numbers.
    gen = torch.Generator().manual_seed(0)
    p = torch.nn.Parameter(torch.randn(1000, generator=gen).to(torch.bfloat16))
    grad = torch.randn(1000, generator=gen).to(torch.bfloat16)
    opt = offload.AdamW([p], lr=1e-2, weight_decay=0.1)
    master, m, v = p.detach().float(), torch.zeros(1000), torch.zeros(1000)
    out = torch.empty(1000, dtype=torch.bfloat16)
    for step in (1, 2, 3):
        p.grad = grad.clone()
        opt.step()
        step_flat(master, grad, m, v, out, opt.param_groups[0], step)
    assert torch.equal(master, opt.state[p]["master"]) and torch.equal(out, p.detach())


def test_closure_and_params_without_grad():
    model = _mlp()
    opt = offload.AdamW(model.parameters())
    x, y = _data()
    loss = opt.step(lambda: ((model(x) - y) ** 2).mean().backward() or torch.tensor(1.5))
    assert float(loss) == 1.5
    frozen = torch.nn.Parameter(torch.ones(4))
    opt.add_param_group(dict(params=[frozen]))
    opt.step()  # no grad on `frozen`: untouched, no state
    assert torch.equal(frozen, torch.ones(4)) and len(opt.state[frozen]) == 0


def test_unsupported_configurations_raise():
    p = torch.nn.Parameter(torch.zeros(3))
    with pytest.raises(ValueError, match="amsgrad"):
        offload.AdamW([p], amsgrad=True)
    with pytest.raises(ValueError, match="capturable"):
        offload.AdamW([p], capturable=True)
    offload.AdamW([p], foreach=True, fused=True)  # accepted for drop-in use: always one fused pass
    with pytest.raises(ValueError, match="moments_dtype"):
        offload.AdamW([p], moments_dtype=torch.float16)
    with pytest.raises(ValueError, match="lr"):
        offload.AdamW([p], lr=-1.0)
    with pytest.raises(ValueError, match="meta"):
        offload.AdamW([torch.nn.Parameter(torch.zeros(3, device="meta"))])
    with pytest.raises(ValueError, match="dtype"):
        offload.AdamW([torch.nn.Parameter(torch.zeros(3, dtype=torch.float64))])


def test_fallback_optimizer_without_extension_matches_torch():
    script = textwrap.dedent(
        """
        import warnings, torch, offload
        warnings.simplefilter("ignore")
        torch.manual_seed(0)
        a = torch.nn.Linear(8, 4); b = torch.nn.Linear(8, 4); b.load_state_dict(a.state_dict())
        oa, ob = offload.AdamW(a.parameters(), lr=1e-2), torch.optim.AdamW(b.parameters(), lr=1e-2)
        x = torch.randn(16, 8)
        for _ in range(20):
            for m, o in ((a, oa), (b, ob)):
                o.zero_grad(); m(x).square().mean().backward(); o.step()
        from offload import _ext
        assert _ext.get() is None
        assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
        print("ok")
        """
    )
    run_without_extension(script)


@pytest.mark.skipif(_ext.get() is None, reason="C++ extension unavailable")
def test_optimizer_state_is_twelve_or_eight_bytes_per_param():
    model = _mlp()
    n = sum(p.numel() for p in model.parameters())
    x, y = _data()
    for mdt, per_param in ((torch.float32, 8), (torch.bfloat16, 4)):
        m = copy.deepcopy(model)
        opt = offload.AdamW(m.parameters(), moments_dtype=mdt)
        _train(m, opt, 1, x, y)
        moments = sum(t.numel() * t.element_size() for s in opt.state.values()
                      for k, t in s.items() if k.startswith("exp_avg"))
        assert moments == per_param * n
