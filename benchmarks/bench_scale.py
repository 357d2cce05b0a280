"""What grows with the model, measured on the CPU (issue 42 section 1): each figure a ratio taken side by side in
one process, contenders interleaved round by round so machine noise hits all alike.

  update    A stack of big Linear layers (few big units: per-unit overhead does not dominate), fp32, every state
            resident in the cpu tier. Per step: the optimizer lane's busy time (rt.stats()["last_step"]
            ["lane_busy_s"]["optimizer"]) against the fused kernel over the same parameters (offload.AdamW /
            AdamW8bit as a drop-in on plain tensors: its opt.step() time), and the whole step against plain
            PyTorch with torch.optim.AdamW(fused=True). Goals: lane <= 1.2x kernel (AdamW8bit: 1.3x), step <= 1.15x.
            --optimizer-tier nvme: the states on nvme instead, the lane's CPU-seconds per GB it moved.
  units     A model of many small units: the runtime's CPU time per unit per step beyond plain PyTorch's.
            Goal <= 0.3 ms per unit per step.
  traffic   The host memory bandwidth (a large copy) and the bytes the CPU update reads and writes per parameter
            (the tensors the kernel touches: fp32 AdamW 28 B), against the kernel's roofline at that bandwidth.

    PYTHONPATH=. python benchmarks/bench_scale.py update --params 400M --rounds 3 --steps 3
    PYTHONPATH=. python benchmarks/bench_scale.py update --optimizer adamw8bit
    PYTHONPATH=. python benchmarks/bench_scale.py units --units 120
    PYTHONPATH=. python benchmarks/bench_scale.py traffic
    PYTHONPATH=. python benchmarks/bench_scale.py all --tiny --json out.json    # the CI size (tests/test_bench_scale.py)
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass

import torch
import torch.nn as nn

import offload
from offload.optim.schema import by_name

OPTIMIZERS = {"adamw": "adamw", "adamw8bit": "adamw8bit"}  # --optimizer -> Config.optimizer_states
GOALS = {"lane_vs_kernel": {"adamw": 1.2, "adamw8bit": 1.3}, "step_vs_torch": 1.15, "ms_per_unit": 0.3}


def parse_count(s: str) -> int:
    """'400M' -> 400_000_000 (decimal suffixes K, M, G)."""
    s = s.strip().upper()
    mult = {"K": 1e3, "M": 1e6, "G": 1e9}.get(s[-1:], 1)
    return int(float(s[:-1] if s[-1:] in "KMG" else s) * mult)


class Stack(nn.Module):
    """`layers` square Linear blocks of width `dim` (a ModuleList of one class: each block is a unit)."""

    def __init__(self, dim: int, layers: int):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(dim, dim) for _ in range(layers))

    def forward(self, x):
        for b in self.blocks:
            x = torch.tanh(b(x))
        return x


def stack_shape(params: int, layers: int) -> int:
    """The width whose `layers` square Linear layers hold about `params` parameters."""
    return max(8, int(math.sqrt(params / layers)))


def make_optimizer(name: str, params, runtime_or_kernel: str):
    """torch's fused AdamW ('torch'), or the offload family `name` (a drop-in on plain tensors or the runtime's)."""
    if runtime_or_kernel == "torch":
        return torch.optim.AdamW(params, lr=1e-3, fused=True)
    cls = offload.AdamW8bit if name == "adamw8bit" else offload.AdamW
    return cls(params, lr=1e-3)


@dataclass
class UpdateSettings:
    params: int = 400_000_000
    layers: int = 6
    batch: int = 8
    optimizer: str = "adamw"
    optimizer_tier: str = "cpu"
    rounds: int = 3
    steps: int = 3
    warmup: int = 2
    chunk_size: str | None = None


def _train_steps(model, opt, rt, x, steps: int, warmup: int, on_step=None) -> tuple[list, list, list]:
    """Run warmup + steps; per timed step: wall seconds, process CPU seconds and opt.step()'s own wall seconds."""
    wall, cpu, opt_s = [], [], []
    for i in range(warmup + steps):
        t0, c0 = time.perf_counter(), time.process_time()
        loss = model(x).square().mean()
        loss.backward()
        t1 = time.perf_counter()
        opt.step()
        t2 = time.perf_counter()
        opt.zero_grad()  # torch's default (set_to_none=True) for both contenders: what users run
        if i >= warmup:
            wall.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
            opt_s.append(t2 - t1)
            if on_step is not None:
                on_step()
    return wall, cpu, opt_s


class KernelClock:
    """Seconds spent in a family's chunk step (its fused kernel call), on whatever thread runs it: the lane's busy
    time less this is what the runtime adds around the kernel (leases, waits, Python)."""

    def __init__(self, schema):
        self.schema, self.seconds, self._step = schema, 0.0, schema.step_chunk

    def __enter__(self):
        def timed(*args):
            t0 = time.perf_counter()
            try:
                return self._step(*args)
            finally:
                self.seconds += time.perf_counter() - t0
        object.__setattr__(self.schema, "step_chunk", timed)  # (a frozen dataclass: the bench's own timing)
        return self

    def __exit__(self, *exc):
        object.__setattr__(self.schema, "step_chunk", self._step)


def bench_update(s: UpdateSettings, nvme_dir: str | None = None) -> dict:
    dim = stack_shape(s.params, s.layers)
    x = torch.randn(s.batch, dim, generator=torch.Generator().manual_seed(1))
    runs: dict[str, dict[str, list]] = {k: {"step_s": [], "opt_s": [], "lane_s": [], "lane_alone_s": [],
                                                                  "lane_kernel_s": [],
                                                                  "gb_moved": []}
                                        for k in ("torch", "kernel", "offload")}
    n = 0
    with tempfile.TemporaryDirectory(prefix="bench-scale-", dir=nvme_dir) as tmp:
        for _ in range(s.rounds):
            for who in ("torch", "kernel"):
                torch.manual_seed(0)
                model = Stack(dim, s.layers)
                n = sum(p.numel() for p in model.parameters())
                opt = make_optimizer(s.optimizer, model.parameters(), who)
                wall, _, opt_s = _train_steps(model, opt, None, x, s.steps, s.warmup)
                runs[who]["step_s"] += wall
                runs[who]["opt_s"] += opt_s
                del model, opt
                gc.collect()
            # the cpu tier: param, grad and optimizer state shards (fp32: the param is its master), 18 B a param;
            # the device tier (host memory here): the gathered units and their gradients, a few at a time
            cpu_budget = f"{max(1, math.ceil(n * 18 / 2**30))}GiB"
            if s.optimizer_tier == "nvme":  # room for the param and grad shards and the update's working chunks only
                cpu_budget = f"{n * 8 + (256 << 20)}B"
            device_budget = f"{max(1, math.ceil(8 * n / s.layers * 4 / 2**30))}GiB"  # 8 units' fp32 bytes
            cfg = offload.Config(params="cpu", optimizer=s.optimizer_tier, nvme_path=tmp, cpu_budget=cpu_budget,
                                 device_budget=device_budget, optimizer_states=OPTIMIZERS[s.optimizer],
                                 speculative_updates=False, chunk_size=s.chunk_size)
            with offload.init(cfg) as rt, KernelClock(by_name(OPTIMIZERS[s.optimizer])) as clock:
                torch.manual_seed(0)
                model = Stack(dim, s.layers)
                opt = make_optimizer(s.optimizer, model.parameters(), "offload")

                def lane():
                    last = rt.stats()["last_step"]
                    runs["offload"]["lane_s"].append(last["lane_busy_s"].get("optimizer", 0.0))

                # the step's window closes at opt.step(): the lane's busy time of step k lands in step k+1's window
                wall, _, opt_s = _train_steps(model, opt, rt, x, s.steps, s.warmup, on_step=lane)
                runs["offload"]["step_s"] += wall
                runs["offload"]["opt_s"] += opt_s
                # the lane alone: each update waited for before the next forward, so the kernel's threads have the
                # cores to themselves as in the drop-in's opt.step() (the figure above shares them with the forward)
                rt.quiesce()
                for _ in range(s.steps):
                    model(x).square().mean().backward()
                    clock.seconds = 0.0
                    opt.step()
                    rt.quiesce()
                    runs["offload"]["lane_kernel_s"].append(clock.seconds)
                    opt.zero_grad()
                    model(x).square().mean().backward()  # this update's busy time lands in the next step's window
                    opt.step()
                    runs["offload"]["lane_alone_s"].append(rt.stats()["last_step"]["lane_busy_s"].get("optimizer", 0.0))
                    rt.quiesce()
                    opt.zero_grad()
                if s.optimizer_tier == "nvme":
                    st = rt.stats()
                    moved = st["nvme_read_bytes"] + st["nvme_written_bytes"]
                    runs["offload"]["gb_moved"].append(moved / 1e9 / st["steps"])  # per step, on average
                del model, opt
            gc.collect()
            print(f"# round done: {({who: [round(t, 3) for t in r['step_s']] for who, r in runs.items()})}, lane "
                  f"{[round(t, 3) for t in runs['offload']['lane_alone_s']]}", file=sys.stderr, flush=True)
    med = {who: {k: statistics.median(v) if v else None for k, v in r.items()} for who, r in runs.items()}
    best = {who: {k: min(v) if v else None for k, v in r.items()} for who, r in runs.items()}
    kernel = med["kernel"]["opt_s"]
    out = {
        "model": f"{s.layers} x Linear({dim}, {dim}), {n / 1e6:.1f}M params, fp32, batch {s.batch}",
        "params": n, "optimizer": s.optimizer, "optimizer_tier": s.optimizer_tier,
        "median": med, "best": best,
        "lane_vs_kernel": med["offload"]["lane_alone_s"] / kernel,
        "lane_overlapped_vs_kernel": med["offload"]["lane_s"] / kernel,
        "lane_kernel_vs_kernel": med["offload"]["lane_kernel_s"] / kernel,
        "step_vs_torch": med["offload"]["step_s"] / med["torch"]["step_s"],
        "kernel_params_per_s": n / kernel,
    }
    if s.optimizer_tier == "nvme":
        gb = statistics.median(runs["offload"]["gb_moved"])
        out["gb_moved_per_step"] = gb
        out["lane_s_per_gb_moved"] = med["offload"]["lane_alone_s"] / gb if gb else None
    return out


def print_update(r: dict) -> None:
    goal = GOALS["lane_vs_kernel"][r["optimizer"]]
    print(f"# update path: {r['model']}, {r['optimizer']} states on {r['optimizer_tier']}")
    print(f"{'contender':<10} {'step med':>9} {'step best':>9} {'opt.step':>9} {'lane':>9} {'lane alone':>10}")
    for who in ("torch", "kernel", "offload"):
        m, b = r["median"][who], r["best"][who]
        lane = "" if m["lane_s"] is None else f"{m['lane_s']:9.3f} {m['lane_alone_s']:10.3f}"
        print(f"{who:<10} {m['step_s']:9.3f} {b['step_s']:9.3f} {m['opt_s']:9.3f} {lane}")
    print(f"the kernel calls inside the lane: {r['median']['offload']['lane_kernel_s']:.3f} s "
          f"({r['lane_kernel_vs_kernel']:.2f}x the drop-in's)")
    print(f"lane alone / kernel {r['lane_vs_kernel']:.2f}x (goal <= {goal}x; overlapped with the forward "
          f"{r['lane_overlapped_vs_kernel']:.2f}x)   step / torch {r['step_vs_torch']:.2f}x "
          f"(goal <= {GOALS['step_vs_torch']}x)   kernel {r['kernel_params_per_s'] / 1e6:.0f} M params/s")
    if r.get("lane_s_per_gb_moved") is not None:
        print(f"{r['gb_moved_per_step']:.2f} GB a step to and from nvme; the lane alone is busy "
              f"{r['lane_s_per_gb_moved']:.3f} s per GB moved")


@dataclass
class UnitSettings:
    units: int = 120
    dim: int = 64
    batch: int = 4
    rounds: int = 3
    steps: int = 5
    warmup: int = 2


def bench_units(s: UnitSettings) -> dict:
    """Plain PyTorch (fused AdamW) and the runtime over `units` Linear(dim, dim) units, states in the cpu tier:
    process CPU seconds (every thread) and wall seconds per step; their difference per unit."""
    x = torch.randn(s.batch, s.dim, generator=torch.Generator().manual_seed(1))
    runs = {k: {"wall_s": [], "cpu_s": []} for k in ("torch", "offload")}
    for _ in range(s.rounds):
        torch.manual_seed(0)
        model = Stack(s.dim, s.units)
        wall, cpu, _ = _train_steps(model, torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True), None, x,
                                    s.steps, s.warmup)
        runs["torch"]["wall_s"] += wall
        runs["torch"]["cpu_s"] += cpu
        cfg = offload.Config(params="cpu", optimizer="cpu", cpu_budget="1GiB", device_budget="1GiB")
        with offload.init(cfg) as rt:
            torch.manual_seed(0)
            model = Stack(s.dim, s.units)
            wall, cpu, _ = _train_steps(model, offload.AdamW(model.parameters(), lr=1e-3), rt, x, s.steps, s.warmup)
            rt.quiesce()
            units = len(rt.units) if hasattr(rt, "units") else s.units
        runs["offload"]["wall_s"] += wall
        runs["offload"]["cpu_s"] += cpu
    med = {who: {k: statistics.median(v) for k, v in r.items()} for who, r in runs.items()}
    return {
        "model": f"{s.units} x Linear({s.dim}, {s.dim}) units, fp32, batch {s.batch}", "units": s.units,
        "median": med,
        "cpu_ms_per_unit": (med["offload"]["cpu_s"] - med["torch"]["cpu_s"]) / s.units * 1e3,
        "wall_ms_per_unit": (med["offload"]["wall_s"] - med["torch"]["wall_s"]) / s.units * 1e3,
        "runtime_units": units,
    }


def print_units(r: dict) -> None:
    print(f"# per-unit overhead: {r['model']}")
    print(f"{'contender':<10} {'wall/step':>10} {'cpu/step':>10}")
    for who, m in r["median"].items():
        print(f"{who:<10} {m['wall_s']:10.4f} {m['cpu_s']:10.4f}")
    print(f"runtime over torch: {r['cpu_ms_per_unit']:.3f} ms CPU per unit per step (goal <= "
          f"{GOALS['ms_per_unit']} ms), {r['wall_ms_per_unit']:.3f} ms wall")


def memory_bandwidth(nbytes: int, repeats: int = 5) -> float:
    """Bytes per second a large tensor copy reads plus writes (the best of `repeats`)."""
    a = torch.ones(nbytes // 4)
    b = torch.empty_like(a)
    b.copy_(a)  # (first touch of b's pages out of the clock)
    best = min(_timed(lambda: b.copy_(a)) for _ in range(repeats))
    return 2 * nbytes / best


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def update_bytes_per_param(optimizer: str) -> float:
    """What the fused update reads and writes per fp32 parameter with an fp32 gradient: the gradient read, the
    master and every stored state read and written (fp32 AdamW: 4 + 2 x (4 + 4 + 4) = 28 B)."""
    return 4 + 2 * (4 + by_name(OPTIMIZERS[optimizer]).bytes_per_element)


@dataclass
class TrafficSettings:
    params: int = 64_000_000
    copy_bytes: int = 1 << 30
    repeats: int = 5


def bench_traffic(s: TrafficSettings) -> dict:
    """The machine's copy bandwidth and, per optimizer family, the drop-in kernel's time over one `params` buffer
    against its roofline (bytes per param x params / bandwidth)."""
    bw = memory_bandwidth(s.copy_bytes, s.repeats)
    out = {"copy_GBps": bw / 1e9, "params": s.params, "families": {}}
    for name in OPTIMIZERS:
        p = nn.Parameter(torch.randn(s.params, generator=torch.Generator().manual_seed(0)))
        p.grad = torch.randn(s.params, generator=torch.Generator().manual_seed(1))
        opt = make_optimizer(name, [p], "kernel")
        opt.step()  # states created (first touch) out of the clock
        best = min(_timed(opt.step) for _ in range(s.repeats))
        per = update_bytes_per_param(name)
        roof = per * s.params / bw
        out["families"][name] = {"bytes_per_param": per, "kernel_s": best, "roofline_s": roof,
                                 "kernel_GBps": per * s.params / best / 1e9, "vs_roofline": best / roof}
        del p, opt
        gc.collect()
    return out


def print_traffic(r: dict) -> None:
    print(f"# host memory traffic: a large copy moves {r['copy_GBps']:.1f} GB/s (read + write); the drop-in kernel "
          f"over {r['params'] / 1e6:.0f}M fp32 params")
    print(f"{'family':<10} {'B/param':>8} {'kernel s':>9} {'roofline s':>10} {'GB/s':>7} {'x roofline':>10}")
    for name, f in r["families"].items():
        print(f"{name:<10} {f['bytes_per_param']:8.2f} {f['kernel_s']:9.4f} {f['roofline_s']:10.4f} "
              f"{f['kernel_GBps']:7.1f} {f['vs_roofline']:10.2f}")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=("update", "units", "traffic", "all"))
    ap.add_argument("--tiny", action="store_true", help="the CI size: seconds, figures only checked for sanity")
    ap.add_argument("--params", default="400M")
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--optimizer", choices=sorted(OPTIMIZERS), default="adamw")
    ap.add_argument("--optimizer-tier", choices=("cpu", "nvme"), default="cpu")
    ap.add_argument("--nvme-dir", default=None, help="where the nvme tier's swap files go (default: the temp dir)")
    ap.add_argument("--units", type=int, default=120, help="units: how many small units")
    ap.add_argument("--traffic-params", default="64M", help="traffic: the kernel's buffer")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=2, help="update: untimed steps per contender and round")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--json", default=None, help="also write the figures here")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    results = {}
    if args.what in ("update", "all"):
        s = UpdateSettings(params=parse_count(args.params), layers=args.layers, optimizer=args.optimizer,
                           optimizer_tier=args.optimizer_tier, rounds=args.rounds, steps=args.steps,
                           warmup=args.warmup)
        if args.tiny:
            s.params, s.layers, s.rounds, s.steps, s.warmup = 200_000, 4, 1, 2, 1
        results["update"] = r = bench_update(s, args.nvme_dir)
        print_update(r)
    if args.what in ("units", "all"):
        u = UnitSettings(units=args.units)
        if args.tiny:
            u.units, u.dim, u.rounds, u.steps, u.warmup = 12, 16, 1, 2, 1
        results["units"] = r = bench_units(u)
        print_units(r)
    if args.what in ("traffic", "all"):
        t = TrafficSettings(params=parse_count(args.traffic_params))
        if args.tiny:
            t.params, t.copy_bytes, t.repeats = 1_000_000, 16 << 20, 2
        results["traffic"] = r = bench_traffic(t)
        print_traffic(r)
    print(f"# torch {torch.__version__}, threads {torch.get_num_threads()}, load average {os.getloadavg()[0]:.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
