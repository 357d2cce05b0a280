"""Training-step time of a 50M-parameter transformer LM with parameters and optimizer states on NVMe:
the offload runtime vs DeepSpeed ZeRO-3 (offload_param + offload_optimizer on nvme) vs plain PyTorch in
memory, next to a computed lower bound.

Model (plain torch, `build_model`): token embedding (vocab 16000, d 640), learned positional embedding
(seq 128), 6 pre-LN nn.TransformerEncoderLayer blocks (10 heads, ff 2560, dropout 0) in an nn.ModuleList,
final LayerNorm, untied Linear head (no bias); causal mask; next-token cross-entropy. Micro-batch 2 per
rank, seq 128, synthetic tokens from a seeded torch.Generator (the same batches for every contender),
bf16 compute. One step: forward, backward, clip grad norm 1.0, AdamW (lr 1e-4, wd 0.01), zero_grad.

Contenders (each run in its own subprocess, so peak RSS = VmHWM is per contender; the parent runs them in
interleaved rounds, round r in an order rotated by r, and gets one JSON line back from each):
  torch         plain model and batches on the compute device (compute_device(): the GPU where CUDA is,
                else the CPU), torch.autocast(device type, bf16), torch.optim.AdamW (fused if it works
                there, else foreach), torch.nn.utils.clip_grad_norm_. Also times fwd+bwd alone (the
                compute term of the bound).
  offload       offload.init(Config(params="nvme", optimizer="nvme", cpu_budget="384MiB",
                device_budget="256MiB", compute_dtype="bf16", pipeline=True)), model built inside,
                offload.AdamW, rt.clip_grad_norm_.
  offload-sync  the same with pipeline=False (no prefetch, no overlap).
  offload-inbwd the same with update_in_backward=True (opt-in, not a default: each unit's update runs in the
                backward, clipped by the previous step's coefficient; offload/zero/update/backward_updates.py).
                Not in the default list: --contenders torch,offload,offload-inbwd,offload-sync,deepspeed.
  offload-8bit  the same with offload.AdamW8bit (8-bit block-quantized moments, Config.optimizer_states=
                "adamw8bit"): half the optimizer's bytes on the disk. Opt-in, like offload-inbwd.
  offload-nospec the default with speculative_updates=False: every update waits for opt.step() (the default
                path before speculative updates; at --clip 1.0 the default never speculates: the norm is about 2).
  offload-fast / offload-frugal  the default with OFFLOAD_MALLOC_TUNE=fast / frugal instead of the host pool
                (glibc's heap kept for reuse, or every transient mapped fresh): opt-in, for the pool's cost.
  deepspeed     DeepSpeed ZeRO-3, offload_param and offload_optimizer on nvme, bf16, gradient_clipping
                1.0, "AdamW" (DeepSpeed's CPU Adam), model built inside deepspeed.zero.Init, gloo backend.
Timing: `--warmup` steps, then `--steps` timed steps; s/step of a round = the timed steps' wall time /
steps. The offload contenders wait for queued background work (rt.quiesce()) before the clock starts and
inside the timed window at its end, so every byte and update of the timed steps is paid for.

Bound (computed, not a contender) per offload contender: max(compute, io, adam) where
  compute = the torch child's fwd+bwd time alone (median over rounds),
  io      = nvme_read_bytes/step / read_Bps + nvme_written_bytes/step / write_Bps, with the bytes the
            contender's own rt.stats() counted and the bandwidths of offload's AioEngine (1MiB blocks, queue
            depth 32, 2 workers: the store's settings) on a 1GiB file in the nvme dir, reads and writes
            measured separately (not concurrently),
  adam    = offload.AdamW (the fused CPU kernel) stepping bf16 params holding the model's 50M elements
            (fp32 master + moments, bf16 param output, bf16 grads), in memory.
The table prints each term, which one binds, and overlap efficiency = bound / median step time. On a
machine where the cores run the compute and the offload work alike (CPU-only), it also prints the bound
with a fourth term, the contender's own CPU seconds per step (every thread) / the cores, and where those
seconds went, thread by thread (/proc/self/task: the training thread, each offload lane and pool, and the
native threads: torch's intra-op workers and the aio engine).
With --world-size 2 the bound is for the whole machine: the ranks' nvme bytes summed, the torch compute
term on the whole global batch in one process, adam over the whole model.

Notes:
  - --world-size 2: offload, offload-sync and deepspeed run as 2 ranks under
    `python -m torch.distributed.run --standalone --nproc_per_node 2` (gloo), micro-batch 2 each, global
    batch 4; torch runs DDP-free as ONE process on the whole global batch (batch 4). Peak RSS is the sum
    over ranks. --threads applies per process, so 2 ranks x 2 threads oversubscribe a 2-core machine.
  - deepspeed (world 1) gets RANK=0 WORLD_SIZE=1 LOCAL_RANK=0 MASTER_ADDR=127.0.0.1 MASTER_PORT=<free>
    and DS_ACCELERATOR=cpu; the aio thread count is the key "intra_op_parallelism" (DeepSpeed 0.19
    ignores the old "thread_count" without a word). See deepspeed_config().
  - Children print one JSON line marked {"bench_offload_step": ...}; failures are reported with the
    tail of the child's output (also in --json).

Reproduce (from the repository root; the DeepSpeed ops are JIT-built on first use, minutes):
    python benchmarks/bench_offload_step.py --rounds 3 --steps 3 --warmup 2 --json bench_offload_step.json
    python benchmarks/bench_offload_step.py --contenders offload --rounds 1 --trace step.json
    python benchmarks/plot_trace.py step.json step.png
    # quick check of every contender with a tiny model:
    python benchmarks/bench_offload_step.py --dim 128 --layers 2 --vocab 2000 --ff 512 --heads 4 \\
        --rounds 1 --steps 1 --warmup 1
    # two ranks per contender (torchrun --standalone --nproc_per_node 2; global batch 4 = 2 per rank):
    python benchmarks/bench_offload_step.py --world-size 2 --dim 128 --layers 2 --vocab 2000 --ff 512 \\
        --heads 4 --rounds 1 --steps 1 --warmup 1
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

CONTENDERS = ("torch", "offload", "offload-sync", "deepspeed")
OPT_IN = ("offload-inbwd", "offload-8bit", "offload-fast", "offload-frugal",
          "offload-nospec")  # run when named in --contenders
DISTRIBUTED = ("offload", "offload-sync", "offload-inbwd", "offload-8bit", "offload-fast", "offload-frugal",
               "deepspeed")  # run under torchrun with --world-size 2
ADAM_PROBE = {"offload-8bit": "probe-adam8bit"}  # the bound's optimizer term: a contender's own kernel, timed
RESULT_KEY = "bench_offload_step"  # marks the child's JSON line among DeepSpeed's log lines
GiB = 1 << 30
CORES = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


@dataclasses.dataclass
class Settings:
    vocab: int = 16000
    dim: int = 640
    layers: int = 6
    heads: int = 10
    ff: int = 2560
    seq: int = 128
    batch: int = 2            # micro-batch per rank
    world_size: int = 1
    warmup: int = 2
    steps: int = 3
    threads: int = 2
    seed: int = 0
    lr: float = 1e-4
    weight_decay: float = 0.01
    clip: float = 1.0
    nvme_dir: str = ""        # this run's swap directory (a subdirectory of --nvme-path)
    trace: str | None = None  # offload only: Chrome trace of the last timed step
    cpu_budget: str = "384MiB"   # offload's budgets (a larger model needs a unit or two gathered in the device one)
    device_budget: str = "256MiB"

    @property
    def global_batch(self) -> int:
        return self.batch * self.world_size


# ---- model and data (shared by every contender) -----------------------------------------------

def build_model(vocab: int, dim: int, layers: int, heads: int, ff: int, seq: int):
    import torch
    import torch.nn as nn

    class TransformerLM(nn.Module):
        def __init__(self):
            super().__init__()
            self.tok = nn.Embedding(vocab, dim)
            self.pos = nn.Embedding(seq, dim)
            self.blocks = nn.ModuleList(
                nn.TransformerEncoderLayer(d_model=dim, nhead=heads, dim_feedforward=ff, dropout=0.0,
                                           batch_first=True, norm_first=True)
                for _ in range(layers))
            self.norm = nn.LayerNorm(dim)
            self.head = nn.Linear(dim, vocab, bias=False)

        def forward(self, ids):
            t = ids.shape[1]
            mask = torch.triu(torch.ones(t, t, dtype=torch.bool, device=ids.device), diagonal=1)
            h = self.tok(ids) + self.pos(torch.arange(t, device=ids.device))
            for block in self.blocks:
                h = block(h, src_mask=mask, is_causal=True)
            return self.head(self.norm(h))

    return TransformerLM()


def model_from(s: Settings):
    return build_model(s.vocab, s.dim, s.layers, s.heads, s.ff, s.seq)


def make_batch(s: Settings, step: int, rank: int = 0, ranks: int = 1):
    """Step `step`'s global batch (global_batch x seq+1 tokens from a seeded generator), this rank's
    1/ranks of it as (inputs, targets)."""
    import torch

    g = torch.Generator().manual_seed(s.seed * 1_000_003 + step)
    ids = torch.randint(0, s.vocab, (s.global_batch, s.seq + 1), generator=g)
    per = s.global_batch // ranks
    ids = ids[rank * per:(rank + 1) * per]
    return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()


def lm_loss(model, ids, targets):
    import torch.nn.functional as F

    logits = model(ids)
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))


# ---- child helpers ---------------------------------------------------------------------------
# (the RSS ones as offload.zero.host_memory has them, written out so that the torch and DeepSpeed children
# never import offload: their memory figures must not include it)

def peak_rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def reset_peak_rss() -> bool:
    """VmHWM := current RSS (Linux >= 4.0: echo 5 > /proc/self/clear_refs), so a later peak covers what follows
    only. False where it is not allowed."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def rss_bytes() -> int:
    """This process's resident set now (VmRSS)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def proc_io() -> dict:
    """Bytes this process made the block layer read / write (/proc/self/io), an independent check."""
    out = {}
    try:
        with open("/proc/self/io") as f:
            for line in f:
                key, value = line.split(":")
                out[key] = int(value)
    except OSError:
        pass
    return {"read_bytes": out.get("read_bytes", 0), "write_bytes": out.get("write_bytes", 0)}


def thread_cpu_s() -> dict:
    """User + system CPU seconds of each live thread of this process (/proc/self/task), summed by name: Python
    threads by their name (a pool's "_N" suffix dropped, "main" for the main thread), the rest (torch's
    intra-op workers, the aio engine's threads) as "native"."""
    import threading

    names = {t.native_id: "main" if t is threading.main_thread() else re.sub(r"_\d+$", "", t.name)
             for t in threading.enumerate()}
    tick = os.sysconf("SC_CLK_TCK")
    out: dict = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue  # exited meanwhile
        name = names.get(int(tid), "native")
        out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / tick  # utime, stime
    return out


def sum_by_name(dicts) -> dict:
    out: dict = {}
    for d in dicts:
        for k, v in d.items():
            out[k] = out.get(k, 0.0) + v
    return out


def rank_and_world() -> tuple[int, int]:
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


def compute_device():
    """cuda:(LOCAL_RANK % device_count) where CUDA is available, else the CPU: the rule the offload runtime
    picks its device by, so the torch baseline computes where the offload contenders do (the modulo: one
    visible GPU per process has index 0 whatever LOCAL_RANK is)."""
    import torch

    if not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())


def sync(device) -> None:
    """Wait for the work queued on `device` (a GPU runs behind the host; the CPU has nothing queued)."""
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_steps(s: Settings, step, *, drain=None, at_start=None, trace_hooks=None) -> dict:
    """Warm-up steps, then `s.steps` timed ones. `drain()` waits for queued background work: called
    untimed before the clock starts and timed at the end. `at_start()` runs just before the clock starts.
    trace_hooks = (start, stop): called before the last timed step and after the clock stops."""
    import numpy as np

    losses = [step(i) for i in range(s.warmup)]
    if drain is not None:
        drain()
    if at_start is not None:
        at_start()
    io0, cpu0, threads0 = proc_io(), os.times(), thread_cpu_s()
    per_step = []
    t_start = time.perf_counter()
    for i in range(s.warmup, s.warmup + s.steps):
        last = i == s.warmup + s.steps - 1
        if last and trace_hooks is not None:
            trace_hooks[0]()
        t0 = time.perf_counter()
        losses.append(step(i))
        per_step.append(time.perf_counter() - t0)
    if drain is not None:
        drain()
    elapsed = time.perf_counter() - t_start
    if trace_hooks is not None:
        trace_hooks[1]()
    io1, cpu1, threads1 = proc_io(), os.times(), thread_cpu_s()
    cpu = (cpu1.user - cpu0.user) + (cpu1.system - cpu0.system)  # every thread of this process
    return {"s_per_step": elapsed / s.steps, "step_s": per_step, "median_step_s": float(np.median(per_step)),
            "losses": losses, "proc_io_per_step": {k: (io1[k] - io0[k]) / s.steps for k in io0},
            "cpu_s_per_step": cpu / s.steps,
            "cpu_s_per_step_by_thread": {k: (v - threads0.get(k, 0.0)) / s.steps for k, v in threads1.items()}}


def gather_ranks(value: dict, directory: str) -> list[dict]:
    """[value of each rank] when a process group is up, else [value]. Exchanged through JSON files in
    `directory` and a barrier, not all_gather_object: a gloo all-gather just before exit can make the
    interpreter abort at shutdown (the gloo thread frees the work's Python-owned tensors after
    finalization began: "terminate called without an active exception")."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return [value]
    rank, world = dist.get_rank(), dist.get_world_size()
    with open(os.path.join(directory, f"rank{rank}.stats.json"), "w") as f:
        json.dump(value, f)
    dist.barrier()
    values = []
    for r in range(world):
        with open(os.path.join(directory, f"rank{r}.stats.json")) as f:
            values.append(json.load(f))
    dist.barrier()  # every rank has read every file
    return values


def emit(result: dict) -> None:
    rank, _ = rank_and_world()
    if rank == 0:
        print(json.dumps({RESULT_KEY: result}), flush=True)


def setup_threads(s: Settings) -> None:
    import torch

    torch.set_num_threads(s.threads)


# ---- contenders (each runs in a child process) --------------------------------------------------

def run_torch(s: Settings) -> dict:
    """Plain PyTorch in memory; one process (with --world-size 2 it takes the whole global batch)."""
    import numpy as np
    import torch

    setup_threads(s)
    device = compute_device()
    if device.type == "cuda":
        torch.cuda.set_device(device)  # this process's GPU, before anything touches CUDA
    torch.manual_seed(s.seed)
    model = model_from(s).to(device)  # built on the CPU from the seed: the same weights on any device
    n_params = sum(p.numel() for p in model.parameters())
    try:
        probe = torch.nn.Parameter(torch.zeros(4, device=device))
        probe.grad = torch.ones(4, device=device)
        torch.optim.AdamW([probe], fused=True).step()
        opt = torch.optim.AdamW(model.parameters(), lr=s.lr, weight_decay=s.weight_decay, fused=True)
        impl = "fused"
    except (RuntimeError, TypeError) as exc:
        opt = torch.optim.AdamW(model.parameters(), lr=s.lr, weight_decay=s.weight_decay, foreach=True)
        impl = f"foreach (fused failed: {exc})"

    def fwd_bwd(i):
        ids, targets = (t.to(device) for t in make_batch(s, i))
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = lm_loss(model, ids, targets)
        loss.backward()
        return loss

    def step(i):
        loss = fwd_bwd(i)
        torch.nn.utils.clip_grad_norm_(model.parameters(), s.clip)
        opt.step()
        opt.zero_grad()
        return loss.item()

    out = timed_steps(s, step)
    compute = []  # the bound's compute term: fwd+bwd alone, gradients cleared outside the clock
    for i in range(s.warmup, s.warmup + s.steps):
        opt.zero_grad()
        sync(device)  # nothing queued before the clock starts lands in this window
        t0 = time.perf_counter()
        fwd_bwd(i)
        sync(device)  # the clock stops when the GPU has done the fwd+bwd, not when the host queued it
        compute.append(time.perf_counter() - t0)
    opt.zero_grad()
    out.update(n_params=n_params, optimizer=f"torch.optim.AdamW {impl}", device=str(device),
               compute_only_step_s=compute,
               compute_only_s=float(np.mean(compute)), batch_per_process=s.global_batch, processes=1,
               peak_rss_bytes=[peak_rss_bytes()])
    return out


def run_offload(s: Settings, pipeline: bool, update_in_backward: bool = False, family: str = "adamw",
                speculative: bool = True) -> dict:
    """offload.init with params and optimizer states on nvme; the model is built (and sharded) inside."""
    import offload
    import offload.telemetry
    import torch.distributed as dist

    setup_threads(s)
    _, world = rank_and_world()
    if world > 1 and not dist.is_initialized():  # ours, so the per-rank stats can be gathered after the block
        device = compute_device()
        if device.type == "cuda":  # (the runtime refuses gloo for a GPU's collectives)
            import torch

            torch.cuda.set_device(device)
            dist.init_process_group("nccl", device_id=device)
        else:
            dist.init_process_group("gloo")
    cfg = offload.Config(params="nvme", optimizer="nvme", nvme_path=s.nvme_dir, cpu_budget=s.cpu_budget,
                         device_budget=s.device_budget, compute_dtype="bf16", pipeline=pipeline, seed=s.seed,
                         update_in_backward=update_in_backward, optimizer_states=family,
                         speculative_updates=speculative)
    with offload.init(cfg) as rt:
        model = model_from(s)  # forward runs in bf16 under the runtime: no autocast
        optimizer = {"adamw": offload.AdamW, "adamw8bit": offload.AdamW8bit}[family]
        opt = optimizer(model.parameters(), lr=s.lr, weight_decay=s.weight_decay)
        n_params = sum(p.numel() for p in model.parameters())

        def step(i):
            ids, targets = (t.to(rt.device) for t in make_batch(s, i, rt.rank, rt.world_size))
            loss = lm_loss(model, ids, targets)
            loss.backward()
            rt.clip_grad_norm_(s.clip)
            opt.step()
            opt.zero_grad()
            return loss.item()

        trace_hooks = None
        if s.trace:
            def save():
                if rt.rank == 0:
                    offload.telemetry.save_trace(s.trace)
                else:
                    offload.telemetry.stop_trace()

            trace_hooks = (offload.telemetry.start_trace, save)
        marks = []  # rt.stats() when the clock starts
        out = timed_steps(s, step, drain=rt.quiesce, at_start=lambda: marks.append(rt.stats()),
                          trace_hooks=trace_hooks)
        before, after = marks[0], rt.stats()
        units = len(rt.units)
    out.update(over_ranks(s, out, before, after))
    if world > 1:
        dist.destroy_process_group()
    out.update(n_params=n_params, units=units, pipeline=pipeline, batch_per_process=s.batch, processes=world,
               offload_kernel_threads=offload_kernel_threads(), trace=s.trace)
    return out


def over_ranks(s: Settings, out: dict, before: dict, after: dict) -> dict:
    """An offload child's timed window summed over its ranks (every rank calls it: it exchanges through files):
    nvme bytes per step from rt.stats() (`before` when the clock started, `after` at the end), peak RSS per
    rank, CPU seconds per step (every thread of every rank), and rank 0's rt.stats()."""
    per_rank = gather_ranks({
        "nvme_read_bytes": after["nvme_read_bytes"] - before["nvme_read_bytes"],
        "nvme_written_bytes": after["nvme_written_bytes"] - before["nvme_written_bytes"],
        "peak_rss_bytes": peak_rss_bytes(),
        "proc_io_per_step": out["proc_io_per_step"],
        "cpu_s_per_step": out["cpu_s_per_step"],
        "cpu_s_per_step_by_thread": out["cpu_s_per_step_by_thread"],
    }, s.nvme_dir)
    return dict(
        peak_rss_bytes=[r["peak_rss_bytes"] for r in per_rank],
        nvme_read_bytes_per_step=sum(r["nvme_read_bytes"] for r in per_rank) / s.steps,
        nvme_written_bytes_per_step=sum(r["nvme_written_bytes"] for r in per_rank) / s.steps,
        per_rank_proc_io_per_step=[r["proc_io_per_step"] for r in per_rank],
        cpu_s_per_step=sum(r["cpu_s_per_step"] for r in per_rank),
        cpu_s_per_step_by_thread=sum_by_name(r["cpu_s_per_step_by_thread"] for r in per_rank),
        rt_stats=after,  # rank 0's cumulative counters (since the block opened) and last_step split
    )


def offload_kernel_threads():
    try:
        from offload.ops.threads import num_threads

        return num_threads()
    except Exception:  # noqa: BLE001 - informational only
        return None


def deepspeed_config(s: Settings, largest: int | None = None) -> dict:
    """`largest`: elements of the model's largest parameter (default: this bench's transformer's)."""
    if largest is None:
        largest = max(s.vocab * s.dim, s.dim * s.ff, 3 * s.dim * s.dim)  # embedding / head, ff, in_proj weights
    buffer_size = -(-largest // (1 << 20)) * (1 << 20)  # elements, rounded up to 1Mi
    return {
        "train_micro_batch_size_per_gpu": s.batch,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": s.clip,
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": s.lr, "weight_decay": s.weight_decay,
                                                  "betas": [0.9, 0.999], "eps": 1e-8}},
        "zero_optimization": {
            "stage": 3,
            "offload_param": {"device": "nvme", "nvme_path": s.nvme_dir, "pin_memory": False,
                              "buffer_count": 32, "buffer_size": buffer_size},
            "offload_optimizer": {"device": "nvme", "nvme_path": s.nvme_dir, "pin_memory": False},
        },
        # DeepSpeed >= 0.15 calls the thread count "intra_op_parallelism" ("thread_count" is silently ignored)
        "aio": {"block_size": 1 << 20, "queue_depth": 32, "single_submit": False, "overlap_events": True,
                "intra_op_parallelism": 2},
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
    }


def run_deepspeed(s: Settings) -> dict:
    """DeepSpeed ZeRO-3 with params and optimizer states on nvme, its CPU AdamW, gloo on this CPU box."""
    import deepspeed
    import torch
    import torch.distributed as dist
    from deepspeed.accelerator import get_accelerator

    setup_threads(s)
    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    ds_config = deepspeed_config(s)
    torch.manual_seed(s.seed)
    with deepspeed.zero.Init(config_dict_or_path=ds_config):
        model = model_from(s)  # partitioned (and swapped to nvme) as it is built
    engine, optimizer, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                                   config=ds_config)
    n_params = sum(p.ds_numel for p in model.parameters())

    def step(i):
        ids, targets = make_batch(s, i, rank, world)
        loss = lm_loss(engine, ids, targets)  # params are bf16 (bf16.enabled): no autocast
        engine.backward(loss)
        engine.step()  # clips to gradient_clipping, steps, zeroes the gradients
        return loss.item()

    out = timed_steps(s, step)
    per_rank = gather_ranks({"peak_rss_bytes": peak_rss_bytes(), "proc_io_per_step": out["proc_io_per_step"],
                             "cpu_s_per_step": out["cpu_s_per_step"],
                             "cpu_s_per_step_by_thread": out["cpu_s_per_step_by_thread"]}, s.nvme_dir)
    out.update(n_params=n_params, batch_per_process=s.batch, processes=world,
               peak_rss_bytes=[r["peak_rss_bytes"] for r in per_rank],
               cpu_s_per_step=sum(r["cpu_s_per_step"] for r in per_rank),
               cpu_s_per_step_by_thread=sum_by_name(r["cpu_s_per_step_by_thread"] for r in per_rank),
               per_rank_proc_io_per_step=[r["proc_io_per_step"] for r in per_rank],
               optimizer=type(optimizer.optimizer).__name__ if hasattr(optimizer, "optimizer") else
               type(optimizer).__name__,
               accelerator=get_accelerator().device_name(), ds_config=ds_config)
    if hasattr(engine, "destroy"):
        engine.destroy()
    return out


# ---- bound probes (children) ---------------------------------------------------------------------

def probe_nvme(s: Settings, size: int = GiB, chunk: int = 64 << 20, repeats: int = 3) -> dict:
    """offload's AioEngine (1MiB blocks, queue depth 32) streaming a 1GiB file in the nvme dir: sequential
    write, then read, through a 2 x 64MiB double buffer (two requests in flight, each cut into blocks);
    median GB/s of `repeats` passes each. Reads and writes are measured separately."""
    import numpy as np
    import torch

    from offload.store.aio import AioEngine, aligned_empty

    setup_threads(s)
    path = os.path.join(s.nvme_dir, "bench-bandwidth.bin")
    buf = aligned_empty(2 * chunk)
    buf.copy_(torch.randint(0, 256, (buf.numel(),), dtype=torch.uint8))
    halves = [buf[:chunk], buf[chunk:]]
    with AioEngine(block_size="1MiB", queue_depth=32, workers=2, backend="auto") as eng:
        with eng.open(path, "w+") as f:
            eng.fallocate(f, size)

            def stream(write: bool) -> float:
                op = eng.write if write else eng.read
                pending = []
                t0 = time.perf_counter()
                for k, pos in enumerate(range(0, size, chunk)):
                    if len(pending) == 2:
                        pending.pop(0).wait()
                    pending.append(op(f, pos, halves[k % 2]))
                for h in pending:
                    h.wait()
                return size / (time.perf_counter() - t0)

            stream(True)  # lay the file out (writes into fallocated extents are slower the first time)
            writes, reads = [], []
            for _ in range(repeats):
                writes.append(stream(True))
                reads.append(stream(False))
        backend = eng.backend
        direct = f.direct
    os.unlink(path)
    return {"read_Bps": float(np.median(reads)), "write_Bps": float(np.median(writes)), "read_runs_Bps": reads,
            "write_runs_Bps": writes, "backend": backend, "o_direct": direct, "file_bytes": size,
            "block_size": 1 << 20, "queue_depth": 32, "workers": 2, "concurrent": False}


def probe_adam(s: Settings, repeats: int = 3, shapes: list | None = None, family: str = "adamw") -> dict:
    """The optimizer's fused CPU kernel (offload.AdamW, or offload.AdamW8bit for family "adamw8bit") over bf16
    params with the model's shapes (fp32 master and moments in state, bf16 param written by the kernel), in
    memory: median step time, and the CPU seconds (every thread) of the median step. `shapes`: the parameters'
    shapes (default: this bench's transformer's)."""
    import numpy as np
    import torch

    import offload

    setup_threads(s)
    if shapes is None:
        with torch.device("meta"):
            shapes = [p.shape for p in model_from(s).parameters()]
    g = torch.Generator().manual_seed(s.seed)
    params = []
    for shape in shapes:
        p = torch.nn.Parameter(torch.randn(shape, generator=g).to(torch.bfloat16))
        p.grad = torch.randn(shape, generator=g).to(torch.bfloat16)
        params.append(p)
    opt = {"adamw": offload.AdamW, "adamw8bit": offload.AdamW8bit}[family](params, lr=s.lr,
                                                                          weight_decay=s.weight_decay)
    opt.step()  # allocates the state (master, moments)
    times, cpus = [], []
    for _ in range(repeats):
        c0, t0 = os.times(), time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - t0)
        c1 = os.times()
        cpus.append((c1.user - c0.user) + (c1.system - c0.system))
    return {"adam_s": float(np.median(times)), "adam_runs_s": times, "adam_cpu_s": float(np.median(cpus)),
            "adam_cpu_runs_s": cpus, "n_params": sum(p.numel() for p in params),
            "kernel_threads": offload_kernel_threads(), "optimizer": type(opt).__name__}


def with_malloc(mode: str, run):
    """A child's run with OFFLOAD_MALLOC_TUNE=mode (read when the runtime opens)."""
    os.environ["OFFLOAD_MALLOC_TUNE"] = mode
    return run()


CHILDREN = {
    "torch": run_torch,
    "offload": lambda s: run_offload(s, pipeline=True),
    "offload-sync": lambda s: run_offload(s, pipeline=False),
    "offload-inbwd": lambda s: run_offload(s, pipeline=True, update_in_backward=True),
    "offload-8bit": lambda s: run_offload(s, pipeline=True, family="adamw8bit"),
    "offload-nospec": lambda s: run_offload(s, pipeline=True, speculative=False),
    "offload-fast": lambda s: with_malloc("fast", lambda: run_offload(s, pipeline=True)),
    "offload-frugal": lambda s: with_malloc("frugal", lambda: run_offload(s, pipeline=True)),
    "deepspeed": run_deepspeed,
    "probe-nvme": probe_nvme,
    "probe-adam": probe_adam,
    "probe-adam8bit": lambda s: probe_adam(s, family="adamw8bit"),
}


def child_main(name: str, settings_json: str) -> None:
    s = Settings(**json.loads(settings_json))
    result = CHILDREN[name](s)
    result["contender"] = name
    emit(result)


# ---- parent: spawn, interleave, report -----------------------------------------------------------

def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def spawn(name: str, s: Settings, log_tail: int = 60, script: str | None = None,
          distributed: tuple = DISTRIBUTED, timeout_s: float | None = None) -> dict:
    """Runs one child; its JSON result (or {"error": ...} with the tail of its output). `script`: the bench
    whose `--child NAME --settings JSON` runs it (default: this one); `distributed`: the children run under
    torchrun when s.world_size > 1; `timeout_s`: the child and every process it started are killed after this
    long (a hang or a stuck build costs only its own run: {"error": "timed out after N s"})."""
    env = dict(os.environ, OMP_NUM_THREADS=str(s.threads), PYTHONUNBUFFERED="1")
    env.setdefault("DS_ACCELERATOR", "cpu")
    script = os.path.abspath(script or __file__)
    child = [script, "--child", name, "--settings", json.dumps(dataclasses.asdict(s))]
    if s.world_size > 1 and name in distributed:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
               str(s.world_size)] + child
    else:
        cmd = [sys.executable] + child
        env.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(free_port()))
    os.makedirs(s.nvme_dir, exist_ok=True)
    t0 = time.perf_counter()
    timed_out = False
    try:
        with subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              start_new_session=True) as child:  # its own group: a timeout ends all of it
            try:
                out, err = child.communicate(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                timed_out = True
                os.killpg(child.pid, signal.SIGKILL)
                out, err = child.communicate()
            except BaseException:  # this process stopped (Ctrl-C, a SIGTERM made an exception): the child too
                os.killpg(child.pid, signal.SIGKILL)
                raise
        proc = subprocess.CompletedProcess(cmd, child.returncode, out, err)
    finally:
        shutil.rmtree(s.nvme_dir, ignore_errors=True)  # DeepSpeed leaves its swap files behind
    wall = time.perf_counter() - t0
    result = None
    for line in proc.stdout.splitlines():
        if line.startswith("{") and RESULT_KEY in line:
            try:
                result = json.loads(line)[RESULT_KEY]
            except json.JSONDecodeError:
                pass
    if proc.returncode != 0 or result is None:
        tail = (proc.stdout + "\n" + proc.stderr).strip().splitlines()[-log_tail:]
        print(f"!! {name} failed (exit {proc.returncode}); last lines of its output:\n  " + "\n  ".join(tail),
              file=sys.stderr, flush=True)
        error = f"timed out after {timeout_s:.0f} s" if timed_out else f"exit {proc.returncode}"
        return {"contender": name, "error": error, "output_tail": tail, "child_wall_s": wall}
    result["child_wall_s"] = wall
    return result


def interleaved_rounds(contenders: list, rounds: int, settings_for, run_child=spawn, label: str = "") -> dict:
    """{contender: [its result per round]}: round r runs every contender once, in the order rotated by r, each
    in its own child (`run_child(name, settings_for(name, r))`)."""
    runs: dict[str, list] = {c: [] for c in contenders}
    for r in range(rounds):
        order = contenders[r % len(contenders):] + contenders[:r % len(contenders)]
        for name in order:
            res = run_child(name, settings_for(name, r))
            res["round"] = r
            runs[name].append(res)
            shown = f"{res['s_per_step']:.3f} s/step" if "s_per_step" in res else res["error"]
            print(f"# {label}round {r + 1}/{rounds} {name:<13} {shown}  (child {res['child_wall_s']:.0f} s)",
                  flush=True)
    return runs


def machine_info() -> dict:
    cpu = None
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), None)
    except OSError:
        pass
    import importlib.metadata as md

    def version(pkg):
        try:
            return md.version(pkg)
        except md.PackageNotFoundError:
            return None

    return {"cpu_model": cpu, "cpu_count": os.cpu_count(), "platform": platform.platform(),
            "python": platform.python_version(), "torch": version("torch"), "deepspeed": version("deepspeed"),
            "offload": version("offload"), "numpy": version("numpy"), "load_average": os.getloadavg()}


def summarize(runs: dict, probes: dict) -> dict:
    import numpy as np

    table = {}
    for name, rs in runs.items():
        ok = [r for r in rs if "error" not in r]
        row = {"rounds_ok": len(ok), "rounds_failed": len(rs) - len(ok)}
        if ok:
            t = [r["s_per_step"] for r in ok]
            row.update(median_s=float(np.median(t)), best_s=float(np.min(t)), rounds_s=t,
                       peak_rss_bytes=int(np.max([sum(r["peak_rss_bytes"]) for r in ok])),
                       peak_rss_bytes_per_rank=[int(x) for x in np.max([r["peak_rss_bytes"] for r in ok], axis=0)],
                       final_loss=ok[-1]["losses"][-1],
                       cpu_s_per_step=float(np.median([r["cpu_s_per_step"] for r in ok])))
            names = sorted({k for r in ok for k in r.get("cpu_s_per_step_by_thread", {})})
            row["cpu_s_per_step_by_thread"] = {k: float(np.median([r.get("cpu_s_per_step_by_thread", {}).get(k, 0.0)
                                                                   for r in ok])) for k in names}
            if "nvme_read_bytes_per_step" in ok[-1]:
                row["nvme_read_bytes_per_step"] = float(np.median([r["nvme_read_bytes_per_step"] for r in ok]))
                row["nvme_written_bytes_per_step"] = float(np.median([r["nvme_written_bytes_per_step"] for r in ok]))
            row["proc_io_per_step"] = {k: float(np.median([sum(x[k] for x in r.get("per_rank_proc_io_per_step",
                                                                                    [r["proc_io_per_step"]]))
                                                           for r in ok]))
                                       for k in ("read_bytes", "write_bytes")}
        table[name] = row
    ds = table.get("deepspeed", {}).get("median_s")
    for row in table.values():
        if ds and "median_s" in row:
            row["vs_deepspeed"] = row["median_s"] / ds
    bound = compute_bound(runs, probes, table)
    return {"table": table, "bound": bound}


def compute_bound(runs: dict, probes: dict, table: dict) -> dict | None:
    import numpy as np

    compute = [r["compute_only_s"] for r in runs.get("torch", []) + probes.get("torch", [])
               if "compute_only_s" in r]
    nvme, adam = probes.get("probe-nvme"), probes.get("probe-adam")
    if not compute or not nvme or "error" in nvme or not adam or "error" in adam:
        return None
    terms = {"compute_s": float(np.median(compute)), "adam_s": adam["adam_s"],
             "read_GBps": nvme["read_Bps"] / 1e9, "write_GBps": nvme["write_Bps"] / 1e9}
    per = {}
    for name in [c for c in CONTENDERS + OPT_IN if c.startswith("offload")]:
        row = table.get(name, {})
        if "nvme_read_bytes_per_step" not in row:
            continue
        io = row["nvme_read_bytes_per_step"] / nvme["read_Bps"] + row["nvme_written_bytes_per_step"] / nvme["write_Bps"]
        own = probes.get(ADAM_PROBE.get(name, "probe-adam"), adam)  # the contender's own optimizer kernel
        parts = {"compute": terms["compute_s"], "io": io, "adam": own.get("adam_s", terms["adam_s"])}
        binds = max(parts, key=parts.get)
        # On a CPU-only machine compute, the Adam kernel, copies, hashing and the I/O stack share the cores:
        # no step is shorter than the CPU seconds it spends divided by the cores.
        cpu = row["cpu_s_per_step"] / CORES
        with_cpu = max(parts[binds], cpu)
        per[name] = {"io_s": io, "adam_s": parts["adam"], "bound_s": parts[binds], "binds": binds,
                     "overlap_efficiency": parts[binds] / row["median_s"],
                     "cpu_bound_s": cpu, "bound_with_cpu_s": with_cpu,
                     "efficiency_with_cpu": with_cpu / row["median_s"]}
    return {"terms": terms, "per_contender": per}


def fmt_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit, scale in (("GiB", GiB), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def print_report(summary: dict, s: Settings, n_params: int | None, rounds: int) -> None:
    table, bound = summary["table"], summary["bound"]
    world_note = ""
    if s.world_size > 1:
        world_note = (f"; offload/deepspeed: {s.world_size} ranks x micro-batch {s.batch} (torchrun), "
                      f"torch: ONE process, no DDP, batch {s.global_batch}; RSS = sum over ranks")
    params = f"{n_params / 1e6:.2f}M params" if n_params else "?"
    print(f"\n# model: {params} ({s.layers} x TransformerEncoderLayer d={s.dim} heads={s.heads} ff={s.ff}, "
          f"vocab {s.vocab}, seq {s.seq}), global batch {s.global_batch}{world_note}")
    print(f"# s/step over {rounds} interleaved round(s) of {s.steps} timed step(s) after {s.warmup} warm-up; "
          f"{s.threads} thread(s)/process")
    print(f"{'contender':<14}{'median':>9}{'best':>9}{'vs DS':>8}{'peak RSS':>12}{'nvme R/step':>13}"
          f"{'nvme W/step':>13}{'disk R/step':>13}{'disk W/step':>13}{'CPU s/step':>11}{'loss':>8}")
    for name, row in table.items():
        if "median_s" not in row:
            print(f"{name:<14}   failed ({row['rounds_failed']} round(s)); see stderr / --json")
            continue
        vs = f"{row['vs_deepspeed']:7.2f}x" if "vs_deepspeed" in row else f"{'-':>8}"
        pio = row["proc_io_per_step"]
        print(f"{name:<14}{row['median_s']:9.3f}{row['best_s']:9.3f}{vs}{fmt_bytes(row['peak_rss_bytes']):>12}"
              f"{fmt_bytes(row.get('nvme_read_bytes_per_step')):>13}"
              f"{fmt_bytes(row.get('nvme_written_bytes_per_step')):>13}"
              f"{fmt_bytes(pio['read_bytes']):>13}{fmt_bytes(pio['write_bytes']):>13}"
              f"{row['cpu_s_per_step']:11.3f}{row['final_loss']:8.3f}")
    print("# nvme R/W: offload's rt.stats() bytes; disk R/W: /proc/self/io read_bytes/write_bytes of the process(es); "
          "CPU s/step: user + system seconds of every thread (summed over ranks)")
    for name, row in table.items():
        split = sorted(row.get("cpu_s_per_step_by_thread", {}).items(), key=lambda kv: -kv[1])
        if split:
            print(f"# CPU s/step by thread, {name}: " + ", ".join(f"{k} {v:.3f}" for k, v in split if v >= 0.0005))
    if bound is None:
        print("# bound: not computed (needs the torch compute time and both probes)")
        return
    t = bound["terms"]
    print(f"# bound terms: compute (torch fwd+bwd, median) {t['compute_s']:.3f} s | adam (offload.AdamW, in memory) "
          f"{t['adam_s']:.3f} s | engine bandwidth read {t['read_GBps']:.2f} GB/s, write {t['write_GBps']:.2f} GB/s "
          f"(measured separately)")
    for name, b in bound["per_contender"].items():
        print(f"# {name:<13} io {b['io_s']:.3f} s, adam {b['adam_s']:.3f} s -> bound = max(compute, io, adam) = "
              f"{b['bound_s']:.3f} s "
              f"(binds: {b['binds']}); overlap efficiency = bound / step = {b['overlap_efficiency']:.2f}")
        print(f"# {'':<13} with the cores: its CPU seconds / {CORES} cores = {b['cpu_bound_s']:.3f} s -> bound "
              f"{b['bound_with_cpu_s']:.3f} s, efficiency {b['efficiency_with_cpu']:.2f}")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contenders", default=",".join(CONTENDERS))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=3, help="timed steps per round (after --warmup)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--nvme-path", default=None, help="swap directory (default: a temp dir under /tmp, removed)")
    ap.add_argument("--threads", type=int, default=2, help="torch.set_num_threads and OMP_NUM_THREADS per process")
    ap.add_argument("--json", default=None, help="write settings, environment, every run and the summary here")
    ap.add_argument("--world-size", type=int, default=1, choices=(1, 2, 4, 8),
                    help="ranks of the distributed contenders (on a GPU machine one GPU each, NCCL: the multi-GPU "
                         "check runs the offload contender at 2 and 8)")
    ap.add_argument("--trace", default=None, help="offload contender: Chrome trace of the last timed step")
    ap.add_argument("--trace-contender", default="offload", help="whose step --trace records")
    ap.add_argument("--dim", type=int, default=640)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--vocab", type=int, default=16000)
    ap.add_argument("--ff", type=int, default=2560)
    ap.add_argument("--heads", type=int, default=10)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=2, help="micro-batch per rank")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--clip", type=float, default=1.0, help="max gradient norm (1e9: never clips)")
    ap.add_argument("--cpu-budget", default=Settings.cpu_budget, help="offload's cpu_budget")
    ap.add_argument("--no-bound", action="store_true",
                    help="skip the bound's probes (they hold the model's states and a torch step in memory: "
                         "a model bigger than host memory needs this)")
    ap.add_argument("--device-budget", default=Settings.device_budget, help="offload's device_budget")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--settings", default=None, help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.child:
        child_main(args.child, args.settings)
        return 0
    contenders = [c.strip() for c in args.contenders.split(",") if c.strip()]
    unknown = [c for c in contenders if c not in CONTENDERS + OPT_IN]
    if unknown:
        raise SystemExit(f"unknown contender(s) {unknown}; choose from {CONTENDERS + OPT_IN}")
    base = Settings(vocab=args.vocab, dim=args.dim, layers=args.layers, heads=args.heads, ff=args.ff, seq=args.seq,
                    batch=args.batch, world_size=args.world_size, warmup=args.warmup, steps=args.steps,
                    threads=args.threads, seed=args.seed, cpu_budget=args.cpu_budget, device_budget=args.device_budget,
                    clip=args.clip)
    procs = args.threads * (args.world_size if any(c in DISTRIBUTED for c in contenders) else 1)
    if procs > (os.cpu_count() or 1):
        print(f"# note: {procs} threads in all on {os.cpu_count()} cores (oversubscribed)", file=sys.stderr)
    owned = args.nvme_path is None
    root = tempfile.mkdtemp(prefix="bench-offload-step-") if owned else args.nvme_path
    os.makedirs(root, exist_ok=True)
    info = machine_info()
    started = time.time()
    runs: dict[str, list] = {c: [] for c in contenders}
    probes: dict = {}
    try:
        if any(c.startswith("offload") for c in contenders) and not args.no_bound:
            for probe in ("probe-nvme", "probe-adam") + (("probe-adam8bit",) if "offload-8bit" in contenders else ()):
                print(f"# {probe} ...", flush=True)
                probes[probe] = spawn(probe, dataclasses.replace(base, nvme_dir=os.path.join(root, probe)))
            if "torch" not in contenders:  # the bound's compute term comes from a torch child
                print("# torch (compute term of the bound) ...", flush=True)
                probes["torch"] = [spawn("torch", dataclasses.replace(base, nvme_dir=os.path.join(root, "torch")))]
        def settings_for(name: str, r: int) -> Settings:
            trace = args.trace if (name == args.trace_contender and r == args.rounds - 1) else None
            return dataclasses.replace(base, nvme_dir=os.path.join(root, f"{name}-r{r}"),
                                       trace=os.path.abspath(trace) if trace else None)

        runs = interleaved_rounds(contenders, args.rounds, settings_for)
    finally:
        if owned:
            shutil.rmtree(root, ignore_errors=True)
    summary = summarize(runs, probes)
    n_params = next((r["n_params"] for rs in runs.values() for r in rs if "n_params" in r), None)
    print_report(summary, base, n_params, args.rounds)
    if args.trace and args.trace_contender in contenders:
        print(f"# trace of {args.trace_contender}'s last timed step: {args.trace} (python benchmarks/plot_trace.py "
              f"{args.trace} trace.png)")
    if args.json:
        doc = {"command": [sys.executable] + sys.argv, "settings": dataclasses.asdict(base),
               "contenders": contenders, "rounds": args.rounds, "nvme_path": root, "nvme_path_removed": owned,
               "machine": info, "load_average_end": os.getloadavg(), "started": started,
               "wall_s": time.time() - started, "deepspeed_config": deepspeed_config(
                   dataclasses.replace(base, nvme_dir=os.path.join(root, "deepspeed-rN"))),
               "probes": probes, "runs": runs, **summary}
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1, default=str)
        print(f"# wrote {args.json}")
    failed = any("error" in r for rs in runs.values() for r in rs)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
