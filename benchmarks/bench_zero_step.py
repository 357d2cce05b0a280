"""Training-step time of the ZeRO-3 runtime vs plain PyTorch, on a small GPT (tests/tiny_gpt.py).

Contenders (one process, interleaved rounds so machine noise hits all alike), each computing on the compute
device (the GPU where CUDA is, else the CPU):
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


def compute_device() -> torch.device:
    """cuda:(LOCAL_RANK % device_count) where CUDA is available, else the CPU: where the offload runtime
    computes, so the torch reference runs there too."""
    if not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())


def sync(device: torch.device) -> None:
    """Wait for the work queued on `device` (a GPU runs behind the host; the CPU has nothing queued)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def step_fn(model, opt, rt, vocab, seq, batch, device):
    def step(i):
        ids, targets = make_batch(i, batch, seq, vocab, device)
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
    device = compute_device()
    if device.type == "cuda":
        torch.cuda.set_device(device)  # this process's GPU, before anything touches CUDA
    vocab, seq, batch = 512, 64, 8
    times: dict[str, list[float]] = {"torch": []}
    for p, o in TIERS:
        times[f"offload {p}/{o}"] = []
    with tempfile.TemporaryDirectory(prefix="bench-zero-") as tmp:
        for r in range(args.rounds):
            torch.manual_seed(0)
            model = build_model(vocab, args.dim, args.layers, seq).to(device)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
            step = step_fn(model, opt, None, vocab, seq, batch, device)
            step(0)
            sync(device)  # the warm-up step stays out of the clock
            t0 = time.perf_counter()
            for i in range(args.steps):
                step(i + 1)
            sync(device)  # the clock stops when the GPU has run the steps, not when the host queued them
            times["torch"].append((time.perf_counter() - t0) / args.steps)
            for p, o in TIERS:
                cfg = offload.Config(params=p, optimizer=o, nvme_path=tmp, cpu_budget="2GiB", device_budget="1GiB")
                with offload.init(cfg) as rt:
                    model = build_model(vocab, args.dim, args.layers, seq)
                    opt = offload.AdamW(model.parameters(), lr=1e-3)
                    step = step_fn(model, opt, rt, vocab, seq, batch, rt.device)
                    step(0)
                    sync(rt.device)  # the warm-up step stays out of the clock
                    t0 = time.perf_counter()
                    for i in range(args.steps):
                        step(i + 1)
                    sync(rt.device)  # the clock stops when the GPU has run the steps, not when the host queued them
                    times[f"offload {p}/{o}"].append((time.perf_counter() - t0) / args.steps)
    n = sum(p.numel() for p in build_model(vocab, args.dim, args.layers, seq).parameters())
    print(f"# tiny_gpt model: {n / 1e6:.2f} M params ({args.layers} blocks x dim {args.dim}), batch {batch} x seq {seq}, "
          f"threads {args.threads}, device {device}, torch {torch.__version__}, "
          f"load average {os.getloadavg()[0]:.1f}")
    print(f"# seconds per step, median / best over {args.rounds} interleaved rounds of {args.steps} steps")
    base = statistics.median(times["torch"])
    print(f"{'contender':<22} {'median':>8} {'best':>8}  vs torch (median)")
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"{name:<22} {med:8.3f} {min(ts):8.3f}  {med / base:5.2f}x")


if __name__ == "__main__":
    main()
