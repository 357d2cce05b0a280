"""DistributedDataParallel over a wrapped model (issue 41, item 6): a custom Accelerate loop's
`accelerator.prepare(model)` on two processes died in DDP's __init__ ("Tensor.item() cannot be called on meta
tensors"). Now refused at once, in one line naming the recipe that works (the model left out of prepare); the
recipe itself is in docs/zero-runtime.md. A 1-rank gloo group: DDP's own checks run as on more ranks."""
import os
import sys
import textwrap

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import offload

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from zero_common import TinyTransformer, run_rank_script, small_config  # noqa: E402

DDP = torch.nn.parallel.DistributedDataParallel


@pytest.fixture
def one_rank_group(tmp_path):
    assert not dist.is_initialized()
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_ddp_over_a_wrapped_model_is_refused_naming_the_recipe(one_rank_group):
    original = DDP.__init__
    plain = nn.Linear(4, 4)  # (built before the block: a plain module)
    with offload.init(small_config(compute_dtype="fp32")) as rt:
        model = rt.wrap(TinyTransformer())
        with pytest.raises(RuntimeError) as refused:
            DDP(model)
        message = str(refused.value)
        assert "\n" not in message and "DistributedDataParallel over a wrapped model is refused" in message
        assert "leave it out of prepare" in message and "offload.AdamW(model.parameters())" in message
        assert "docs/zero-runtime.md" in message
        with pytest.raises(RuntimeError, match="over a wrapped model is refused"):
            DDP(model.layers[0])  # a submodule of it too
        built = TinyTransformer()  # built inside the block, not used yet: placeholders too
        with pytest.raises(RuntimeError, match="over a wrapped model is refused"):
            DDP(built)
        assert DDP(plain).module is plain  # other modules: DDP as before
    assert DDP.__init__ is original  # put back when the runtime closed



def test_the_documented_accelerate_loop_on_two_ranks_is_ddps(tmp_path):
    """docs/zero-runtime.md's custom Accelerate loop on 2 processes: `prepare(model)` refused at once; the model left
    out of prepare (the optimizer and the data prepared, accelerator.backward, accelerator.clip_grad_norm_) trains
    to plain DDP's weights with torch's AdamW and clip."""
    pytest.importorskip("accelerate")
    code = textwrap.dedent("""
        import copy
        import torch, torch.nn as nn, torch.nn.functional as F
        from torch.utils.data import DataLoader, TensorDataset
        from accelerate import Accelerator
        import offload

        torch.manual_seed(0)
        base = nn.Sequential(nn.Embedding(64, 32), nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64))
        ref = copy.deepcopy(base)
        data = TensorDataset(torch.randint(0, 64, (32, 8)))

        def loss_of(m, ids):
            return F.cross_entropy(m(ids).reshape(-1, 64), ids.reshape(-1))

        accelerator = Accelerator(cpu=True)
        assert accelerator.num_processes == 2
        ddp = torch.nn.parallel.DistributedDataParallel(ref)  # the reference: plain DDP
        ref_opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2, weight_decay=0.0)
        for (ids,) in accelerator.prepare(DataLoader(data, batch_size=4)):
            loss_of(ddp, ids).backward()
            torch.nn.utils.clip_grad_norm_(ddp.parameters(), 0.5)
            ref_opt.step(); ref_opt.zero_grad()
        with offload.init(offload.Config(params="cpu", optimizer="cpu", compute_dtype="fp32",
                                         cpu_budget="256MiB")) as rt:
            model = rt.wrap(base)
            try:
                accelerator.prepare(model)
                raise SystemExit("accelerator.prepare(model) was not refused")
            except RuntimeError as exc:
                assert "DistributedDataParallel over a wrapped model is refused" in str(exc), exc
            opt = offload.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
            opt, loader = accelerator.prepare(opt, DataLoader(data, batch_size=4))
            for (ids,) in loader:
                accelerator.backward(loss_of(model, ids))
                accelerator.clip_grad_norm_(model.parameters(), 0.5)
                opt.step(); opt.zero_grad()
            got = rt.full_state_dict(model)
        worst = max((got[n] - p.detach()).abs().max().item() for n, p in ref.named_parameters())
        print(f"WORST {accelerator.process_index} {worst:.3e}", flush=True)
        assert worst < 1e-5, worst
    """)
    out = run_rank_script(code, tmp_path)
    assert sorted(x.split()[1] for x in out.stdout.splitlines() if x.startswith("WORST ")) == ["0", "1"], out.stdout
