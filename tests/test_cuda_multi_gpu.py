"""Several ranks, one GPU each (NCCL): each rank is its own process started by cuda_common.launch_ranks with
RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT, as torchrun or Slurm would, so a test can give one rank
an environment of its own (an injected delay, one visible GPU). Every launch is joined with a timeout: a hang
kills the ranks and fails with their logs.

Two ranks on one GPU cannot be tested: NCCL refuses two ranks on one device ("Duplicate GPU detected"), so the
2-rank tests need 2 GPUs (`multi_gpu`). The 8-rank tests skip below 8 GPUs.
"""
import dataclasses
import math
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cuda_common import (check_case, checkpoint_flats, compute_stream, launch_ranks, overlaps,  # noqa: E402
                         record_figure, require_gpus, trace_intervals)
from zero_common import Case  # noqa: E402

pytestmark = [pytest.mark.cuda, pytest.mark.multi_gpu]


def _nvme(tmp_path):
    d = tmp_path / "nvme"
    d.mkdir(exist_ok=True)
    return str(d)


def _parity(world: int, cases: list, tmp_path, timeout: float, env: dict | None = None) -> list:
    specs = [dict(dataclasses.asdict(c), against_torch=against) for c, against in cases]
    outs = launch_ranks(world, {"mode": "parity", "cases": specs, "nvme": _nvme(tmp_path)}, tmp_path,
                        f"parity{world}", env_for=lambda r: dict(env or {}), timeout=timeout)
    for rank, out in enumerate(outs):
        _one_context(out["contexts"], rank)
    results = outs[0]["results"]
    for (case, _), r in zip(cases, results):
        record_figure(f"parity_world{world}", **{k: v for k, v in r.items() if k != "losses"})
    for (case, _), r in zip(cases, results):
        check_case(r, case)
    return results


def _one_context(contexts: dict, own: int) -> None:
    """This rank's process holds a CUDA context on its own GPU only, and allocated nothing on any other (a thread
    that never bound its device would have made one on GPU 0)."""
    active = {int(d): a for d, a in contexts["active"].items()}
    if all(a is not None for a in active.values()):
        assert active[own] and not any(a for d, a in active.items() if d != own), (own, active)
    assert all(v == 0 for v in contexts["other_allocated"].values()), (own, contexts)


def _same_losses(outs: list, steps: int) -> list:
    losses = outs[0]["losses"]
    assert len(losses) == steps and all(math.isfinite(x) for x in losses), losses
    assert all(o["losses"] == losses for o in outs), [o["losses"] for o in outs]  # all-reduced: every rank agrees
    return losses


# ---- 2 GPUs -----------------------------------------------------------------------------------------------------
def test_two_ranks_on_two_gpus_match_plain_torch_and_the_synchronous_runtime(tmp_path):
    """2 ranks (NCCL, the group started by the script; the runtime joins it): tiers, bf16 with a bf16 reduce,
    accumulation both ways, and a slowed gather / reduce lane; pipelined bitwise the synchronous runtime, both
    within the tolerance of plain PyTorch on one GPU over the whole batch. Every rank keeps to its own GPU."""
    cases = [(Case(world=2, params="cpu", optimizer="cpu"), True),
             (Case(world=2, params="nvme", optimizer="nvme", accum=4), True),
             (Case(world=2, params="device", optimizer="device", accum=4, no_sync=False), True),
             (Case(world=2, dtype="bf16", params="cpu", optimizer="cpu", clip=1e9), True),
             (Case(world=2, dtype="bf16", reduce_dtype="bf16", params="nvme", optimizer="nvme", accum=4, clip=1e9),
              True)]
    cases += [(Case(world=2, params="nvme", optimizer="nvme", grads="nvme", delay=f"{q}=0.005", snapshot_every=10,
                    clip=None, cpu_budget="128KiB"), True) for q in ("gather", "reduce", "reduce_drain", "copy")]
    _parity(2, cases, tmp_path, timeout=480)


def test_two_ranks_all_gather_and_copies_overlap_compute(tmp_path):
    """Rank 0's profile of 3 steps (after the traced first one) of 6 MLP blocks with parameters in host memory: an
    NCCL all-gather kernel and a host->device copy each run while a compute kernel runs on the training stream."""
    outs = launch_ranks(2, {"mode": "train", "model": "mlp", "steps": 4, "profile": True, "params": "cpu",
                            "optimizer": "cpu", "cpu_budget": "2GiB", "device_budget": "4GiB"},
                        tmp_path, "profile2", timeout=300)
    _same_losses(outs, 4)
    iv = trace_intervals(outs[0]["trace"])
    main = compute_stream(iv)
    gather = overlaps(iv, "nccl", b_stream=main, name_has="allgather")
    reduce = overlaps(iv, "nccl", b_stream=main, name_has="reducescatter")
    h2d = overlaps(iv, "h2d", b_stream=main)
    record_figure("profile_overlap_2gpu", allgather=gather, reduce_scatter=reduce, h2d=h2d)
    assert gather["intervals"] > 0 and gather["overlapping"] > 0, gather
    assert h2d["overlapping"] > 0, h2d


# ---- 8 GPUs -------------------------------------------------------------------------------------------------------
def test_eight_ranks_with_skewed_lane_delays_run_20_steps_without_a_hang(tmp_path):
    """Every rank's gather, reduce, optimizer, copy and disk queues slowed by a different amount (rank 0's gathers
    fastest and its reduces slowest, rank 7 the other way round): each lane still issues its collectives in the
    same order on every rank, so 20 steps finish (joined with a timeout) and every rank sees the same losses."""
    require_gpus(8)

    def delays(r: int) -> dict:
        return {"OFFLOAD_INJECT_DELAY": f"gather={0.002 * r:.3f},reduce={0.002 * (7 - r):.3f},"
                                        f"optimizer={0.001 * (r % 3):.3f},copy={0.001 * (r % 2):.3f},"
                                        f"nvme_read={0.001 * ((r + 1) % 2):.3f}"}

    outs = launch_ranks(8, {"mode": "train", "steps": 20, "params": "nvme", "optimizer": "nvme", "nvme": _nvme(tmp_path),
                            "cpu_budget": "64MiB", "layers": 4, "collective_timeout": "120s"},
                        tmp_path, "skew8", env_for=delays, timeout=420)
    losses = _same_losses(outs, 20)
    record_figure("skewed_delays_8gpu", losses=losses)


def test_eight_ranks_one_context_each(tmp_path):
    """All 8 GPUs visible to every rank (torchrun's layout): rank r computes on cuda:r and has a context there
    only (driver API: cuDevicePrimaryCtxGetState), nothing allocated on the others."""
    require_gpus(8)
    outs = launch_ranks(8, {"mode": "train", "steps": 3, "params": "cpu", "optimizer": "cpu"}, tmp_path, "ctx8",
                        timeout=300)
    _same_losses(outs, 3)
    for rank, out in enumerate(outs):
        assert out["device"] == f"cuda:{rank}" and out["device_count"] == 8, out
        _one_context(out["contexts"], rank)


def test_eight_ranks_one_visible_gpu_each(tmp_path):
    """Slurm / Kubernetes layout: CUDA_VISIBLE_DEVICES=r and LOCAL_RANK=r per process; each sees one GPU, whose
    index is 0 whatever LOCAL_RANK says (compute_device: LOCAL_RANK % device_count), and training runs."""
    require_gpus(8)
    outs = launch_ranks(8, {"mode": "train", "steps": 3, "params": "cpu", "optimizer": "cpu"}, tmp_path, "vis8",
                        env_for=lambda r: {"CUDA_VISIBLE_DEVICES": str(r)}, timeout=300)
    _same_losses(outs, 3)
    for rank, out in enumerate(outs):
        assert out["device"] == "cuda:0" and out["device_count"] == 1 and out["visible"] == str(rank), out


def test_eight_ranks_match_plain_torch_over_the_whole_batch(tmp_path):
    """8 ranks (16 samples a step, 2 each) against plain PyTorch on one GPU over the same 16 samples, and the
    pipelined runtime bitwise the synchronous one. NCCL's ring with the Simple protocol: fixed summation order."""
    require_gpus(8)
    cases = [(Case(world=8, params="cpu", optimizer="cpu"), True),
             (Case(world=8, params="nvme", optimizer="nvme", accum=4), True),
             (Case(world=8, params="device", optimizer="cpu", accum=4, no_sync=False), True),
             # bf16 over 8 ranks: the ranks' sum order is NCCL's, not the reference's (a flipped bf16 copy grows
             # through Adam): pipelined == synchronous only
             (Case(world=8, dtype="bf16", reduce_dtype="bf16", params="nvme", optimizer="nvme", accum=4, clip=1e9),
              False)]
    _parity(8, cases, tmp_path, timeout=540, env={"NCCL_ALGO": "Ring", "NCCL_PROTO": "Simple"})


def test_checkpoint_8_to_4_to_8_ranks_is_bitwise(tmp_path):
    """8 ranks train 3 steps and save; 4 ranks load that and save it again; 8 ranks load that and save it again:
    every fp32 master and Adam moment element is where it was, bit for bit (tests/test_checkpoint's resharding
    check, on GPUs with NCCL)."""
    require_gpus(8)
    nvme = _nvme(tmp_path)
    a, b, c = tmp_path / "ckpt8", tmp_path / "ckpt4", tmp_path / "ckpt8b"
    common = {"mode": "checkpoint", "params": "nvme", "optimizer": "nvme", "nvme": nvme, "cpu_budget": "64MiB"}
    launch_ranks(8, dict(common, steps=3, save=str(a)), tmp_path, "save8", timeout=300)
    launch_ranks(4, dict(common, load=str(a), save=str(b)), tmp_path, "to4", timeout=300)
    launch_ranks(8, dict(common, load=str(b), save=str(c)), tmp_path, "to8", timeout=300)
    fa, fb, fc = checkpoint_flats(a), checkpoint_flats(b), checkpoint_flats(c)
    assert fa.keys() == fb.keys() == fc.keys() and fa
    bad = [k for k in fa if not (torch.equal(fa[k], fb[k]) and torch.equal(fa[k], fc[k]))]
    assert not bad, bad
