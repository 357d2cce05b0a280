"""benchmarks/bench_emulated_gpu.py: the emulated accelerator's blocks, and the bench's smallest configuration
end to end (a tiny model, one round of two timed steps, the offload, prefetch-off and torch contenders).
Only structural facts are asserted (no timing thresholds: the machine may be busy)."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import bench_emulated_gpu as emu  # noqa: E402


def test_blocks_give_full_size_exact_gradients_and_wait_their_flops():
    s = emu.EmuSettings(layers=2, dim=16, ff=32, seq=4, batch=2, tflops=1e-5)
    torch.manual_seed(0)
    model = emu.build_model(s)
    assert sum(p.numel() for p in model.parameters()) == s.layers * emu.block_params(s.dim, s.ff) + s.dim
    x = emu.make_input(s, 0)
    assert x.shape == (s.batch, s.seq, s.dim) and x.dtype == torch.bfloat16
    before = emu.SLEPT["s"]
    out = model(x)
    loss = emu.loss_of(out)
    loss.backward()
    slept = emu.SLEPT["s"] - before
    # each wait is at least what it was asked for: the step's compute = forward + backward (2x) of every block
    assert slept >= emu.step_compute_s(s) * (1 - 1e-9)
    assert emu.step_compute_s(s) == pytest.approx(3 * s.layers * 2 * emu.block_params(s.dim, s.ff) * s.batch * s.seq
                                                  / (s.tflops * 1e12))
    for p in model.parameters():
        assert p.grad is not None and p.grad.shape == p.shape and p.grad.dtype == p.dtype
    # the gradients are those of the function the forward computes: autograd through plain ops agrees
    ref = x.float().clone().requires_grad_(True)
    weights = [[b.qkv, b.proj, b.fc1, b.fc2] for b in model.blocks]
    leaves = [w.detach().clone().requires_grad_(True) for ws in weights for w in ws]
    scale = model.scale.detach().clone().requires_grad_(True)
    h, k = ref, 0
    for ws in weights:
        h = h + sum(leaves[k + j].mean() for j in range(len(ws)))
        k += len(ws)
    ref_loss = ((h * scale) - 1.0).pow(2).sum(-1).mean()
    ref_loss.backward()
    got = [w.grad for ws in weights for w in ws]
    for g, r in zip(got, leaves):
        torch.testing.assert_close(g, r.grad, rtol=2e-2, atol=1e-6)
        assert (g == g.flatten()[0]).all()  # a broadcast: one value per weight


def test_smallest_configuration_end_to_end(tmp_path):
    out = tmp_path / "emu.json"
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "bench_emulated_gpu.py"),
           "--layers", "2", "--dim", "64", "--ff", "256", "--seq", "16", "--batch", "2",
           "--contenders", "offload,offload-sync,torch", "--plan-contenders", "", "--emulate-gpu", "0.0005",
           "--rounds", "1", "--steps", "2", "--warmup", "1", "--threads", "1",
           "--cpu-budget", "64MiB", "--device-budget", "64MiB", "--probe-bytes", "16MiB",
           "--nvme-path", str(tmp_path / "swap"), "--out-dir", str(tmp_path / "out"), "--json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    for key in ("settings", "n_params", "probes", "rates", "machine", "deepspeed_config"):
        assert key in doc
    assert doc["probes"]["probe-nvme"]["read_Bps"] > 0 and doc["probes"]["probe-adam"]["adam_cpu_s"] >= 0
    (entry,) = doc["rates"]
    for field in emu.RATE_FIELDS:
        assert field in entry, field
    assert entry["tflops"] == 0.0005
    table = entry["table"]
    assert set(table) == {"offload", "offload-sync", "torch"}
    for name, row in table.items():
        for field in emu.ROW_FIELDS:
            assert field in row, (name, field)
        assert row["rounds_ok"] == 1 and row["rounds_failed"] == 0
        assert row["bound_s"] >= row["compute_s"] > 0
    runs = {name: rs[0] for name, rs in entry["runs"].items()}
    # the torch contender: every step is at least its own emulated waits, and the gradients had full shapes
    torch_run = runs["torch"]
    assert torch_run["grad_shapes_ok"] is True
    assert len(torch_run["step_s"]) == len(torch_run["slept_step_s"]) == 2
    for step, slept in zip(torch_run["step_s"], torch_run["slept_step_s"]):
        assert step >= slept >= emu.step_compute_s(emu.EmuSettings(**doc["settings"] | {"tflops": 0.0005})) * (1 - 1e-9)
    # prefetch on or off: bitwise the same losses
    assert runs["offload"]["losses"] == runs["offload-sync"]["losses"]
    assert len(runs["offload"]["losses"]) == 3 and all(math.isfinite(v) for v in runs["offload"]["losses"])
    assert runs["offload"]["tiers"]["params"] == "nvme" and runs["offload"]["tiers"]["optimizer"] == "nvme"
    split = table["offload"]["split"]
    assert set(split) >= {"wall_s", "compute_s", "wait_s", "lane_busy_s"}
    # the plan's check of the default contender, and its timeline
    plan = entry["plan"]["offload"]
    assert plan["measured_s"] == table["offload"]["median_s"] and plan["predicted_s"] > 0
    assert entry["timeline_png"] and os.path.getsize(entry["timeline_png"]) > 0
