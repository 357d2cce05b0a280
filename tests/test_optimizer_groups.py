"""Issue 41 item 5: AMSGrad (and a group's capturable / differentiable) was refused by offload.AdamW's constructor
but ran as plain AdamW, silently, when switched on after it: through add_param_group, by setting a group's key, or
by loading torch's AMSGrad state dict. Every offload optimizer now checks its groups at step() (and in the
backward, before an update runs there), refuses such a group in add_param_group and a state dict holding one
before loading it, naming the group and the key."""
import pytest
import torch

import offload


def _params(n=2):
    torch.manual_seed(0)
    return [torch.nn.Parameter(torch.randn(4, 3)) for _ in range(n)]


def _with_grads(params):
    for p in params:
        p.grad = torch.ones_like(p)
    return params


@pytest.mark.parametrize("family", ["AdamW", "AdamW8bit", "Lion"])
@pytest.mark.parametrize("key", ["amsgrad", "capturable", "differentiable"])
def test_a_switch_set_on_a_group_after_construction_is_refused_at_step(family, key):
    a, b = _with_grads(_params())
    opt = getattr(offload, family)([a])
    with pytest.raises(ValueError, match=rf"offload.{family}: param group 1 \(added\) has {key}=True"):
        opt.add_param_group({"params": [b], key: True})
    opt.param_groups[0][key] = True
    before = a.detach().clone()
    with pytest.raises(ValueError, match=rf"offload.{family}: param group 0 has {key}=True .*set {key}=False"):
        opt.step()
    assert torch.equal(a, before)  # nothing stepped
    opt.param_groups[0][key] = False
    opt.step()
    assert not torch.equal(a, before)


def test_torchs_amsgrad_state_dict_is_refused_before_it_loads():
    (a,) = _with_grads(_params(1))
    ref = torch.optim.AdamW([a], amsgrad=True)
    ref.step()
    opt = offload.AdamW([torch.nn.Parameter(a.detach().clone())])
    with pytest.raises(ValueError, match=r"offload.AdamW: param group 0 of the state dict has amsgrad=True"):
        opt.load_state_dict(ref.state_dict())
    assert opt.param_groups[0]["amsgrad"] is False and not opt.state


def test_the_sharded_optimizer_checks_its_groups_at_step_and_load(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    with offload.init(offload.Config(params="cpu", optimizer="cpu", cpu_budget="64MiB", device_budget="64MiB")) as rt:
        rt.wrap(model)
        opt = offload.AdamW(model.parameters(), lr=1e-2)
        model(torch.randn(4, 8)).sum().backward()
        opt.param_groups[0]["amsgrad"] = True
        with pytest.raises(ValueError, match=r"offload.AdamW: param group 0 has amsgrad=True"):
            opt.step()
        opt.param_groups[0]["amsgrad"] = False
        opt.step()
        sd = opt.state_dict()
        sd["param_groups"][0]["amsgrad"] = True
        with pytest.raises(ValueError, match=r"param group 0 of the state dict has amsgrad=True"):
            opt.load_state_dict(sd)
