"""The offload step in the GPU regime, emulated on a CPU-only machine: each block's compute is a timed wait
(time.sleep: the GIL released, no core used) of its FLOPs at a given rate, while everything else is real:
full-size parameters and gradients, the gathers and reduces, the fused CPU AdamW, the NVMe engine, the
budgets. On a GPU the accelerator computes while the host's cores and drives do the offload work; on this
machine the compute would otherwise share the same cores, so bench_offload_step.py cannot show whether the
pipeline hides the I/O and the CPU Adam behind compute. Here it can.

Model (`EmulatedModel`): `--layers` blocks (`EmulatedBlock`, the units), each with a transformer layer's
weight shapes (qkv 3d x d, proj d x d, fc1 ff x d, fc2 d x ff: 4 d^2 + 2 d ff parameters, no biases), and a
root scale vector (d). Input: bf16 activations (micro-batch x seq x d) from a seeded generator, the same for
every contender; loss = (model(x) - 1)^2 summed over features, mean over tokens, in fp32 (the gradient's
norm is above 1: clipping at 1.0 scales every step). A block is `EmulatedCompute`, an autograd.Function:
  forward   sleeps 2 * its params * tokens / rate, returns x + sum_j mean(W_j) (one memory-bound read
            of its weights),
  backward  sleeps twice as long, returns the exact gradients of that function: the input's gradient is
            the output's, W_j's is full-size, sum(grad) / numel(W_j) broadcast (one memory-bound write, no
            matmul), in the parameter's dtype.
So the runtime's gradient hooks, reduces, clip norms and optimizer see real tensors of the real size.
Default: 8 blocks of d=1024, ff=4096 (100.7M params), micro-batch 2 x seq 1024 per rank, bf16, clip 1.0
every step, AdamW (lr 1e-4, wd 0.01). --clip 1e9: a max norm the gradients never reach (the coefficient is
exactly 1, the default's speculative updates run under the backward and commit). --clip 1e9 --clip-every 2:
every second step clips at 1.0, right after one that did not: each of those is speculated and missed (the update
paid twice), the figure of what a miss costs against offload-nospec on the same steps.

Contenders (each in its own child process, interleaved rounds, bench_offload_step's machinery):
  offload        Config(params="nvme", optimizer="nvme", cpu_budget="512MiB", device_budget="1GiB",
                 compute_dtype="bf16"): the exact default path (pipeline on, speculative updates at steps
                 after one that did not clip: offload/zero/update/speculation.py). The device budget (on this
                 machine a region of host memory) holds the fp32 gradient shards beside the gathered units,
                 as a GPU's memory would (Config.grads="auto" puts them there).
  offload-inbwd  the same with update_in_backward=True (opt-in).
  offload-nospec the same with speculative_updates=False: every update waits for opt.step() (when named).
  offload-fp16   the default in fp16 through offload.GradScaler (scale, unscale_, clip, step, update; scale 1: the
                 emulated loss overflows fp16 gradients at larger ones) (when named).
  offload-sync   the same with pipeline=False (no prefetch, no overlap).
  torch          plain torch in memory, the same emulated blocks (fp32 params, bf16 activations),
                 torch.optim.AdamW (fused where it works), clip_grad_norm_: the in-memory reference. One
                 process with one rank's micro-batch (with --world-size 2: one GPU's share, no all-reduce).
  deepspeed      DeepSpeed ZeRO-3, offload_param and offload_optimizer on nvme (bench_offload_step's
                 config), bf16, gradient_clipping 1.0, DeepSpeedCPUAdam; the same waits.
                 --ds-no-prefetch sets stage3_prefetch_bucket_size 0.
  offload-pcpu   params="cpu", optimizer="nvme" (for the plan's check; run at --plan-ratio)
  offload-cpu    params="cpu", optimizer="cpu", cpu_budget --cpu-budget-all (for the plan's check)

The rate sweep: a calibration child (the default offload contender with no wait) gives the nvme bytes per
step (they do not depend on the rate); the I/O floor = read bytes / read bandwidth + written bytes / write
bandwidth (offload's AioEngine, measured by bench_offload_step's probe); for each --ratios value r the rate
is chosen so that the step's emulated compute = r x the I/O floor. --emulate-gpu TFLOPS[,TFLOPS] gives the
rates instead (no calibration).

Reported per rate and contender: s/step (median of rounds), the bound max(compute, io, adam) with
  compute = the emulated waits per step (6 x block params x tokens per rank / rate),
  io      = the contender's own nvme bytes per step / the engine's bandwidth (offload: rt.stats(); DeepSpeed:
            /proc/self/io of its processes; with 2 ranks summed: one disk),
  adam    = offload.AdamW over the model's shapes in memory: its CPU seconds / the cores,
efficiency = bound / step; the step's split (rt.stats()["last_step"] of every timed step, medians: compute
= the wall time not spent waiting, waits per queue, lanes' busy time); peak RSS; CPU seconds per step by
thread; step / torch's step; DeepSpeed's step / this step. A timeline PNG of the default contender's last
timed step per rate (--out-dir). The plan's check: offload/plan/step_time.predict with this model (an
adapter: params = the model's, no attention term), the emulated rate at mfu 1 and this machine's measured
bandwidths and Adam rate, on the placement each offload contender ran with, against its measured step.

Reproduce (from the repository root):
    python benchmarks/bench_emulated_gpu.py --rounds 2 --steps 3 --warmup 2 --json emu.json --out-dir emu
    python benchmarks/bench_emulated_gpu.py --world-size 2 --threads 1 --rounds 1 --json emu2.json --out-dir emu2
    # smallest configuration (the test's):
    python benchmarks/bench_emulated_gpu.py --layers 2 --dim 64 --ff 256 --seq 16 --contenders offload,offload-sync,torch \\
        --emulate-gpu 0.0005 --rounds 1 --steps 2 --warmup 1 --cpu-budget 64MiB --device-budget 64MiB \\
        --probe-bytes 16MiB --json small.json
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_offload_step as bso  # noqa: E402  (Settings, timing, children, rounds, probes, DeepSpeed config)

CONTENDERS = ("offload", "offload-inbwd", "offload-sync", "torch", "deepspeed")
PLAN_CONTENDERS = ("offload-pcpu", "offload-cpu")
# run when named in --contenders: offload.AdamW8bit; the default without speculative updates (the exact path that
# waits for opt.step()); fp16 with the loss scaler
OPT_IN = ("offload-8bit", "offload-nospec", "offload-fp16")
OFFLOAD = ("offload", "offload-inbwd", "offload-sync") + PLAN_CONTENDERS + OPT_IN
DISTRIBUTED = OFFLOAD + ("deepspeed",)
SCRIPT = os.path.abspath(__file__)
# every row of the summary table has these (a failed contender: "rounds_ok", "rounds_failed" and "error")
ROW_FIELDS = ("median_s", "best_s", "rounds_s", "peak_rss_bytes", "final_loss", "cpu_s_per_step",
              "cpu_s_per_step_by_thread", "compute_s", "slept_s_per_step", "io_s", "adam_s", "bound_s", "binds",
              "efficiency", "cores_s", "split", "vs_torch", "deepspeed_over_this", "losses")
RATE_FIELDS = ("ratio", "tflops", "compute_s", "io_floor_s", "io_floor_run_s", "table", "runs", "trace", "timeline_png")


@dataclasses.dataclass
class EmuSettings(bso.Settings):
    layers: int = 8           # blocks
    dim: int = 1024
    ff: int = 4096
    seq: int = 1024
    batch: int = 2            # micro-batch per rank
    tflops: float = 1.0       # the emulated accelerator's rate; 0: no wait (the calibration run)
    cpu_budget: str = "512MiB"
    device_budget: str = "1GiB"
    cpu_budget_all: str = "3GiB"  # offload-cpu: params and optimizer states in host memory
    probe_bytes: int = 1 << 30    # the nvme bandwidth probe's file
    ds_prefetch: bool = True
    clip_every: int = 0       # > 0: every clip_every-th step clips at 1.0 (the others at `clip`): speculation misses

    def clip_at(self, i: int) -> float:
        """The max norm of step i (from 0, warm-up included)."""
        return 1.0 if self.clip_every and i % self.clip_every == self.clip_every - 1 else self.clip


# ---- the emulated accelerator -------------------------------------------------------------------

SLEPT = {"s": 0.0}       # seconds this process has waited in emulated compute
ON_COMPUTE = {"fn": None}  # fn(name, t0, t1): each emulated compute, for the trace (the offload children)


def _wait(seconds: float, name: str) -> None:
    t0 = time.perf_counter()
    if seconds > 0:
        time.sleep(seconds)
    t1 = time.perf_counter()
    SLEPT["s"] += t1 - t0
    if ON_COMPUTE["fn"] is not None:
        ON_COMPUTE["fn"](name, t0, t1)


def block_params(dim: int, ff: int) -> int:
    return 4 * dim * dim + 2 * dim * ff


def forward_wait_s(params: int, tokens: int, tflops: float) -> float:
    """A forward's FLOPs (2 per parameter per token) at `tflops`; 0 when tflops is 0 (no wait)."""
    return 2.0 * params * tokens / (tflops * 1e12) if tflops > 0 else 0.0


def step_compute_s(s: EmuSettings) -> float:
    """The emulated waits of one step on one rank: forward + backward (twice the forward) of every block."""
    return 3 * s.layers * forward_wait_s(block_params(s.dim, s.ff), s.batch * s.seq, s.tflops)


def emulated_compute():
    import torch

    class EmulatedCompute(torch.autograd.Function):
        """forward: wait its FLOPs, return x + sum_j mean(W_j); backward: wait twice as long,
        return the exact gradients (the input's passed through, each weight's a scaled broadcast)."""

        @staticmethod
        def forward(ctx, x, tflops, index, *weights):
            n = sum(w.numel() for w in weights)
            wait = forward_wait_s(n, x.shape[0] * x.shape[1], tflops)
            _wait(wait, f"gpu:fwd {index}")
            shift = sum(w.sum(dtype=torch.float32) / w.numel() for w in weights)
            ctx.specs = [(w.shape, w.dtype, w.device, 1.0 / w.numel()) for w in weights]
            ctx.wait, ctx.index = 2 * wait, index
            return x + shift

        @staticmethod
        def backward(ctx, grad):
            _wait(ctx.wait, f"gpu:bwd {ctx.index}")
            total = grad.sum(dtype=torch.float32)
            grads = [torch.empty(shape, dtype=dtype, device=device).fill_(total * scale)
                     for shape, dtype, device, scale in ctx.specs]
            return (grad, None, None, *grads)

    return EmulatedCompute


def build_model(s: EmuSettings):
    import torch
    import torch.nn as nn

    fn = emulated_compute()

    class EmulatedBlock(nn.Module):
        """A transformer layer's weights (no biases) whose compute is emulated. The weights are the block's
        own parameters (no submodules), so ZeRO-3 engines gather them with the block."""

        def __init__(self, index: int):
            super().__init__()
            d, f = s.dim, s.ff
            self.index = index
            self.qkv = nn.Parameter(torch.empty(3 * d, d))
            self.proj = nn.Parameter(torch.empty(d, d))
            self.fc1 = nn.Parameter(torch.empty(f, d))
            self.fc2 = nn.Parameter(torch.empty(d, f))
            self.reset_parameters()

        def reset_parameters(self):
            for w in (self.qkv, self.proj, self.fc1, self.fc2):
                nn.init.uniform_(w, -1.0 / math.sqrt(w.shape[1]), 1.0 / math.sqrt(w.shape[1]))

        def forward(self, x):
            return fn.apply(x, s.tflops, self.index, self.qkv, self.proj, self.fc1, self.fc2)

    class EmulatedModel(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList(EmulatedBlock(i) for i in range(s.layers))
            self.scale = nn.Parameter(torch.ones(s.dim))

        def reset_parameters(self):
            nn.init.ones_(self.scale)

        def forward(self, x):
            for block in self.blocks:
                x = block(x)
            return x * self.scale

    return EmulatedModel()


def model_shapes(s: EmuSettings) -> list:
    d, f = s.dim, s.ff
    return [(3 * d, d), (d, d), (f, d), (d, f)] * s.layers + [(d,)]


def make_input(s: EmuSettings, step: int, rank: int = 0, ranks: int = 1):
    """Step `step`'s global batch of bf16 activations (global_batch x seq x dim, seeded), this rank's share."""
    import torch

    g = torch.Generator().manual_seed(s.seed * 1_000_003 + step)
    x = torch.randn(s.global_batch, s.seq, s.dim, generator=g)
    per = s.global_batch // ranks
    return x[rank * per:(rank + 1) * per].to(torch.bfloat16)


def loss_of(out):
    """Squared distance to 1 summed over the features, mean over tokens (its gradient's norm is above 1:
    clipping at 1.0 scales every step)."""
    return (out.float() - 1.0).pow(2).sum(-1).mean()


# ---- contenders (children) ----------------------------------------------------------------------

def _per_step_slept(step):
    """`step` wrapped: the emulated waits of each call recorded in the returned list."""
    slept = []

    def wrapped(i):
        before = SLEPT["s"]
        loss = step(i)
        slept.append(SLEPT["s"] - before)
        return loss

    return wrapped, slept


def _split(stats: list[dict]) -> dict:
    """Medians of rt.stats()["last_step"] over steps: wall, compute, waits per queue, lanes' busy time, and each
    link's bytes and busy seconds."""
    import numpy as np

    med = lambda xs: float(np.median(xs)) if xs else 0.0  # noqa: E731
    queues = sorted({q for st in stats for q in st["wait_s"]})
    lanes = sorted({q for st in stats for q in st["lane_busy_s"]})
    links = sorted({q for st in stats for q in st.get("links", {})})
    return {"wall_s": med([st["wall_s"] for st in stats]), "compute_s": med([st["compute_s"] for st in stats]),
            "wait_s": {q: med([st["wait_s"].get(q, 0.0) for st in stats]) for q in queues},
            "lane_busy_s": {q: med([st["lane_busy_s"].get(q, 0.0) for st in stats]) for q in lanes},
            "links": {q: {k: med([st.get("links", {}).get(q, {}).get(k, 0) for st in stats])
                          for k in ("bytes", "busy_s")} for q in links},
            "steps": len(stats)}


def run_torch(s: EmuSettings) -> dict:
    import torch

    bso.setup_threads(s)
    torch.manual_seed(s.seed)
    model = build_model(s)
    n_params = sum(p.numel() for p in model.parameters())
    try:
        opt = torch.optim.AdamW(model.parameters(), lr=s.lr, weight_decay=s.weight_decay, fused=True)
        impl = "fused"
    except (RuntimeError, TypeError) as exc:
        opt = torch.optim.AdamW(model.parameters(), lr=s.lr, weight_decay=s.weight_decay, foreach=True)
        impl = f"foreach (fused failed: {exc})"
    grad_shapes_ok = []

    def step(i):
        loss = loss_of(model(make_input(s, i, 0, s.world_size)))
        loss.backward()
        grad_shapes_ok.append(all(p.grad is not None and p.grad.shape == p.shape for p in model.parameters()))
        torch.nn.utils.clip_grad_norm_(model.parameters(), s.clip_at(i))
        opt.step()
        opt.zero_grad()
        return loss.item()

    wrapped, slept = _per_step_slept(step)
    out = bso.timed_steps(s, wrapped)
    out.update(n_params=n_params, optimizer=f"torch.optim.AdamW {impl}", processes=1, batch_per_process=s.batch,
               peak_rss_bytes=[bso.peak_rss_bytes()], slept_step_s=slept[-s.steps:],
               grad_shapes_ok=all(grad_shapes_ok))
    return out


def offload_config(name: str, s: EmuSettings) -> dict:
    cfg = dict(params="nvme", optimizer="nvme", cpu_budget=s.cpu_budget, pipeline=True, update_in_backward=False,
               compute_dtype="bf16")
    if name == "offload-inbwd":
        cfg["update_in_backward"] = True
    elif name == "offload-sync":
        cfg["pipeline"] = False
    elif name == "offload-8bit":
        cfg["optimizer_states"] = "adamw8bit"
    elif name == "offload-nospec":
        cfg["speculative_updates"] = False
    elif name == "offload-fp16":
        cfg["compute_dtype"] = "fp16"
    elif name == "offload-pcpu":
        cfg["params"] = "cpu"
    elif name == "offload-cpu":
        cfg.update(params="cpu", optimizer="cpu", cpu_budget=s.cpu_budget_all)
    return cfg


def run_offload(s: EmuSettings, name: str) -> dict:
    import torch.distributed as dist

    import offload
    import offload.telemetry as telemetry

    bso.setup_threads(s)
    _, world = bso.rank_and_world()
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("gloo")  # ours, so the per-rank stats can be gathered after the block
    chosen = offload_config(name, s)
    cfg = offload.Config(nvme_path=s.nvme_dir, device_budget=s.device_budget, seed=s.seed, **chosen)
    ON_COMPUTE["fn"] = lambda n, t0, t1: telemetry.record(n, telemetry.Lane.MAIN, t0, t1)
    with offload.init(cfg) as rt:
        model = build_model(s)  # built inside: materialized and sharded unit by unit
        optimizer = offload.AdamW8bit if name == "offload-8bit" else offload.AdamW
        opt = optimizer(model.parameters(), lr=s.lr, weight_decay=s.weight_decay)
        n_params = sum(p.numel() for p in model.parameters())
        splits = []
        # fp16: the emulated loss (about 2e3) overflows fp16 gradients at the usual first scales, which a real run's
        # scaler backs off from in its first steps; here every timed step must step, so it starts at 1
        # (disabled: passes every call through)
        scaler = offload.GradScaler(init_scale=1.0, enabled=cfg.compute_dtype == "fp16")

        def step(i):
            loss = loss_of(model(make_input(s, i, rt.rank, rt.world_size).to(rt.device, rt.compute_dtype)))
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            rt.clip_grad_norm_(s.clip_at(i))
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            splits.append(rt.stats()["last_step"])
            return loss.item()

        trace_hooks = None
        if s.trace:
            def save():
                if rt.rank == 0:
                    telemetry.save_trace(s.trace)
                else:
                    telemetry.stop_trace()

            trace_hooks = (telemetry.start_trace, save)
        marks = []
        wrapped, slept = _per_step_slept(step)
        out = bso.timed_steps(s, wrapped, drain=rt.quiesce, at_start=lambda: marks.append(rt.stats()),
                              trace_hooks=trace_hooks)
        before, after = marks[0], rt.stats()
        tiers = {"params": rt.params_tier, "optimizer": rt.optimizer_tier, "grads": rt.grads_tier}
        tiers = {k: getattr(v, "value", v) for k, v in tiers.items()}
        units = len(rt.units)
    out.update(bso.over_ranks(s, out, before, after))
    if world > 1:
        dist.destroy_process_group()
    out.update(n_params=n_params, units=units, config=chosen, tiers=tiers, batch_per_process=s.batch,
               speculation=after["speculation"], loss_scale=after["loss_scale"],
               processes=world, slept_step_s=slept[-s.steps:], split=_split(splits[-s.steps:]),
               last_steps=splits[-s.steps:], trace=s.trace)
    return out


def ds_config(s: EmuSettings) -> dict:
    cfg = bso.deepspeed_config(s, largest=max(a * b for a, b in model_shapes(s)[:4]))
    if not s.ds_prefetch:
        cfg["zero_optimization"]["stage3_prefetch_bucket_size"] = 0
    return cfg


def run_deepspeed(s: EmuSettings) -> dict:
    import deepspeed
    import torch
    import torch.distributed as dist

    bso.setup_threads(s)
    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    config = ds_config(s)
    torch.manual_seed(s.seed)
    with deepspeed.zero.Init(config_dict_or_path=config):
        model = build_model(s)
    engine, optimizer, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    n_params = sum(p.ds_numel for p in model.parameters())

    def step(i):
        loss = loss_of(engine(make_input(s, i, rank, world)))
        engine.backward(loss)
        engine.step()  # clips to gradient_clipping, steps, zeroes the gradients
        return loss.item()

    wrapped, slept = _per_step_slept(step)
    out = bso.timed_steps(s, wrapped)
    per_rank = bso.gather_ranks({"peak_rss_bytes": bso.peak_rss_bytes(), "proc_io_per_step": out["proc_io_per_step"],
                                 "cpu_s_per_step": out["cpu_s_per_step"],
                                 "cpu_s_per_step_by_thread": out["cpu_s_per_step_by_thread"]}, s.nvme_dir)
    out.update(n_params=n_params, batch_per_process=s.batch, processes=world,
               peak_rss_bytes=[r["peak_rss_bytes"] for r in per_rank],
               cpu_s_per_step=sum(r["cpu_s_per_step"] for r in per_rank),
               cpu_s_per_step_by_thread=bso.sum_by_name(r["cpu_s_per_step_by_thread"] for r in per_rank),
               per_rank_proc_io_per_step=[r["proc_io_per_step"] for r in per_rank],
               slept_step_s=slept[-s.steps:], ds_prefetch=s.ds_prefetch, ds_config=config,
               optimizer=type(getattr(optimizer, "optimizer", optimizer)).__name__)
    if hasattr(engine, "destroy"):
        engine.destroy()
    return out


def probe_nvme(s: EmuSettings) -> dict:
    return bso.probe_nvme(s, size=s.probe_bytes, chunk=min(64 << 20, s.probe_bytes // 4))


CHILDREN = {
    "torch": run_torch,
    "deepspeed": run_deepspeed,
    "probe-nvme": probe_nvme,
    "probe-adam": lambda s: bso.probe_adam(s, shapes=model_shapes(s)),
    "calibrate": lambda s: run_offload(s, "offload"),
    **{name: (lambda n: lambda s: run_offload(s, n))(name) for name in OFFLOAD},
}


def child_main(name: str, settings_json: str) -> None:
    s = EmuSettings(**json.loads(settings_json))
    result = CHILDREN[name](s)
    result["contender"] = name
    bso.emit(result)


def spawn(name: str, s: EmuSettings) -> dict:
    return bso.spawn(name, s, script=SCRIPT, distributed=DISTRIBUTED + ("calibrate",))


# ---- parent: bound, split, plan --------------------------------------------------------------------

def io_s(row: dict, nvme: dict) -> float:
    return row["read"] / nvme["read_Bps"] + row["written"] / nvme["write_Bps"]


def bytes_moved(row: dict) -> dict | None:
    """nvme bytes per step: offload's rt.stats() count, else the processes' disk bytes (/proc/self/io)."""
    if "nvme_read_bytes_per_step" in row:
        return {"read": row["nvme_read_bytes_per_step"], "written": row["nvme_written_bytes_per_step"],
                "source": "rt.stats()"}
    pio = row.get("proc_io_per_step")
    if pio and (pio["read_bytes"] or pio["write_bytes"]):
        return {"read": pio["read_bytes"], "written": pio["write_bytes"], "source": "/proc/self/io"}
    return None


def summarize_rate(runs: dict, s: EmuSettings, probes: dict) -> dict:
    """bench_offload_step's table (medians over rounds) and, per contender, the bound, the split and ratios."""
    import numpy as np

    table = bso.summarize(runs, {})["table"]
    nvme, adam = probes["probe-nvme"], probes["probe-adam"]
    compute = step_compute_s(s)
    adam_term = adam["adam_cpu_s"] / bso.CORES
    torch_s = table.get("torch", {}).get("median_s")
    ds_s = table.get("deepspeed", {}).get("median_s")
    for name, row in table.items():
        ok = [r for r in runs[name] if "error" not in r]
        if not ok:
            row["error"] = runs[name][-1].get("error") if runs[name] else "not run"
            continue
        moved = bytes_moved(row)
        io = io_s(moved, nvme) if moved else 0.0
        terms = {"compute": compute, "io": io, "adam": adam_term if name != "torch" else 0.0}
        binds = max(terms, key=terms.get)
        row.update(compute_s=compute, io_s=io, io_bytes=moved, adam_s=terms["adam"], bound_s=terms[binds],
                   binds=binds, efficiency=terms[binds] / row["median_s"], cores_s=row["cpu_s_per_step"] / bso.CORES,
                   slept_s_per_step=float(np.median([np.mean(r["slept_step_s"]) for r in ok])),
                   vs_torch=row["median_s"] / torch_s if torch_s else None,
                   deepspeed_over_this=ds_s / row["median_s"] if ds_s else None,
                   losses=ok[-1]["losses"], split=None)
        splits = [r["split"] for r in ok if r.get("split")]
        if splits:
            keys_w = sorted({q for sp in splits for q in sp["wait_s"]})
            keys_l = sorted({q for sp in splits for q in sp["lane_busy_s"]})
            row["split"] = {"wall_s": float(np.median([sp["wall_s"] for sp in splits])),
                            "compute_s": float(np.median([sp["compute_s"] for sp in splits])),
                            "wait_s": {q: float(np.median([sp["wait_s"].get(q, 0.0) for sp in splits])) for q in keys_w},
                            "lane_busy_s": {q: float(np.median([sp["lane_busy_s"].get(q, 0.0) for sp in splits]))
                                            for q in keys_l}}
        if "tiers" in ok[-1]:
            row["tiers"] = ok[-1]["tiers"]
        if ok[-1].get("speculation"):
            row["speculation"] = ok[-1]["speculation"]  # the last round's (cumulative over its steps)
    return table


@dataclasses.dataclass(frozen=True)
class EmulatedSpec:
    """The ModelSpec fields offload/plan/step_time.predict reads, for this bench's model: its parameter
    count; no attention FLOPs (layers 0), so a forward is 2 x params FLOPs per token, as emulated."""
    name: str
    params: int
    layers: int = 0
    hidden: int = 0

    @property
    def active_params(self) -> int:  # (a dense model: every parameter)
        return self.params


def runtime_room(s: EmuSettings, tiers: dict, cpu_budget: int) -> float:
    """Host bytes a rank keeps nvme-homed states resident in, by the runtime's own accounting (placement.py):
    the cpu budget less the cpu-homed states and the lanes' working set (every unit's chunks as placement cuts
    them). The plan's step model takes it as `resident_bytes`."""
    from offload.store.swap_file import page_bytes
    from offload.zero.placement import (chunk_numel_for, equal_chunk, fit_chunk, host_working_set,
                                        optimizer_fp32_states)
    from offload.zero.shards import chunk_bounds

    world, width = s.world_size, 2  # bf16 compute
    shards = [-(-block_params(s.dim, s.ff) // world)] * s.layers + [-(-s.dim // world)]
    chunk = fit_chunk(chunk_numel_for(cpu_budget, None), shards)
    units = [[hi - lo for lo, hi in chunk_bounds(n, equal_chunk(n, chunk))] for n in shards]
    cells = [c for u in units for c in u]
    homed = ((sum(page_bytes(c * width) for c in cells) if tiers["params"] == "cpu" else 0)
             + (optimizer_fp32_states(width) * sum(page_bytes(c * 4) for c in cells) if tiers["optimizer"] == "cpu" else 0))
    working = host_working_set(units, width, tiers["params"] == "nvme", tiers["optimizer"] == "nvme",
                               tiers["grads"] == "nvme").total
    return max(0.0, cpu_budget - homed - working)


def plan_prediction(row: dict, n_params: int, s: EmuSettings, probes: dict, update_in_backward: bool) -> dict:
    from offload.plan.memory import Placement, Workload
    from offload.plan.sizing import DEVICES
    from offload.plan.step_time import Machine, predict

    nvme, adam = probes["probe-nvme"], probes["probe-adam"]
    mc = Machine(gpus_per_node=s.world_size, nodes=1, device_flops=s.tflops * 1e12, mfu=1.0,
                 pcie_Bps=DEVICES["cpu"]["pcie_Bps"], interconnect_Bps=DEVICES["cpu"]["interconnect_Bps"],
                 nvme_read_Bps=nvme["read_Bps"], nvme_write_Bps=nvme["write_Bps"],
                 adam_params_per_s=adam["n_params"] / adam["adam_s"])
    w = Workload(micro_batch=s.batch, seq_len=s.seq, grad_accum=1, checkpointing=False,
                 update_in_backward=update_in_backward)
    t = row["tiers"]
    place = Placement(t["params"], t["optimizer"], t["grads"])
    spec = EmulatedSpec("emulated", n_params)
    from offload.config import parse_size

    budget = parse_size(s.cpu_budget_all if t["optimizer"] == "cpu" else s.cpu_budget)
    room = runtime_room(s, t, budget)
    p = predict(spec, w, place, mc, resident_bytes=room)
    out = {"placement": str(place), "predicted_s": p["step_s"], "measured_s": row["median_s"],
           "error": p["step_s"] / row["median_s"] - 1.0, "resources": p["resources"], "phases": p["phases"],
           "bottleneck": p["bottleneck"], "update_in_backward": update_in_backward,
           "machine": dataclasses.asdict(mc), "resident_bytes": room,
           "plan_nvme_bytes": {"read": p["resources"]["nvme read"] * mc.nvme_read_Bps,
                               "written": p["resources"]["nvme write"] * mc.nvme_write_Bps}}
    return out


def plan_rows(table: dict, n_params: int, s: EmuSettings, probes: dict) -> dict:
    out = {}
    for name in ("offload", "offload-inbwd", "offload-pcpu", "offload-cpu"):  # the plan has no prefetch-off model
        row = table.get(name, {})
        if "median_s" in row and "tiers" in row:
            out[name] = plan_prediction(row, n_params, s, probes, name == "offload-inbwd")
    return out


def fmt_split(split: dict | None) -> str:
    if not split:
        return "-"
    waits = ", ".join(f"{q} {v:.3f}" for q, v in sorted(split["wait_s"].items(), key=lambda kv: -kv[1]) if v >= 5e-4)
    busy = ", ".join(f"{q} {v:.3f}" for q, v in sorted(split["lane_busy_s"].items(), key=lambda kv: -kv[1]) if v >= 5e-4)
    return f"compute {split['compute_s']:.3f} | waits {waits or '-'} | lanes busy {busy or '-'}"


def print_rate(entry: dict, s: EmuSettings) -> None:
    table = entry["table"]
    ratio = f"compute:io floor {entry['ratio']:.2f}, " if entry.get("ratio") is not None else ""
    run_floor = entry.get("io_floor_run_s")
    print(f"\n## {ratio}emulated {entry['tflops']:.4g} TFLOP/s: compute {entry['compute_s']:.3f} s/step, "
          f"I/O floor {entry['io_floor_s']:.3f} s/step"
          + (f" (this rate's default run: {run_floor:.3f})" if run_floor is not None else ""))
    print(f"{'contender':<14}{'s/step':>8}{'best':>8}{'bound':>8}{'binds':>8}{'eff':>6}{'vs torch':>9}{'DS/this':>8}"
          f"{'peak RSS':>12}{'nvme R/step':>13}{'nvme W/step':>13}{'io s':>7}{'CPU s':>7}{'slept':>7}{'loss':>11}")
    for name, row in table.items():
        if "median_s" not in row:
            print(f"{name:<14}  failed: {row.get('error')} (see stderr / --json)")
            continue
        io = row.get("io_bytes") or {}
        f = lambda v, w, p=2: f"{v:{w}.{p}f}" if v is not None else f"{'-':>{w}}"  # noqa: E731
        print(f"{name:<14}{row['median_s']:8.3f}{row['best_s']:8.3f}{row['bound_s']:8.3f}{row['binds']:>8}"
              f"{row['efficiency']:6.2f}{f(row['vs_torch'], 9)}{f(row['deepspeed_over_this'], 8)}"
              f"{bso.fmt_bytes(row['peak_rss_bytes']):>12}{bso.fmt_bytes(io.get('read')):>13}"
              f"{bso.fmt_bytes(io.get('written')):>13}{row['io_s']:7.3f}{row['cpu_s_per_step']:7.3f}"
              f"{row['slept_s_per_step']:7.3f}{row['final_loss']:11.4f}")
    print(f"# bound = max(compute {entry['compute_s']:.3f}, io (own bytes / engine bandwidth), adam "
          f"{next(iter(r['adam_s'] for r in table.values() if r.get('adam_s')), 0.0):.3f} = offload.AdamW CPU s / "
          f"{bso.CORES} cores); eff = bound / s/step; DS/this = DeepSpeed's s/step / this one's")
    for name, row in table.items():
        if row.get("split"):
            print(f"# split {name:<13} {fmt_split(row['split'])}  (wall {row['split']['wall_s']:.3f})")
    for name, row in table.items():
        sp = row.get("speculation")
        if sp and sp.get("enabled"):
            print(f"# speculation {name:<7} {sp['steps']} steps speculated, unit updates committed {sp['committed']}, "
                  f"missed {sp['missed']}, voided {sp['voided']} (last round)")
    for name, row in table.items():
        by = sorted(row.get("cpu_s_per_step_by_thread", {}).items(), key=lambda kv: -kv[1])
        if by:
            print(f"# CPU s/step {name:<13} " + ", ".join(f"{k} {v:.3f}" for k, v in by if v >= 5e-4)
                  + f"  (/ {bso.CORES} cores = {row.get('cores_s', 0):.3f} s)")
    for name, p in entry.get("plan", {}).items():
        print(f"# plan {name:<13} {p['placement']}{' (update in backward)' if p['update_in_backward'] else ''}: "
              f"predicted {p['predicted_s']:.3f} s, measured {p['measured_s']:.3f} s, error {100 * p['error']:+.1f}% "
              f"(busy: " + ", ".join(f"{k} {v:.3f}" for k, v in p["resources"].items() if v) + ")")
        if p.get("resident_bytes") is not None:
            print(f"#      {'':<13} the plan keeps {bso.fmt_bytes(p['resident_bytes'])} resident (the cpu budget less "
                  f"what the runtime's placement holds there) and moves {bso.fmt_bytes(p['plan_nvme_bytes']['read'])} "
                  f"/ {bso.fmt_bytes(p['plan_nvme_bytes']['written'])} per step")
    if entry.get("timeline_png"):
        print(f"# timeline of offload's last timed step: {entry['timeline_png']}")


# ---- parent --------------------------------------------------------------------------------------

def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contenders", default=",".join(CONTENDERS))
    ap.add_argument("--plan-contenders", default=",".join(PLAN_CONTENDERS),
                    help="extra placements for the plan's check, run at --plan-ratio only ('' for none)")
    ap.add_argument("--plan-ratio", type=float, default=1.0)
    ap.add_argument("--ratios", default="0.5,1,2", help="compute : I/O floor ratios of the sweep")
    ap.add_argument("--emulate-gpu", default=None, metavar="TFLOPS[,TFLOPS]",
                    help="the emulated accelerator's rate(s) instead of the calibrated sweep")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3, help="timed steps per round (after --warmup)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--calibrate-steps", type=int, default=2)
    ap.add_argument("--world-size", type=int, default=1, choices=(1, 2))
    ap.add_argument("--threads", type=int, default=2, help="torch.set_num_threads and OMP_NUM_THREADS per process")
    ap.add_argument("--layers", type=int, default=8, help="blocks")
    ap.add_argument("--dim", type=int, default=1024)
    ap.add_argument("--ff", type=int, default=4096)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=2, help="micro-batch per rank")
    ap.add_argument("--cpu-budget", default="512MiB")
    ap.add_argument("--device-budget", default="1GiB")
    ap.add_argument("--cpu-budget-all", default="3GiB", help="offload-cpu's cpu budget")
    ap.add_argument("--probe-bytes", default="1GiB", help="the nvme bandwidth probe's file size")
    ap.add_argument("--ds-no-prefetch", action="store_true", help="DeepSpeed with stage3_prefetch_bucket_size 0")
    ap.add_argument("--clip", type=float, default=1.0,
                    help="max gradient norm (the model's is about 65: 1.0 clips every step, 1e9 never does)")
    ap.add_argument("--clip-every", type=int, default=0, metavar="N",
                    help="every N-th step clips at 1.0, the others at --clip: with --clip 1e9, a step after one "
                         "that did not clip is speculated and then clips (a miss, redone); not for deepspeed")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--nvme-path", default=None, help="swap directory (default: a temp dir under /tmp, removed)")
    ap.add_argument("--out-dir", default=None, help="traces and timeline PNGs of the default contender, per rate")
    ap.add_argument("--json", default=None)
    ap.add_argument("--report", default=None, metavar="JSON",
                    help="print the tables of a --json file again (with this code's summary), run nothing")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--settings", default=None, help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def report(path: str) -> int:
    """The tables of a --json file, summarized again from its runs and probes."""
    with open(path) as f:
        doc = json.load(f)
    base = EmuSettings(**doc["settings"])
    print(f"# {path}: {doc['n_params'] / 1e6:.2f}M params, {base.world_size} rank(s), {doc['rounds']} round(s) of "
          f"{base.steps} timed step(s) after {base.warmup}; command: {' '.join(doc['command'])}")
    for entry in doc["rates"]:
        s_rate = dataclasses.replace(base, tflops=entry["tflops"])
        entry["table"] = summarize_rate(entry["runs"], s_rate, doc["probes"])
        entry["plan"] = plan_rows(entry["table"], doc["n_params"], s_rate, doc["probes"])
        print_rate(entry, s_rate)
    return 0


def _names(text: str) -> list[str]:
    return [c.strip() for c in text.split(",") if c.strip()]


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.child:
        child_main(args.child, args.settings)
        return 0
    from offload.config import parse_size

    if args.report:
        return report(args.report)
    contenders, plan_extra = _names(args.contenders), _names(args.plan_contenders)
    unknown = [c for c in contenders + plan_extra if c not in CONTENDERS + PLAN_CONTENDERS + OPT_IN]
    if unknown:
        raise SystemExit(f"unknown contender(s) {unknown}; choose from {CONTENDERS + PLAN_CONTENDERS + OPT_IN}")
    if args.clip_every and "deepspeed" in contenders:
        raise SystemExit("--clip-every: DeepSpeed's clipping is one gradient_clipping for the run; leave deepspeed "
                         "out of --contenders")
    base = EmuSettings(layers=args.layers, dim=args.dim, ff=args.ff, seq=args.seq, batch=args.batch,
                       world_size=args.world_size, warmup=args.warmup, steps=args.steps, threads=args.threads,
                       seed=args.seed, cpu_budget=args.cpu_budget, device_budget=args.device_budget,
                       cpu_budget_all=args.cpu_budget_all, probe_bytes=parse_size(args.probe_bytes, "--probe-bytes"),
                       ds_prefetch=not args.ds_no_prefetch, clip=args.clip, clip_every=args.clip_every)
    n_block_params = args.layers * block_params(args.dim, args.ff)
    n_params = n_block_params + args.dim
    tokens = args.batch * args.seq
    owned = args.nvme_path is None
    root = tempfile.mkdtemp(prefix="bench-emulated-gpu-") if owned else args.nvme_path
    os.makedirs(root, exist_ok=True)
    if args.out_dir:
        os.makedirs(args.out_dir, exist_ok=True)
    info = bso.machine_info()
    started = time.time()
    print(f"# model: {n_params / 1e6:.2f}M params ({args.layers} emulated blocks d={args.dim} ff={args.ff}), "
          f"micro-batch {args.batch} x seq {args.seq} per rank, {args.world_size} rank(s), {args.threads} thread(s)/"
          f"process; {bso.CORES} cores", flush=True)
    probes, calibration, rates = {}, None, []
    try:
        for probe in ("probe-nvme", "probe-adam"):
            print(f"# {probe} ...", flush=True)
            probes[probe] = spawn(probe, dataclasses.replace(base, nvme_dir=os.path.join(root, probe)))
            if "error" in probes[probe]:
                raise SystemExit(f"{probe} failed: see above")
        nvme = probes["probe-nvme"]
        print(f"# engine bandwidth: read {nvme['read_Bps'] / 1e9:.2f} GB/s, write {nvme['write_Bps'] / 1e9:.2f} GB/s; "
              f"offload.AdamW over {n_params / 1e6:.1f}M params: {probes['probe-adam']['adam_s']:.3f} s, "
              f"{probes['probe-adam']['adam_cpu_s']:.3f} CPU s", flush=True)
        if args.emulate_gpu:
            rates = [{"ratio": None, "tflops": float(t)} for t in _names(args.emulate_gpu)]
        else:
            print("# calibration: the default offload contender without waits ...", flush=True)
            calibration = spawn("calibrate", dataclasses.replace(base, tflops=0.0, steps=args.calibrate_steps,
                                                                 nvme_dir=os.path.join(root, "calibrate")))
            if "error" in calibration:
                raise SystemExit("calibration failed: see above")
            moved = {"read": calibration["nvme_read_bytes_per_step"],
                     "written": calibration["nvme_written_bytes_per_step"]}
            floor = io_s(moved, nvme)
            if floor <= 0:
                raise SystemExit("calibration: the default contender moved no nvme bytes (every state resident): "
                                 "no I/O floor to set rates by; give --emulate-gpu, a larger model or a smaller "
                                 "--cpu-budget")
            calibration["io_floor_s"] = floor
            print(f"# calibration: {bso.fmt_bytes(moved['read'])} read, {bso.fmt_bytes(moved['written'])} written "
                  f"per step -> I/O floor {floor:.3f} s; with no wait {calibration['s_per_step']:.3f} s/step", flush=True)
            for ratio in (float(r) for r in _names(args.ratios)):
                compute = ratio * floor  # = 6 x block params x tokens / rate
                rates.append({"ratio": ratio, "tflops": 6.0 * n_block_params * tokens / compute / 1e12})
            print("# rates: " + ", ".join(f"ratio {r['ratio']:g} -> {r['tflops']:.4f} TFLOP/s" for r in rates),
                  flush=True)
        for k, entry in enumerate(rates):
            s_rate = dataclasses.replace(base, tflops=entry["tflops"])
            names = list(contenders)
            if entry["ratio"] is not None and math.isclose(entry["ratio"], args.plan_ratio):
                names += [c for c in plan_extra if c not in names]
            elif entry["ratio"] is None and k == 0:
                names += [c for c in plan_extra if c not in names]
            tag = f"r{entry['ratio']:g}" if entry["ratio"] is not None else f"t{entry['tflops']:g}"
            trace = os.path.abspath(os.path.join(args.out_dir, f"trace_{tag}.json")) if args.out_dir else None

            def settings_for(name, r, s_rate=s_rate, tag=tag, trace=trace):
                return dataclasses.replace(s_rate, nvme_dir=os.path.join(root, f"{tag}-{name}-r{r}"),
                                           trace=trace if (name == "offload" and r == args.rounds - 1) else None)

            print(f"# rate {entry['tflops']:.4g} TFLOP/s ({tag}): {', '.join(names)}", flush=True)
            runs = bso.interleaved_rounds(names, args.rounds, settings_for, run_child=spawn, label=f"{tag} ")
            table = summarize_rate(runs, s_rate, probes)
            moved = table.get("offload", {}).get("io_bytes")  # this rate's default run
            run_floor = io_s(moved, nvme) if moved else None
            entry.update(compute_s=step_compute_s(s_rate), io_floor_run_s=run_floor,
                         io_floor_s=calibration["io_floor_s"] if calibration else (run_floor or 0.0),
                         table=table, runs=runs, trace=None, timeline_png=None,
                         plan=plan_rows(table, n_params, s_rate, probes))
            if entry["ratio"] is None and entry["io_floor_s"]:
                entry["ratio"] = entry["compute_s"] / entry["io_floor_s"]
            if trace and os.path.exists(trace):
                import plot_trace

                png = os.path.join(args.out_dir, f"timeline_{tag}.png")
                ratio = f", compute:I/O floor {entry['ratio']:.2f}" if entry["ratio"] is not None else ""
                plot_trace.plot(plot_trace.load_events(trace), png, title=(
                    f"offload (default), emulated {entry['tflops']:.3g} TFLOP/s{ratio}: last timed step "
                    "('gpu:' = emulated compute)"))
                entry.update(trace=trace, timeline_png=png)
            print_rate(entry, s_rate)
    finally:
        if owned:
            shutil.rmtree(root, ignore_errors=True)
    if args.json:
        doc = {"command": [sys.executable] + sys.argv, "settings": dataclasses.asdict(base),
               "n_params": n_params, "n_block_params": n_block_params, "tokens_per_rank": tokens,
               "contenders": contenders, "plan_contenders": plan_extra, "rounds": args.rounds, "machine": info,
               "cores": bso.CORES, "load_average_end": os.getloadavg(), "started": started,
               "wall_s": time.time() - started, "deepspeed_config": ds_config(base), "probes": probes,
               "calibration": calibration, "rates": rates}
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1, default=str)
        print(f"# wrote {args.json}")
    failed = any("error" in r for e in rates for rs in e.get("runs", {}).values() for r in rs)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
