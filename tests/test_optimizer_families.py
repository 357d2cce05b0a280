"""Optimizer families on the state schema: AdamW8bit and Lion sharded by the runtime, checkpoints and state dicts
of each schema, the placement's sizing, and a new family plugged in from this file alone.

The parity grid (test_zero_parity.py) runs AdamW8bit and Lion too (1 and 2 ranks, fp32 and bf16, accumulation,
slowed queues). This file holds what needs its own model: a layout where every parameter fills whole blocks of
256 elements, so the runtime's blocks (anchored at each chunk) are the in-memory optimizer's (anchored at each
parameter) and the sharded 8-bit step must equal the in-memory one bit for bit.
"""
import functools
import json
import os
import sys

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import offload
from offload.checkpoint import CheckpointError
from offload.optim.base import SchemaOptimizer
from offload.optim.schema import Schema, StoredState, by_name, names, register
from offload.zero.update.optimizer import register_family

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from zero_common import TinyTransformer, VOCAB, SEQ  # noqa: E402


def _aligned_model(seed: int = 0) -> nn.Module:
    """Every parameter a multiple of 256 elements (no biases): blocks coincide however it is cut."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, 128, bias=False), nn.GELU(), nn.Linear(128, 64, bias=False), nn.GELU(),
                         nn.Linear(64, 32, bias=False))


def _batches(n: int, seed: int = 3):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(8, 64, generator=g), torch.randn(8, 32, generator=g)) for _ in range(n)]


def _train(model, opt, batches, clip: float | None = None, rt=None):
    losses = []
    for x, y in batches:
        loss = F.mse_loss(model(x), y)
        loss.backward()
        if clip is not None:
            (rt.clip_grad_norm_(clip) if rt is not None else torch.nn.utils.clip_grad_norm_(model.parameters(), clip))
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _config(tmp_path, **kw):
    kw = {"params": "nvme", "optimizer": "nvme", "device_budget": "16MiB", "chunk_size": "8KiB",
          "cpu_budget": "256KiB", **kw}  # (a small cpu budget: little stays resident, states page through the disk)
    return offload.Config(nvme_path=str(tmp_path), **kw)


@pytest.mark.parametrize("cls", ["AdamW8bit", "Lion", "AdamW-bf16"])
@pytest.mark.parametrize("pipeline", [True, False])
def test_sharded_equals_in_memory_bitwise(cls, pipeline, tmp_path):
    """Chunks of 2048 elements, states on nvme, clipping: every loss and parameter bit for bit the in-memory
    optimizer's (the same kernel on the same blocks)."""
    Opt = getattr(offload, cls.split("-")[0])
    if cls == "AdamW-bf16":  # AdamW with bf16 moments
        Opt = functools.partial(offload.AdamW, moments_dtype=torch.bfloat16)
    ref = _aligned_model()
    batches = _batches(6)
    ref_losses = _train(ref, Opt(ref.parameters(), lr=3e-3, weight_decay=0.1), batches, clip=0.5)
    model = _aligned_model()
    with offload.init(_config(tmp_path, pipeline=pipeline, optimizer_states=cls.lower())) as rt:
        rt.wrap(model)
        opt = Opt(model.parameters(), lr=3e-3, weight_decay=0.1)
        assert type(opt).__name__ == f"Sharded{cls.split('-')[0]}"
        assert opt.schema.name == cls.lower()
        losses = _train(model, opt, batches, clip=0.5, rt=rt)
        got = rt.full_state_dict(model)
        assert max(len(u.shards.chunks) for u in rt.units) >= 4  # the 8192-element weight is cut in chunks
        assert rt.stats()["nvme_read_bytes"] > 0
    assert losses == ref_losses
    for name, p in ref.state_dict().items():
        assert torch.equal(got[name], p), name


@pytest.mark.parametrize("cls", ["AdamW", "AdamW8bit", "Lion"])
def test_a_new_optimizer_over_trained_parameters_starts_from_fresh_states(cls, tmp_path):
    """A second stage of training (a second Trainer on the same model, or any new optimizer): torch's new optimizer
    starts with empty state. The moments live in the runtime's units, not in the optimizer, so the new one's first
    step read the old one's moments with its own step count 1 (a wrong bias correction, losses apart from the
    second step on). Its first step of each element starts them at zero now: bit for bit the in-memory optimizer's."""
    Opt = getattr(offload, cls)
    ref = _aligned_model()
    batches = _batches(6)
    want = _train(ref, Opt(ref.parameters(), lr=3e-3, weight_decay=0.1), batches[:3])
    want += _train(ref, Opt(ref.parameters(), lr=1e-3), batches[3:])
    model = _aligned_model()
    with offload.init(_config(tmp_path, optimizer_states=cls.lower())) as rt:
        rt.wrap(model)
        got = _train(model, Opt(model.parameters(), lr=3e-3, weight_decay=0.1), batches[:3])
        got += _train(model, Opt(model.parameters(), lr=1e-3), batches[3:])
        values = rt.full_state_dict(model)
    assert got == want
    for name, p in ref.state_dict().items():
        assert torch.equal(values[name], p), name


def test_adamw8bit_state_dict_is_dequantized_in_memory_states(tmp_path):
    ref = _aligned_model()
    batches = _batches(3)
    ref_opt = offload.AdamW8bit(ref.parameters(), lr=1e-3)
    _train(ref, ref_opt, batches)
    model = _aligned_model()
    with offload.init(_config(tmp_path, optimizer_states="adamw8bit")) as rt:
        rt.wrap(model)
        opt = offload.AdamW8bit(model.parameters(), lr=1e-3)
        _train(model, opt, batches)
        sd = opt.state_dict()
        from offload.ops.adam8bit import dequantize_blocks

        for i, p in enumerate(ref.parameters()):
            st, mine = ref_opt.state[p], sd["state"][i]
            assert mine["step"].item() == 3
            assert torch.equal(mine["exp_avg"], dequantize_blocks(st["exp_avg.codes"], st["exp_avg.absmax"], True))
            assert torch.equal(mine["exp_avg_sq"],
                               dequantize_blocks(st["exp_avg_sq.codes"], st["exp_avg_sq.absmax"], False))
        # the dequantized views loaded back re-quantize to the same codes: training goes on bit for bit
        opt.load_state_dict(sd)
        losses = _train(model, opt, _batches(2, seed=9))
        got = rt.full_state_dict(model)
    assert losses == _train(ref, ref_opt, _batches(2, seed=9))
    for name, p in ref.state_dict().items():
        assert torch.equal(got[name], p), name


def test_adamw8bit_checkpoint_resume_bitwise_and_family_refused(tmp_path):
    batches = _batches(6)

    def run(resume_from=None, save_at=None, family=offload.AdamW8bit, states="adamw8bit"):
        model = _aligned_model()
        saved = None
        with offload.init(_config(tmp_path / "swap", optimizer_states=states)) as rt:
            rt.wrap(model)
            opt = family(model.parameters(), lr=2e-3)
            start = 0 if resume_from is None else rt.load_checkpoint(resume_from)["step"]
            losses = []
            for s in range(start, len(batches)):
                losses += _train(model, opt, batches[s:s + 1], clip=1.0, rt=rt)
                if save_at == s + 1:
                    saved = rt.save_checkpoint(tmp_path / "ckpt", extra={"step": s + 1})
            return losses, rt.full_state_dict(model), saved

    (tmp_path / "swap").mkdir()
    whole, final, saved = run(save_at=3)
    resumed, final2, _ = run(resume_from=tmp_path / "ckpt")
    assert resumed == whole[3:]
    assert all(torch.equal(final[k], final2[k]) for k in final)
    manifest = json.loads((saved / "manifest.json").read_text())
    assert {u["optimizer_states"] for u in manifest["units"]} == {"adamw8bit"}
    with pytest.raises(CheckpointError, match=r"family 'adamw8bit' in the checkpoint.*steps it with 'adamw'"):
        run(resume_from=tmp_path / "ckpt", family=offload.AdamW, states="adamw")


def test_nvme_bytes_per_step_halved_with_8bit_states(tmp_path):
    """bf16 compute, master and states on nvme, chunks of the default minimum (1 MiB of fp32, whose block scales
    fill one 4 KiB page), the synchronous path (nothing kept resident, so every state pages): the optimizer's
    traffic is 12 bytes per parameter each way with AdamW and about 6 with AdamW8bit. Each step is quiesced: a
    state fetched while its last write-behind is still going is taken from the host copy that write reads, not
    from the disk (a slow disk once made AdamW's window 22 bytes)."""
    moved = {}
    g = torch.Generator().manual_seed(0)
    data = [(torch.randn(8, 512, generator=g).bfloat16(), torch.randn(8, 512, generator=g).bfloat16())
            for _ in range(4)]
    for cls in ("AdamW", "AdamW8bit"):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(512, 512, bias=False), nn.GELU(), nn.Linear(512, 512, bias=False))
        with offload.init(_config(tmp_path, params="cpu", compute_dtype="bf16", grads="device", chunk_size="1MiB",
                                  cpu_budget="12MiB", pipeline=False, optimizer_states=cls.lower())) as rt:
            rt.wrap(model)
            opt = getattr(offload, cls)(model.parameters(), lr=1e-3)
            for batch in data[:2]:
                _train(model, opt, [batch])
                rt.quiesce()
            s0 = rt.stats()
            for batch in data[2:]:
                _train(model, opt, [batch])
                rt.quiesce()
            s1 = rt.stats()
            moved[cls] = sum(s1[k] - s0[k] for k in ("nvme_read_bytes", "nvme_written_bytes"))
    per_step = {cls: b / (2 * 2 * 512 * 512) for cls, b in moved.items()}  # bytes per parameter and step
    # AdamW: master and two moments read and written, 24 bytes; AdamW8bit: 2 x (4 + 2 x (1 + 4/256)) = 12.06
    assert per_step["AdamW"] == 24, per_step
    assert per_step["AdamW8bit"] == 2 * (4 + 2 * (1 + 4 / 256)), per_step


def test_placement_sizes_the_configured_family(tmp_path):
    from offload.plan.cli import OPTIMIZER_STATES

    assert {"adamw", "adamw-bf16", "adamw8bit", "lion"} <= set(names())  # (and this file's own)
    assert sorted(OPTIMIZER_STATES) == sorted(n for n in names() if not n.startswith("test-"))
    assert by_name("adamw").bytes_per_element == 8
    assert by_name("adamw8bit").bytes_per_element == 2 + 2 * 4 / 256
    assert by_name("lion").bytes_per_element == 4 == by_name("adamw-bf16").bytes_per_element
    with pytest.raises(ValueError, match=r"optimizer_states='adam'.*adamw, adamw-bf16, adamw8bit, lion"):
        offload.Config(optimizer_states="adam")
    model = _aligned_model()
    with offload.init(_config(tmp_path, optimizer_states="adamw8bit")) as rt:
        rt.wrap(model)
        with pytest.raises(ValueError, match=r"offload.Lion stores 4 bytes.*optimizer_states='adamw8bit'.*"
                                             r"set Config\(optimizer_states='lion'\)"):
            offload.Lion(model.parameters())
        offload.AdamW8bit(model.parameters())  # what was sized for


def test_one_unit_takes_one_family(tmp_path):
    model = _aligned_model()
    with offload.init(_config(tmp_path)) as rt:
        rt.wrap(model)
        params = list(model.parameters())
        a = offload.AdamW([params[0]], lr=1e-3)
        b = offload.Lion(params[1:], lr=1e-4)
        x, y = _batches(1)[0]
        F.mse_loss(model(x), y).backward()
        if len(rt.units) == 1:  # every parameter in one unit: the second family is refused at its step
            a.step()
            with pytest.raises(ValueError, match="one unit's parameters take one optimizer family"):
                b.step()
        else:
            a.step()
            b.step()


# ---- a new family, from this file alone ----------------------------------------------------------------
def _sgdm_chunk(master, grad, states, out, lo, hi, hyper, step, grad_scale):
    """SGD with momentum (torch.optim.SGD, dampening 0, no weight decay) over [lo, hi)."""
    g = grad[lo:hi].float() * grad_scale
    buf = states["momentum_buffer"][lo:hi]
    buf.mul_(hyper["momentum"]).add_(g)  # (a fresh buffer is 0: its first value is g, as torch's clone is)
    master[lo:hi].sub_(buf * hyper["lr"])
    if out is not None:
        out[lo:hi].copy_(master[lo:hi])


SGDM = register(Schema("test-sgdm", (StoredState("momentum_buffer", torch.float32),), _sgdm_chunk))


class SGDM_(SchemaOptimizer):
    schema = SGDM
    display = "test SGDM"

    def __init__(self, params, lr=0.01, momentum=0.9):
        super().__init__(params, dict(lr=lr, momentum=momentum))


register_family(SGDM_)


def test_a_new_family_plugs_in_without_touching_the_runtime(tmp_path):
    torch.manual_seed(0)
    ref = TinyTransformer()
    model, torch_model = (TinyTransformer() for _ in range(2))
    model.load_state_dict(ref.state_dict())
    torch_model.load_state_dict(ref.state_dict())
    g = torch.Generator().manual_seed(1)
    data = [torch.randint(0, VOCAB, (2, SEQ), generator=g) for _ in range(5)]

    def loop(m, opt):
        out = []
        for ids in data:
            loss = F.cross_entropy(m(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten())
            loss.backward()
            opt.step()
            opt.zero_grad()
            out.append(loss.item())
        return out

    ref_losses = loop(ref, SGDM_(ref.parameters(), lr=0.05))
    torch_losses = loop(torch_model, torch.optim.SGD(torch_model.parameters(), lr=0.05, momentum=0.9, foreach=False))
    assert max(abs(a - b) / b for a, b in zip(ref_losses, torch_losses)) < 1e-5  # the family is torch's SGD
    with offload.init(_config(tmp_path, cpu_budget="256KiB")) as rt:
        rt.wrap(model)
        opt = SGDM_(model.parameters(), lr=0.05)
        assert type(opt).__name__ == "ShardedSGDM_"
        losses = loop(model, opt)
        got = rt.full_state_dict(model)
        sd = opt.state_dict()
        assert all("momentum_buffer" in st for st in sd["state"].values())
        path = rt.save_checkpoint(tmp_path / "ckpt")
        rt.load_checkpoint(path)  # its states come back as they were saved
        assert torch.equal(opt.state_dict()["state"][0]["momentum_buffer"], sd["state"][0]["momentum_buffer"])
    assert losses == ref_losses
    for name, p in ref.state_dict().items():
        assert torch.equal(got[name], p), name
    manifest = json.loads((path / "manifest.json").read_text())
    assert {u["optimizer_states"] for u in manifest["units"] if u["moments"]} == {"test-sgdm"}
