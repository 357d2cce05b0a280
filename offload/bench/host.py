"""`offload bench memcpy` and `offload bench adam`: what the host gives the offload paths.

memcpy: GB/s of the multi-threaded C++ copy (offload.ops.copy_) and of torch's copy_, for 1..N kernel
threads, over pageable buffers and, when a GPU driver is present, page-locked (pinned) ones. GB/s counts
the bytes copied (read + write traffic is twice that).
adam: the fused CPU AdamW (fp32 master and moments, bf16 gradient in, bf16 parameter out: the offload
update) against torch.optim.AdamW(fused=True) on fp32 tensors of the same size, in params/s and in GB/s of
memory traffic (the fused kernel moves 4+4+4+2 in and 4+4+4+2 out = 28 bytes per parameter; torch's fp32
update 4 x 4 in and 3 x 4 out = 28).
Each figure is the median of `rounds` timed repetitions, after a warm-up.
"""
from __future__ import annotations

import time

import numpy as np
import torch


def _median_s(fn, rounds: int) -> float:
    fn()  # warm-up: page faults, thread-pool start
    times = np.empty(rounds)
    for i in range(rounds):
        t0 = time.perf_counter()
        fn()
        times[i] = time.perf_counter() - t0
    return float(np.median(times))


def _buffers(nbytes: int, pinned: bool):
    n = nbytes // 4
    src = torch.empty(n, dtype=torch.float32, pin_memory=pinned).uniform_()
    dst = torch.empty(n, dtype=torch.float32, pin_memory=pinned)
    return dst, src


def memcpy_bench(sizes: list[int], threads: list[int], rounds: int = 5, progress=None) -> dict:
    from ..ops import copy_, num_threads, set_num_threads

    kinds = ["pageable"] + (["pinned"] if torch.cuda.is_available() else [])
    rows = []
    before = num_threads()
    try:
        for kind in kinds:
            for size in sizes:
                dst, src = _buffers(size, kind == "pinned")
                for t in threads:
                    set_num_threads(t)
                    s = _median_s(lambda: copy_(dst, src), rounds)
                    rows.append({"memory": kind, "bytes": size, "threads": t, "impl": "offload", "GBps": size / s / 1e9})
                    if progress:
                        progress()
                torch_s = _median_s(lambda: dst.copy_(src), rounds)
                rows.append({"memory": kind, "bytes": size, "threads": torch.get_num_threads(), "impl": "torch",
                             "GBps": size / torch_s / 1e9})
    finally:
        set_num_threads(before)
    best = max(r["GBps"] for r in rows if r["impl"] == "offload")
    return {"rows": rows, "best_GBps": best, "pinned_tested": "pinned" in kinds}


def adam_bench(numel: int, rounds: int = 5) -> dict:
    from ..ops import adamw_step_

    g = torch.Generator().manual_seed(0)
    master = torch.randn(numel, generator=g)
    m, v = torch.zeros(numel), torch.zeros(numel)
    grad = torch.randn(numel, generator=g).to(torch.bfloat16)
    out = torch.empty(numel, dtype=torch.bfloat16)
    step = [0]

    def ours():
        step[0] += 1
        adamw_step_(master, grad, m, v, lr=1e-4, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01,
                    step=step[0], out=out)

    p = torch.nn.Parameter(torch.randn(numel, generator=g))
    p.grad = torch.randn(numel, generator=g)
    ref = torch.optim.AdamW([p], lr=1e-4, weight_decay=0.01, fused=True)
    ours_s, torch_s = _median_s(ours, rounds), _median_s(ref.step, rounds)
    return {"numel": numel, "offload_params_per_s": numel / ours_s, "torch_fused_params_per_s": numel / torch_s,
            "offload_GBps": 28 * numel / ours_s / 1e9, "torch_fused_GBps": 28 * numel / torch_s / 1e9,
            "speedup": torch_s / ours_s, "medians_s": {"offload": ours_s, "torch_fused": torch_s}}
