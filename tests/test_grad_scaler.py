"""offload.GradScaler (offload/zero/grad_scaler.py): torch.amp.GradScaler's scale rule and API over a runtime.

The parity grid (test_zero_parity.py, dtype "fp16") trains through it against torch's GradScaler on 1 and 2 ranks,
with steps that overflow; here: overflow forced at chosen steps (a skipped step changes no parameter and no
optimizer state; the scale follows torch's), two optimizers over one runtime, the state dict, and the misuses that
raise instead of training wrong.
"""
import math
import os
import sys
import textwrap

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from zero_common import VOCAB, compute_loss, make_model, param_groups, run_rank_script, small_config  # noqa: E402

import offload  # noqa: E402

OVERFLOW_AT = (1, 4, 5)  # steps whose loss is multiplied by inf: every gradient is inf or NaN


def _data(steps):
    return torch.randint(0, VOCAB, (steps, 2, 8), generator=torch.Generator().manual_seed(3))


def _fp16_reference(steps, **scaler_kw):
    """Plain PyTorch: an fp16 model, fp32 master params stepped by plain offload.AdamW through torch's GradScaler."""
    torch.manual_seed(7)
    model = make_model("tiny")
    master = {n: torch.nn.Parameter(p.detach().clone()) for n, p in model.named_parameters()}
    model = model.to(torch.float16)
    opt = offload.AdamW(param_groups(list(master.items())), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", **scaler_kw)
    data, scales, snaps = _data(steps), [], []
    for s in range(steps):
        loss = compute_loss(model, data[s], "tiny") * (math.inf if s in OVERFLOW_AT else 1.0)
        scaler.scale(loss).backward()
        for n, p in model.named_parameters():
            if p.grad is not None:  # (an unused branch gets none)
                master[n].grad = p.grad.float()
        model.zero_grad(set_to_none=True)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.copy_(master[n])
        scales.append(scaler.get_scale())
        snaps.append({n: m.detach().clone() for n, m in master.items()})
    return scales, snaps


def test_overflow_skips_the_step_and_the_scale_follows_torch(tmp_path):
    steps, kw = 8, dict(init_scale=2.0 ** 10, growth_interval=2)
    want_scales, want = _fp16_reference(steps, **kw)
    torch.manual_seed(7)
    model = make_model("tiny")
    cfg = small_config(params="nvme", optimizer="nvme", nvme_path=str(tmp_path), compute_dtype="fp16",
                       cpu_budget="128KiB")
    data, scales = _data(steps), []
    with offload.init(cfg) as rt:
        rt.wrap(model)
        opt = offload.AdamW(param_groups(model.named_parameters()), lr=1e-2)
        scaler = offload.GradScaler(**kw)
        before = rt.full_state_dict(model)
        for s in range(steps):
            loss = compute_loss(model, data[s], "tiny") * (math.inf if s in OVERFLOW_AT else 1.0)
            scaler.scale(loss).backward()
            assert scaler.step(opt) is None
            scaler.update()
            opt.zero_grad()
            scales.append(scaler.get_scale())
            last = rt.stats()["last_step"]  # a skipped step's own window, counted apart from the optimizer's steps
            assert last["skipped"] == (s in OVERFLOW_AT) and last["step"] == s + 1 - sum(k <= s for k in OVERFLOW_AT)
            now = rt.full_state_dict(model)
            if s in OVERFLOW_AT:  # skipped: nothing moved
                assert all(torch.equal(now[n], before[n]) for n in now), s
            else:
                assert any(not torch.equal(now[n], before[n]) for n in now), s
            for n, value in want[s].items():  # bit for bit the values of torch's loop, step by step
                assert torch.equal(now[n], value), (s, n)
            before = now
        stats = rt.stats()
    assert scales == want_scales  # halved at each overflow, doubled after 2 clean steps in a row
    assert stats["loss_scale"]["skipped_steps"] == len(OVERFLOW_AT)
    assert stats["steps"] == steps - len(OVERFLOW_AT)
    assert stats["plans_made"] == 1  # a skipped step leaves the plan as it was


def test_two_optimizers_skip_together(tmp_path):
    torch.manual_seed(7)
    model = make_model("tiny")
    with offload.init(small_config(compute_dtype="fp16")) as rt:
        rt.wrap(model)
        groups = param_groups(model.named_parameters())
        opts = [offload.AdamW([g], lr=1e-2) for g in groups]
        scaler = offload.GradScaler(init_scale=2.0 ** 8)
        data = _data(2)
        for s, factor in enumerate((math.inf, 1.0)):
            before = rt.full_state_dict(model)
            scaler.scale(compute_loss(model, data[s], "tiny") * factor).backward()
            for opt in opts:
                scaler.unscale_(opt)
            rt.clip_grad_norm_(1.0)
            for opt in opts:
                scaler.step(opt)
            scaler.update()
            for opt in opts:
                opt.zero_grad()
            moved = any(not torch.equal(v, before[n]) for n, v in rt.full_state_dict(model).items())
            assert moved == (factor == 1.0)
        assert rt.stats()["loss_scale"]["skipped_steps"] == 1  # once for the step, not once per optimizer
    assert scaler.get_scale() == 2.0 ** 7


def test_misuse_raises_instead_of_training_on_scaled_gradients():
    torch.manual_seed(7)
    model = make_model("tiny")
    with offload.init(small_config(compute_dtype="fp16")) as rt:
        rt.wrap(model)
        opt = offload.AdamW(param_groups(model.named_parameters()), lr=1e-2)
        scaler = offload.GradScaler()
        scaler.scale(compute_loss(model, _data(1)[0], "tiny")).backward()
        with pytest.raises(RuntimeError, match="unscale_"):
            rt.clip_grad_norm_(1.0)  # the norm would be S times too large
        with pytest.raises(RuntimeError, match=r"scaler\.step\(optimizer\)"):
            opt.step()  # the update would be S times too large
        assert not any(st.get("step", 0) for st in opt.state.values())  # the refused step counted nothing
        with pytest.raises(RuntimeError, match="no overflow check"):
            scaler.update()
        scaler.unscale_(opt)
        with pytest.raises(RuntimeError, match="already been called"):
            scaler.unscale_(opt)
        scaler.step(opt)
        with pytest.raises(RuntimeError, match="already been called"):
            scaler.step(opt)
        scaler.update()
        assert {int(st["step"]) for st in opt.state.values()} == {1}
        with pytest.raises(TypeError, match="not an offload optimizer"):
            scaler.step(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1))
    with pytest.raises(RuntimeError, match="has exited"):
        scaler.scale(torch.ones(()))  # its runtime's block is over
    with pytest.raises(RuntimeError, match="no offload runtime is open"):
        offload.GradScaler().scale(torch.ones(()))


def test_update_in_backward_is_refused():
    model = make_model("tiny")
    with offload.init(small_config(compute_dtype="fp16", update_in_backward=True)) as rt:
        rt.wrap(model)
        with pytest.raises(ValueError, match="update_in_backward=False"):
            offload.GradScaler().scale(torch.ones(()))


@pytest.mark.parametrize("kw, word", [(dict(init_scale=0.0), "init_scale"), (dict(growth_factor=1.0), "growth_factor"),
                                      (dict(backoff_factor=1.5), "backoff_factor"),
                                      (dict(growth_interval=0), "growth_interval")])
def test_bad_arguments_name_the_setting(kw, word):
    with pytest.raises(ValueError, match=word):
        offload.GradScaler(**kw)


def test_state_dict_round_trip_and_disabled_passthrough():
    a = offload.GradScaler(init_scale=2.0 ** 12, growth_interval=7)
    a._growth_tracker = 3  # (as after three clean steps)
    b = offload.GradScaler()
    b.load_state_dict(a.state_dict())
    assert b.state_dict() == a.state_dict() == {"scale": 4096.0, "growth_factor": 2.0, "backoff_factor": 0.5,
                                                "growth_interval": 7, "_growth_tracker": 3}
    assert set(a.state_dict()) == set(torch.amp.GradScaler("cpu").state_dict())  # torch's keys
    off = offload.GradScaler(enabled=False)
    loss = torch.ones(())
    assert off.scale(loss) is loss and off.get_scale() == 1.0 and off.state_dict() == {}


def test_an_overflow_in_one_ranks_shard_skips_the_step_on_both(tmp_path):
    """Rank 1 alone gives one parameter (the final norm's bias) an infinite gradient: after the reduce only the
    rank whose shard holds it sees the overflow. Both ranks skip (the check's all-reduce), nothing moves, and the
    next step trains on both."""
    code = textwrap.dedent(f"""
        import math, os, sys, torch
        sys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r})
        import offload
        from zero_common import VOCAB, compute_loss, make_model, param_groups, small_config
        rank = int(os.environ["RANK"])
        torch.manual_seed(7)
        model = make_model("tiny")
        data = torch.randint(0, VOCAB, (2, 2, 8), generator=torch.Generator().manual_seed(3 + rank))
        with offload.init(small_config(compute_dtype="fp16")) as rt:
            rt.wrap(model)
            opt = offload.AdamW(param_groups(model.named_parameters()), lr=1e-2)
            scaler = offload.GradScaler(init_scale=2.0 ** 8)
            moved = []
            for s in range(2):
                before = rt.full_state_dict(model)
                def poison(module, args, out):  # rank 1, step 0: the bias (zeros) enters times 1e30: the
                    if s == 0 and rank == 1:  # loss is the same, d(loss)/d(bias) 1e30 (inf in fp16), the rest finite
                        return out + (module.bias.float() * 1e30).sum()
                    return out
                hook = model.ln_f.register_forward_hook(poison)
                loss = compute_loss(model, data[s], "tiny")
                hook.remove()
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
                opt.zero_grad()
                after = rt.full_state_dict(model)
                moved.append(any(not torch.equal(after[n], before[n]) for n in after))
            stats = rt.stats()["loss_scale"]
        with open(os.path.join({str(tmp_path)!r}, f"rank{{rank}}.txt"), "w") as f:  # (stdouts interleave)
            f.write(f"{{stats['skipped_steps']}} {{stats['overflows_here']}} {{moved[0]}} {{moved[1]}} {{scaler.get_scale()}}")
    """)
    run_rank_script(code, tmp_path)
    got = [(tmp_path / f"rank{r}.txt").read_text().split() for r in range(2)]
    assert [g[0] for g in got] == ["1", "1"], got  # both skipped the step
    assert sorted(g[1] for g in got) == ["0", "1"], got  # one rank's shard held the overflow
    assert [g[2:4] for g in got] == [["False", "True"]] * 2, got  # nothing moved, then the next step trained
    assert [g[4] for g in got] == ["128.0", "128.0"], got  # the same scale on both


def test_fp16_without_a_scaler_warns_once(caplog):
    torch.manual_seed(7)
    model = make_model("tiny")
    with offload.init(small_config(compute_dtype="fp16")) as rt, caplog.at_level("WARNING", logger="offload"):
        rt.wrap(model)
        opt = offload.AdamW(param_groups(model.named_parameters()), lr=1e-2)
        for s in range(2):
            compute_loss(model, _data(2)[s], "tiny").backward()
            opt.step()
            opt.zero_grad()
    said = [r.getMessage() for r in caplog.records if "without a loss scaler" in r.getMessage()]
    assert len(said) == 1 and "offload.GradScaler" in said[0]


class _Wrapped:
    """An optimizer wrapper holding the real one as .optimizer (Accelerate's AcceleratedOptimizer does)."""

    def __init__(self, optimizer):
        self.optimizer = optimizer

    def step(self):
        self.optimizer.step()


def test_a_wrapped_optimizer_steps_and_another_runtimes_is_refused():
    torch.manual_seed(7)
    outer_model, inner_model = make_model("tiny"), make_model("tiny")
    with offload.init(small_config(compute_dtype="fp16")) as outer:
        outer.wrap(outer_model)
        outer_opt = offload.AdamW(param_groups(outer_model.named_parameters()), lr=1e-2)
        with offload.init(small_config(compute_dtype="fp16")) as inner:
            inner.wrap(inner_model)
            inner_opt = offload.AdamW(param_groups(inner_model.named_parameters()), lr=1e-2)
            scaler = offload.GradScaler(init_scale=2.0 ** 8)
            scaler.scale(compute_loss(inner_model, _data(1)[0], "tiny")).backward()
            scaler.step(_Wrapped(inner_opt))  # unwrapped: the offload optimizer inside steps
            assert {int(st["step"]) for st in inner_opt.state.values()} == {1}
            scaler.update()
            # the scaler serves the inner runtime: the outer one never learned its scale
            with pytest.raises(RuntimeError, match="another offload runtime"):
                scaler.step(outer_opt)
            with pytest.raises(TypeError, match="_Wrapped is not an offload optimizer"):
                scaler.step(_Wrapped(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)))


def test_a_loss_that_overflows_every_step_fails_loudly_before_the_scale_underflows():
    torch.manual_seed(7)
    model = make_model("tiny")
    with offload.init(small_config(compute_dtype="fp16")) as rt:
        rt.wrap(model)
        opt = offload.AdamW(param_groups(model.named_parameters()), lr=1e-2)
        scaler = offload.GradScaler(init_scale=2.0 ** -124)
        data = _data(3)
        for s in range(2):  # 2^-125, 2^-126: still normal
            scaler.scale(compute_loss(model, data[s], "tiny") * math.inf).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
        scaler.scale(compute_loss(model, data[2], "tiny") * math.inf).backward()
        scaler.step(opt)
        with pytest.raises(RuntimeError, match="inf or NaN whatever the scale"):
            scaler.update()
        assert rt.stats()["loss_scale"]["skipped_steps"] == 3 and rt.stats()["steps"] == 0
