"""AdamW8bit (8-bit block-quantized moments, offload.ops.adam8bit) vs the fp32 fused AdamW, on the CPU.

Both step the same size (default 16M params) with an fp32 grad and no `out`, from a warmed-up state (a few
steps first, so no block is all zero). Variants run interleaved, one step per sample, `--repeats` samples
each; the median is reported as params/s. torchao's and bitsandbytes' 8-bit AdamW are timed as well when
they import (nothing is installed for them).

State bytes per param: fp32 AdamW master + m + v = 12; AdamW8bit master (4) + two uint8 codes (2) + two
fp32 absmax per 256-element block (8/256) = 6.03.

Usage:
  python benchmarks/bench_adam8bit.py                  # 16M params, 1 and 2 threads, 5 repeats
  python benchmarks/bench_adam8bit.py --size 4M --threads 2 --repeats 3 --isas avx2
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time


def _parse_size(s: str) -> int:
    s = s.strip().upper()
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(s[-1], 1)
    return int(float(s[:-1] if s[-1] in "KMG" else s) * mult)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="16M", help="params (K/M/G suffixes are powers of 2)")
    ap.add_argument("--threads", default="1,2", help="comma list of kernel thread counts")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--isas", default="vector",
                    help="comma list of SIMD paths for the offload kernels (avx512, avx2, scalar), or 'vector': "
                         "the CPU's AVX-512 and AVX2 paths (the load-time pick times fp32 AdamW only)")
    args = ap.parse_args()

    import torch

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from offload import _ext
    from offload.ops import adamw_step_
    from offload.ops.adam8bit import BLOCK, adamw8bit_step_, blocks

    C = _ext.require()
    n = _parse_size(args.size)
    h = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)
    gen = torch.Generator().manual_seed(0)
    grad = torch.randn(n, generator=gen)
    p32, m, v = torch.randn(n, generator=gen), torch.zeros(n), torch.zeros(n)
    p8 = p32.clone()
    mc, vc = torch.zeros(n, dtype=torch.uint8), torch.zeros(n, dtype=torch.uint8)
    ma, va = torch.zeros(blocks(n)), torch.zeros(blocks(n))
    step = {"fp32": 0, "8bit": 0}

    def fp32():
        step["fp32"] += 1
        adamw_step_(p32, grad, m, v, step=step["fp32"], **h)

    def eight():
        step["8bit"] += 1
        adamw8bit_step_(p8, grad, mc, ma, vc, va, lo=0, hi=n, step=step["8bit"], **h)

    variants = {"offload fp32 adamw_step_": (fp32, 12.0), "offload adamw8bit_step_": (eight, 4 + 2 + 8 / BLOCK)}

    # Third-party 8-bit AdamW, only if already installed.
    for label, make in (("torchao AdamW8bit", _torchao), ("bitsandbytes AdamW8bit", _bnb)):
        try:
            fn = make(torch, n, grad, h)
            fn()  # one step: does it run on the CPU at all?
            variants[label] = (fn, None)
        except Exception as exc:  # not installed, or no CPU path
            print(f"# {label}: skipped ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})")

    for fn, _ in variants.values():  # warm-up: non-zero moments everywhere
        for _ in range(3):
            fn()

    order = ["scalar", "avx2", "avx512"]
    if args.isas == "vector":
        isas = [i for i in ("avx512", "avx2") if order.index(i) <= order.index(C.best_isa())] or ["scalar"]
    else:
        isas = args.isas.split(",")
    print(f"# {n:,} params, fp32 grad, no out; {args.repeats} repeats, median; {len(os.sched_getaffinity(0))} "
          f"usable CPUs; the isa column applies to the offload kernels only")
    rows = []
    for isa in isas:
        C.set_isa(isa)
        for threads in (int(t) for t in args.threads.split(",")):
            C.set_num_threads(threads)
            torch.set_num_threads(threads)
            samples = {k: [] for k in variants}
            for _ in range(args.repeats):
                for label, (fn, _) in variants.items():
                    t0 = time.perf_counter()
                    fn()
                    samples[label].append(time.perf_counter() - t0)
            for label, (_, bpp) in variants.items():
                med = statistics.median(samples[label])
                rows.append((label, isa, threads, med * 1e3, n / med / 1e6, bpp))
    C.set_num_threads(0)
    C.set_isa("auto")

    print(f"{'variant':<26} {'isa':>6} {'threads':>7} {'ms/step':>8} {'Mparams/s':>10} {'state B/param':>14}")
    for label, isa, threads, ms, rate, bpp in rows:
        print(f"{label:<26} {isa:>6} {threads:>7} {ms:>8.1f} {rate:>10.0f} {'' if bpp is None else f'{bpp:.2f}':>14}")
    for isa in isas:
        for threads in sorted({r[2] for r in rows}):
            by = {r[0]: r for r in rows if r[1] == isa and r[2] == threads}
            ratio = by["offload adamw8bit_step_"][4] / by["offload fp32 adamw_step_"][4]
            print(f"# {isa}, {threads} thread(s): adamw8bit_step_ at {ratio:.2f}x the fp32 kernel's params/s")


def _torchao(torch, n, grad, h):
    from torchao.optim import AdamW8bit

    p = torch.nn.Parameter(torch.randn(n))
    opt = AdamW8bit([p], lr=h["lr"], betas=(h["beta1"], h["beta2"]), eps=h["eps"], weight_decay=h["weight_decay"])

    def fn():
        p.grad = grad
        opt.step()

    return fn


def _bnb(torch, n, grad, h):
    import bitsandbytes as bnb

    p = torch.nn.Parameter(torch.randn(n))
    opt = bnb.optim.AdamW8bit([p], lr=h["lr"], betas=(h["beta1"], h["beta2"]), eps=h["eps"],
                              weight_decay=h["weight_decay"])

    def fn():
        p.grad = grad
        opt.step()

    return fn


if __name__ == "__main__":
    main()
