"""Training-step time of the ZeRO-3 runtime vs plain PyTorch, on a small GPT (tests/tiny_gpt.py).

Contenders (one process, interleaved rounds so machine noise hits all alike):
  torch          plain model + torch.optim.AdamW (the reference loop)
  offload <p>/<o> the same model through offload.init with params tier p and optimizer tier o
Each round runs `--steps` steps per contender after one warm-up step; the table gives the median and best
per-step time over rounds and the ratio to torch. No target: this shows what the runtime (pipelined, the
default) costs on a CPU-only box for a small model; bench_offload_step.py is the comparison with DeepSpeed.

    PYTHONPATH=. python benchmarks/bench_zero_step.py --rounds 5 --steps 3
"""
from __future__ import annotations

import argparse
import os
import sys
import statistics
import tempfile
import time

import torch
import torch.nn.functional as F

import offload

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
from tiny_gpt import build_model, make_batch  # noqa: E402  (the small GPT the tests' RSS probe uses too)

TIERS = [("device", "cpu"), ("cpu", "cpu"), ("cpu", "nvme"), ("nvme", "nvme")]


def step_fn(model, opt, rt, vocab, seq, batch):
    def step(i):
        ids, targets = make_batch(i, batch, seq, vocab, "cpu")
        loss = F.cross_entropy(model(ids).reshape(-1, vocab), targets.reshape(-1))
        loss.backward()
        if rt is not None:
            rt.clip_grad_norm_(1.0)
        else:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
    return step


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    vocab, seq, batch = 512, 64, 8
    times: dict[str, list[float]] = {"torch": []}
    for p, o in TIERS:
        times[f"offload {p}/{o}"] = []
    with tempfile.TemporaryDirectory(prefix="bench-zero-") as tmp:
        for r in range(args.rounds):
            torch.manual_seed(0)
            model = build_model(vocab, args.dim, args.layers, seq)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
            step = step_fn(model, opt, None, vocab, seq, batch)
            step(0)
            t0 = time.perf_counter()
            for i in range(args.steps):
                step(i + 1)
            times["torch"].append((time.perf_counter() - t0) / args.steps)
            for p, o in TIERS:
                cfg = offload.Config(params=p, optimizer=o, nvme_path=tmp, cpu_budget="2GiB", device_budget="1GiB")
                with offload.init(cfg) as rt:
                    model = build_model(vocab, args.dim, args.layers, seq)
                    opt = offload.AdamW(model.parameters(), lr=1e-3)
                    step = step_fn(model, opt, rt, vocab, seq, batch)
                    step(0)
                    t0 = time.perf_counter()
                    for i in range(args.steps):
                        step(i + 1)
                    times[f"offload {p}/{o}"].append((time.perf_counter() - t0) / args.steps)
    n = sum(p.numel() for p in build_model(vocab, args.dim, args.layers, seq).parameters())
    print(f"# tiny_gpt model: {n / 1e6:.2f} M params ({args.layers} blocks x dim {args.dim}), batch {batch} x seq {seq}, "
          f"threads {args.threads}, torch {torch.__version__}, load average {os.getloadavg()[0]:.1f}")
    print(f"# seconds per step, median / best over {args.rounds} interleaved rounds of {args.steps} steps")
    base = statistics.median(times["torch"])
    print(f"{'contender':<22} {'median':>8} {'best':>8}  vs torch (median)")
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"{name:<22} {med:8.3f} {min(ts):8.3f}  {med / base:5.2f}x")


if __name__ == "__main__":
    main()
