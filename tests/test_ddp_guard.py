"""DistributedDataParallel over a wrapped model (issue 41, item 6): a custom Accelerate loop's
`accelerator.prepare(model)` on two processes died in DDP's __init__ ("Tensor.item() cannot be called on meta
tensors"). Now refused at once, in one line naming the recipe that works (the model left out of prepare); the
recipe itself is in docs/zero-runtime.md. A 1-rank gloo group: DDP's own checks run as on more ranks."""
import os
import sys

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import offload

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from zero_common import TinyTransformer, small_config  # noqa: E402

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

