"""Issue 41 item 8: the optimizer state dicts of a wrapped run and of plain torch could not resume each other (a
raw shape error at torch's next step, or in load_state_dict). Now opt.full_state_dict() is torch.optim.AdamW's
state dict of the whole run (moments in each parameter's shape), a wrapped optimizer loads torch's (each rank its
pieces), and a state of another shape is refused naming the parameter and both shapes, before anything is
written."""
import copy

import pytest
import torch

import offload

CFG = dict(params="cpu", optimizer="cpu", cpu_budget="64MiB", device_budget="64MiB")


def _model():
    torch.manual_seed(0)
    # 266 elements: on two ranks (shards of 256) the second Linear's weight is split between them
    return torch.nn.Sequential(torch.nn.Linear(8, 24), torch.nn.ReLU(), torch.nn.Linear(24, 2))


def _batch(i):
    g = torch.Generator().manual_seed(i)
    return torch.randn(4, 8, generator=g)


def _train(model, opt, steps, start=0):
    for i in range(start, start + steps):
        opt.zero_grad()
        model(_batch(i)).square().mean().backward()
        opt.step()


def test_a_wrapped_runs_full_state_dict_resumes_in_torch_and_torchs_resumes_wrapped():
    plain = _model()
    torch_opt = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    _train(plain, torch_opt, 2)
    with offload.init(offload.Config(**CFG)) as rt:
        wrapped = copy.deepcopy(plain)
        rt.wrap(wrapped)
        opt = offload.AdamW(wrapped.parameters(), lr=1e-2)
        opt.load_state_dict(torch_opt.state_dict())  # torch's: moments in each parameter's shape
        full = opt.full_state_dict()
        for i, st in torch_opt.state_dict()["state"].items():
            assert torch.equal(full["state"][i]["exp_avg"], st["exp_avg"])
            assert torch.equal(full["state"][i]["exp_avg_sq"], st["exp_avg_sq"])
            assert float(full["state"][i]["step"]) == float(st["step"])
        _train(wrapped, opt, 2, start=2)  # one more run goes on from the same moments as torch's
        _train(plain, torch_opt, 2, start=2)
        for (name, value), ref in zip(rt.full_state_dict(wrapped).items(), plain.state_dict().values()):
            torch.testing.assert_close(value, ref, rtol=1e-5, atol=1e-6, msg=name)
        back = opt.full_state_dict()
        weights = rt.full_state_dict(wrapped)
    # and the wrapped run's state goes on in torch
    resumed = _model()
    resumed.load_state_dict(weights)
    again = torch.optim.AdamW(resumed.parameters(), lr=1e-2)
    again.load_state_dict(back)
    _train(resumed, again, 1, start=4)
    _train(plain, torch_opt, 1, start=4)
    for a, b in zip(resumed.parameters(), plain.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_a_state_of_another_shape_is_refused_naming_the_parameter_and_shapes():
    other = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    torch_opt = torch.optim.AdamW(other.parameters(), lr=1e-2)
    _train(other, torch_opt, 1)
    with offload.init(offload.Config(**CFG)) as rt:
        model = _model()
        rt.wrap(model)
        opt = offload.AdamW(model.parameters(), lr=1e-2)
        _train(model, opt, 1)
        before = opt.full_state_dict()
        with pytest.raises(ValueError, match=r"offload.AdamW.load_state_dict: parameter 0.weight has shape \(24, 8\) "
                                             r"but the state dict's exp_avg has shape \(4, 8\)"):
            opt.load_state_dict(torch_opt.state_dict())
        after = opt.full_state_dict()
        for i, st in before["state"].items():  # nothing written
            assert torch.equal(after["state"][i]["exp_avg"], st["exp_avg"])


def test_two_ranks_give_and_take_torchs_whole_state(tmp_path):
    """On two ranks each holds its shard: full_state_dict() puts the pieces together (every rank gets the whole,
    equal to torch's), and torch's state dict loads into each rank's pieces."""
    import os
    import sys
    import textwrap

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from zero_common import run_rank_script

    code = textwrap.dedent(f"""
        import sys, torch
        sys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r})
        import offload
        from test_optimizer_state_interchange import CFG, _model, _train
        plain = _model()
        torch_opt = torch.optim.AdamW(plain.parameters(), lr=1e-2)
        _train(plain, torch_opt, 2)
        with offload.init(offload.Config(**CFG)) as rt:
            model = _model()
            rt.wrap(model)
            opt = offload.AdamW(model.parameters(), lr=1e-2)
            _train(model, opt, 1)
            opt.load_state_dict(torch_opt.state_dict())
            full = opt.full_state_dict()
            for i, st in torch_opt.state_dict()["state"].items():
                for n in ("exp_avg", "exp_avg_sq"):
                    assert torch.equal(full["state"][i][n], st[n]), (rt.rank, i, n)
            print("ok", rt.rank, flush=True)
    """)
    out = run_rank_script(code, tmp_path, nproc=2, timeout=300)
    assert out.stdout.count("ok") == 2, out.stdout
