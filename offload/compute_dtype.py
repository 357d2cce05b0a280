"""Which dtype the compute device multiplies fast: what `Config.compute_dtype="auto"` (the default of `offload
finetune`) resolves to, and the one-time warning for an explicit choice that will be slow.

    name, why = fast_compute_dtype(device)    # ("bf16", "the CPU multiplies bf16 at 0.3x fp32's time")
    warn_if_slow("bf16", device)              # once per process, with the measured figure

On a GPU: bf16 where it has bf16 (Ampere and later), else fp32 (fp16 trains only through a loss scaler the
script must run, so it stays an explicit choice). On a CPU: bf16 where the CPU multiplies bf16 matrices about as
fast as fp32 or faster (AVX512_BF16 or AMX: Intel Cooper Lake and later, AMD Zen 4 and later), else fp32. Without
those instructions torch emulates bf16, and a matmul takes 20-70x fp32's time (a 2-core AMD EPYC with oneDNN
capped at AVX2: 55-74x), which is what made the first fine-tune on such a machine take hours.

The CPU's figure is measured, not read from /proc/cpuinfo: one small matmul per dtype on one core, best of a
few runs, interleaved (a few ms, about 60 where bf16 is emulated), once per process. A measurement also sees what
flags do not: a torch build without oneDNN's bf16 kernels, or `ONEDNN_MAX_CPU_ISA=AVX2` (how the tests and benches
emulate an AVX2-only CPU on an AVX-512 one). The two cases are 10-200x apart, so the threshold below is not a close
call.
"""
from __future__ import annotations

import functools
import time
import warnings

import torch

FAST_ENOUGH = 2.0  # a low-precision matmul at most this many times fp32's time counts as fast (measured: 0.3-1 or 20+)
_N = 256  # the probe's square matmul: 34 MFLOP, 0.3 ms on a core in fp32, about 10 ms where bf16 is emulated

_warned: set[str] = set()


@functools.lru_cache(maxsize=None)
def cpu_matmul_slowdown(dtype: torch.dtype) -> float:
    """Time of an _N x _N matmul in `dtype` over the same in fp32 on one of this CPU's cores, best of 5
    interleaved runs each, so a burst of load elsewhere hits both alike. One thread: a multi-threaded op on a
    loaded machine waits for its slowest thread (measured: 12 ms for a 0.3 ms fp32 matmul while the other core
    was busy), which hid a 30x ratio; the per-core ratio is what the instructions decide."""
    gen = torch.Generator().manual_seed(0)  # not torch's global RNG: a seeded script draws the same either way
    a32, b32 = torch.randn(_N, _N, generator=gen), torch.randn(_N, _N, generator=gen)
    pairs = {torch.float32: (a32, b32), dtype: (a32.to(dtype), b32.to(dtype))}
    best = {d: float("inf") for d in pairs}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # for the probe only: restored below
    try:
        for d, (a, b) in pairs.items():
            torch.mm(a, b)  # first call: kernel selection and allocation, not timed
        for _ in range(5):
            for d, (a, b) in pairs.items():
                t0 = time.perf_counter()
                torch.mm(a, b)
                best[d] = min(best[d], time.perf_counter() - t0)
    finally:
        torch.set_num_threads(threads)
    return best[dtype] / max(best[torch.float32], 1e-9)


def fast_compute_dtype(device: torch.device) -> tuple[str, str]:
    """What "auto" resolves to on `device`, and why (one clause, for logs, `offload env` and summaries)."""
    if device.type == "cuda":
        if torch.cuda.is_bf16_supported():
            return "bf16", f"{torch.cuda.get_device_name(device)} computes bf16 natively"
        return "fp32", (f"{torch.cuda.get_device_name(device)} has no bf16 (fp16 needs a loss scaler: "
                        "choose it yourself)")
    if device.type != "cpu":
        return "fp32", f"no figure for {device.type}: fp32, as plain PyTorch"
    slowdown = cpu_matmul_slowdown(torch.bfloat16)
    if slowdown <= FAST_ENOUGH:
        return "bf16", f"the CPU multiplies bf16 at {slowdown:.1f}x fp32's time"
    return "fp32", f"the CPU multiplies bf16 at {slowdown:.0f}x fp32's time: no bf16 instructions"


def resolve(name: str, device: torch.device) -> tuple[str, str]:
    """`name` as given ("fp32", "bf16", "fp16") or, for "auto", the fast one; with the reason."""
    if name == "auto":
        return fast_compute_dtype(device)
    warn_if_slow(name, device)
    return name, "as set"


def warn_if_slow(name: str, device: torch.device) -> None:
    """An explicit bf16/fp16 on a CPU that emulates it is kept (it is the user's choice) but said, once per
    process, with the measured slowdown and the fix."""
    if device.type != "cpu" or name not in ("bf16", "fp16") or name in _warned:
        return
    slowdown = cpu_matmul_slowdown(torch.bfloat16 if name == "bf16" else torch.float16)
    if slowdown > FAST_ENOUGH:
        _warned.add(name)
        warnings.warn(f"offload: compute_dtype={name!r} on this CPU: its {name} matmuls take {slowdown:.0f}x fp32's "
                      f"time (no {name} instructions), so training runs several times slower than in fp32; "
                      "compute_dtype='auto' (offload finetune: --compute-dtype auto) picks the fast one",
                      RuntimeWarning, stacklevel=3)
