"""Copy / cast kernels vs torch, side by side, interleaved rounds, one process.

For each case and size: ours (offload.ops.copy_ into a preallocated buffer), torch `dst.copy_(src)`
into the same kind of buffer, and torch `src.to(dtype)` (allocates, as user code usually does).
GB/s counts bytes read + bytes written. Each figure is "median / best" over `--rounds` rounds; every
round runs each contender once, in a rotating order, so machine noise hits all of them alike. On a
shared, loaded host the best-of figure is the better estimate of what the code can do; the median
shows what it did under that load.

    PYTHONPATH=. python benchmarks/bench_copy.py --threads 2 --sizes 1M,16M,64M --rounds 7
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch

from offload import _ext
from offload.ops import copy as oc


def parse_count(s: str) -> int:
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    s = s.strip().upper()
    return int(float(s[:-1]) * mult[s[-1]]) if s[-1] in mult else int(s)


CASES = [
    ("copy fp32", torch.float32, torch.float32),
    ("fp32->bf16", torch.float32, torch.bfloat16),
    ("bf16->fp32", torch.bfloat16, torch.float32),
    ("fp32->fp16", torch.float32, torch.float16),
    ("fp16->fp32", torch.float16, torch.float32),
]


def timeit(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def bench_case(frm, to, n, rounds):
    src = torch.randn(n).to(frm)
    dst_ours = oc.aligned_empty(n, to)
    dst_torch = oc.aligned_empty(n, to)
    contenders = {
        "offload": lambda: oc.copy_(dst_ours, src),
        "torch copy_": lambda: dst_torch.copy_(src),
        "torch .to()": lambda: src.to(to, copy=True),
    }
    for fn in contenders.values():  # warm up: page in the buffers, load code
        fn()
    times = {k: [] for k in contenders}
    names = list(contenders)
    for r in range(rounds):
        for k in names[r % len(names):] + names[: r % len(names)]:
            times[k].append(timeit(contenders[k]))
    assert torch.equal(dst_ours.view(torch.uint8), dst_torch.view(torch.uint8))
    nbytes = n * (src.element_size() + dst_ours.element_size())
    return summarize(times, nbytes)


def summarize(times, nbytes):
    return {k: (nbytes / statistics.median(v) / 1e9, nbytes / min(v) / 1e9) for k, v in times.items()}


def bench_flatten(n_tensors, each, rounds):
    ts = [torch.randn(each) for _ in range(n_tensors)]
    offsets, total = oc.flat_layout(ts, dtype=torch.bfloat16)
    out = oc.aligned_empty(total, torch.bfloat16)
    out2 = oc.aligned_empty(total, torch.bfloat16)

    def torch_loop():
        for t, off in zip(ts, offsets):
            out2[off : off + t.numel()].copy_(t)

    contenders = {"offload": lambda: oc.flatten(ts, out=out), "torch copy_ loop": torch_loop}
    for fn in contenders.values():
        fn()
    times = {k: [] for k in contenders}
    names = list(contenders)
    for r in range(rounds):
        for k in names[r % 2:] + names[: r % 2]:
            times[k].append(timeit(contenders[k]))
    nbytes = n_tensors * each * 6
    return summarize(times, nbytes)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--sizes", default="1M,16M,64M", help="element counts")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    C = _ext.require()
    C.set_num_threads(args.threads)
    torch.set_num_threads(args.threads)
    import os

    print(f"# {platform.processor() or platform.machine()}, isa={C.active_isa()}, threads={args.threads}, "
          f"torch {torch.__version__}, load average {os.getloadavg()[0]:.1f}, GB/s median / best")
    rows = []
    fmt = lambda r: f"{r[0]:6.2f} /{r[1]:6.2f}"
    print(f"{'case':<14}{'elements':>9}  {'offload':>15}  {'torch copy_':>15}  {'torch .to()':>15}  ours/best-torch (median, best)")
    for name, frm, to in CASES:
        for s in args.sizes.split(","):
            n = parse_count(s)
            r = bench_case(frm, to, n, args.rounds)
            ratio = [r["offload"][i] / max(r["torch copy_"][i], r["torch .to()"][i]) for i in (0, 1)]
            rows.append({"case": name, "n": n, **r})
            print(f"{name:<14}{s:>9}  {fmt(r['offload'])}  {fmt(r['torch copy_'])}  {fmt(r['torch .to()'])}"
                  f"  {ratio[0]:5.2f}x {ratio[1]:5.2f}x")
    for n_t, each in [(256, 4096), (64, 262_144)]:
        r = bench_flatten(n_t, each, args.rounds)
        rows.append({"case": f"flatten {n_t}x{each} fp32->bf16", **r})
        ratio = [r["offload"][i] / r["torch copy_ loop"][i] for i in (0, 1)]
        print(f"flatten {n_t} x {each} fp32->bf16: offload {fmt(r['offload'])}, torch copy_ loop "
              f"{fmt(r['torch copy_ loop'])}, {ratio[0]:.2f}x {ratio[1]:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
