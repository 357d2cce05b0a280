"""Parity on the GPU (one rank): offload.init training against plain PyTorch on the same GPU at every step, and the
pipelined runtime bit for bit the synchronous one (Config.pipeline=False), also with one queue made slow.

Grid: params x optimizer tiers (device / cpu / nvme), fp32 and bf16 (and fp16 with a loss scaler), gradient accumulation reduced once
(`rt.no_sync()`) and reduced every micro-batch, gradients on each tier, an unmodified Hugging Face Llama, and each
queue slowed in turn (gather, reduce, copy, nvme read / write, optimizer: 5 ms per piece of work).
Tolerances (cuda_common): fp32 5e-5 against torch.optim.AdamW on the GPU (cuBLAS and the fused CPU AdamW the
runtime steps with reduce in their own order; 1e-5 on the CPU); bf16 1e-4 against a reference doing the same casts
(zero_common's). bf16 cases whose gradients live on the device run unclipped: the runtime takes their norm on the
GPU, the reference on the host, the last bit can differ and flip a bf16 copy that Adam then grows (the CPU suite's
2-rank bf16 cases do the same for the same reason). Attention runs on the math backend in every run
(cuda_common.deterministic): the fused backends' backward is not run-to-run deterministic, and bitwise comparisons
need it to be.
"""
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cuda_common import check_case, device_run_case, record_figure  # noqa: E402
from zero_common import Case, transformers_available  # noqa: E402

pytestmark = pytest.mark.cuda

TIERS = ("device", "cpu", "nvme")


def _grads_on_host(case: Case) -> bool:
    """Where Config(grads="auto") puts gradients with the harness's given 256MiB device budget: with the optimizer
    states, except nvme ones, whose gradients go to the device tier."""
    grads = case.grads if case.grads != "auto" else ("device" if case.optimizer == "nvme" else case.optimizer)
    return grads != "device"


def _bf16(dtype="bf16", **kw) -> Case:
    case = Case(dtype=dtype, **kw)
    if not _grads_on_host(case):
        case.clip = 1e9  # no clipping (coefficient exactly 1): see the module docstring
    return case


def grid() -> list:
    cases = [Case(params=p, optimizer=o) for p in TIERS for o in TIERS]
    cases += [Case(params=p, optimizer=o, accum=4, no_sync=ns)
              for p, o in (("device", "device"), ("cpu", "cpu"), ("nvme", "nvme")) for ns in (True, False)]
    for p, o in (("device", "device"), ("cpu", "cpu"), ("nvme", "nvme"), ("cpu", "nvme")):
        cases += [_bf16(params=p, optimizer=o), _bf16(params=p, optimizer=o, accum=4),
                  _bf16(params=p, optimizer=o, accum=4, no_sync=False)]
    cases += [Case(params="cpu", optimizer="cpu", grads="device"),
              Case(params="nvme", optimizer="nvme", grads="nvme", cpu_budget="128KiB"),  # every state pages
              _bf16(params="nvme", optimizer="nvme", grads="nvme", accum=4, cpu_budget="128KiB")]
    # fp16 through offload.GradScaler against torch.amp.GradScaler: the first steps overflow and are skipped
    cases += [_bf16("fp16", params="cpu", optimizer="cpu"), _bf16("fp16", params="nvme", optimizer="nvme", accum=4),
              _bf16("fp16", params="nvme", optimizer="nvme", grads="nvme", cpu_budget="128KiB", clip_some=True)]
    if transformers_available():
        cases += [Case(model="llama", params="cpu", optimizer="nvme"),
                  _bf16(model="llama", params="nvme", optimizer="cpu", accum=4)]
    return cases


def delay_cases() -> list:
    """test_zero_parity.delay_cases on the GPU: every state through the disk, gradients too (fp32, unclipped: a norm
    waits for every reduce and would hide a missing wait), and bf16 with accumulation on the queues a GPU adds work
    to (gather: copies into the flat buffer on its stream; reduce: the launch on its stream; reduce_drain: the
    device->host copy of each gradient chunk on the drain's stream; copy: the store's host<->device copies)."""
    out = [Case(params="nvme", optimizer="nvme", grads="nvme", delay=f"{q}=0.005", snapshot_every=10, clip=None,
                cpu_budget="128KiB")
           for q in ("nvme_read", "nvme_write", "optimizer", "gather", "reduce", "reduce_drain", "copy")]
    out += [_bf16(params="nvme", optimizer="nvme", accum=4, delay=f"{q}=0.005", snapshot_every=10,
                  cpu_budget="128KiB") for q in ("gather", "reduce", "reduce_drain", "copy")]
    return out


def _run(case, tmp_path):
    r = device_run_case(case, str(tmp_path))
    record_figure("parity", **{k: v for k, v in r.items() if k != "losses"})
    check_case(r, case)


@pytest.mark.parametrize("case", grid(), ids=lambda c: c.name)
def test_parity_on_gpu(case, tmp_path):
    _run(case, tmp_path)


@pytest.mark.parametrize("case", delay_cases(), ids=lambda c: c.name)
def test_pipeline_is_bitwise_sync_with_a_slow_queue_on_gpu(case, tmp_path):
    _run(case, tmp_path)
