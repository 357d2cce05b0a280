"""One GPU at user scale (issue 42, section 2): Llama-3.2-3B and Llama-3-8B shapes trained a few steps each by
offload and by its peers, every run in its own process under its own time limit, in one call of a few minutes.

Runs (named CONTENDER-MODEL-TOKENSk; --runs picks and orders them, DEFAULT_RUNS is cheapest and most telling
first):
  offload       offload.init(params="device", grads="device", optimizer="cpu", compute_dtype="bf16"): bf16
                params and fp32 gradient shards on the GPU, fp32 master and AdamW moments in the cpu tier (the
                host's pinned arena), offload.AdamW; the model built inside the block (materialized on the GPU)
  offload8bit   the same with offload.AdamW8bit (8-bit moments, Config.optimizer_states="adamw8bit")
  offloadnvme   fp32 AdamW states homed on nvme (the cpu tier keeps what fits resident): not in the default list
  torch         plain PyTorch in GPU memory: fp32 params built on the GPU, autocast bf16, fused AdamW
  fsdp2         fully_shard(..., offload_policy=CPUOffloadPolicy()) at world size 1, bf16 params / fp32 reduce
                (MixedPrecisionPolicy), fp32 params and torch.optim.AdamW (fused) on the CPU
  deepspeed     DeepSpeed ZeRO-3, offload_optimizer cpu (ZeRO-Offload), bf16, DeepSpeedCPUAdam (torch's AdamW
                on the CPU partitions where its op cannot be built: the row says which); built in zero.Init.
                Skipped with a line when `import deepspeed` fails (gpu_scale.sh installs .whl/ as gpu_check does)
Every run: transformers' LlamaForCausalLM from a LlamaConfig (no download; random values, made on the device),
SDPA attention, sequence 4096, non-reentrant activation checkpointing, TOKENS per optimizer step in micro-batches
of --micro-batch sequences (accumulated), clip_grad_norm 1.0 every step, AdamW (lr 1e-5, wd 0.01);
--warmup steps (the first step: tracing, materialization, cuBLAS plans) then --steps timed ones.

Per run (printed, and in one --json file rewritten after each run, so a run cut short keeps what it measured):
tokens/s; model TFLOPS = 6 x params x tokens/s (attention and the recomputed forward NOT counted); MFU against
--peak-tflops (790: the H200's measured bf16 matmul rate); the step's split (offload: rt.stats()["last_step"]:
compute, waits per queue, lane busy time (the optimizer lane is the host Adam), bytes and busy time per link;
the others: forward+backward, clip and optimizer seconds, each synchronized); peak GPU memory
(max_memory_allocated); peak host RSS (VmHWM); the bound max(compute, host Adam, PCIe bytes / --pcie-GBps, disk
bytes / its rate) with compute = the torch run's own forward+backward at the same model and tokens (else its
achieved FLOP rate applied to this run's FLOPs, else --peak-tflops), host Adam = the optimizer family's bytes per
parameter (its Schema.update_bytes) x params / the host's measured memory traffic (2 x the multi-threaded copy's
GB/s), PCIe bytes = offload's rt.stats() links (the peers' their design's: "estimated"); and `offload plan`'s
prediction of the same run (its step model for this placement, with this machine's measured CPU AdamW rate,
--pcie-GBps and the plan's default MFU) beside the measurement.

    python benchmarks/gpu_scale.py --json gpu_scale.json                  # on the GPU (gpu_scale.sh wraps it)
    python benchmarks/gpu_scale.py --tiny --json tiny.json                # the same code path on a CPU, tiny
    python benchmarks/gpu_scale.py --dry-run                              # the runs, limits and settings only
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.util
import json
import os
import re
import signal
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import bench_emulated_gpu as emu  # noqa: E402  (the rt.stats() split's medians)
import bench_offload_step as bso  # noqa: E402  (children, timing, RSS, probes)

SCRIPT = os.path.abspath(__file__)
GiB = 1 << 30
DEFAULT_RUNS = ("offload-3b-16k", "torch-3b-16k", "offload-3b-64k", "torch-3b-64k", "fsdp2-3b-16k",
                "offload8bit-8b-64k", "deepspeed-3b-16k", "offload8bit-8b-16k")
CONTENDERS = ("offload", "offload8bit", "offloadnvme", "torch", "fsdp2", "deepspeed")
LIMIT_S = {"offload": 120, "offload8bit": 150, "offloadnvme": 180, "torch": 80, "fsdp2": 130, "deepspeed": 180}
FAMILY = {"offload8bit": "adamw8bit"}  # the optimizer family of each contender (default adamw)
# transformers.LlamaConfig keywords; "tiny" stands in for both at --tiny
MODELS = {
    "3b": dict(vocab_size=128256, hidden_size=3072, intermediate_size=8192, num_hidden_layers=28,
               num_attention_heads=24, num_key_value_heads=8, tie_word_embeddings=True, rope_theta=500000.0),
    "8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
               num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=False, rope_theta=500000.0),
    "tiny": dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, tie_word_embeddings=False),
}
FLOPS_NOTE = "model TFLOPS = 6 x params x tokens / s: attention's s^2 term and the recomputed forward not counted"
ROW_FIELDS = ("run", "contender", "model", "n_params", "tokens_per_step", "micro_batch", "accum", "seq",
              "s_per_step", "step_s", "tokens_per_s", "model_tflops", "mfu", "split", "peak_gpu_bytes",
              "peak_rss_bytes", "pcie_bytes_per_step", "pcie_bytes_source", "disk_bytes_per_step", "bound", "plan",
              "losses", "optimizer", "build_s", "child_wall_s")


@dataclasses.dataclass
class ScaleSettings(bso.Settings):
    run: str = ""
    contender: str = "offload"
    model: str = "3b"
    tokens_per_step: int = 16384
    seq: int = 4096
    batch: int = 4            # sequences per micro-batch
    warmup: int = 1
    steps: int = 2
    threads: int = bso.CORES
    lr: float = 1e-5
    tiny: bool = False
    cpu_budget: str = "auto"
    device_budget: str = "auto"

    @property
    def accum(self) -> int:
        return self.tokens_per_step // (self.batch * self.seq)

    @property
    def family(self) -> str:
        return FAMILY.get(self.contender, "adamw")


def parse_run(name: str, tiny: bool, seq: int) -> dict:
    """"offload-3b-64k" -> its contender, model and tokens per step (at --tiny: seq x TOKENSk / 8, a tiny model)."""
    m = re.fullmatch(rf"({'|'.join(CONTENDERS)})-(3b|8b)-(\d+)k", name)
    if not m:
        raise SystemExit(f"--runs: {name!r} is not CONTENDER-MODEL-TOKENSk with CONTENDER in {CONTENDERS}, MODEL "
                         "3b or 8b (e.g. offload-3b-16k)")
    k = int(m.group(3))
    tokens = seq * k // 8 if tiny else k * 1024
    return {"contender": m.group(1), "model": m.group(2), "tokens_per_step": tokens}


def llama_config(s: ScaleSettings):
    from transformers import LlamaConfig

    return LlamaConfig(**MODELS["tiny" if s.tiny else s.model], max_position_embeddings=max(4096, s.seq),
                       attn_implementation="sdpa")


# ---- children --------------------------------------------------------------------------------------

def _device(s: ScaleSettings):
    import torch

    bso.setup_threads(s)
    device = bso.compute_device()
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return device


def _ids(s: ScaleSettings, vocab: int, step: int, micro: int, device):
    """Micro-batch `micro` of step `step`: random token ids from a seeded generator (the same for every run)."""
    import torch

    g = torch.Generator().manual_seed(s.seed * 1_000_003 + step * 1009 + micro)
    return torch.randint(0, vocab, (s.batch, s.seq), generator=g).to(device, non_blocking=True)


def _peak_gpu(device) -> int | None:
    import torch

    return int(torch.cuda.max_memory_allocated(device)) if device.type == "cuda" else None


class Phases:
    """Seconds of each phase of a step, the device synchronized at each mark (the peers' split)."""

    def __init__(self, device):
        self.device, self.rows, self._t = device, [], None

    def start(self):
        bso.sync(self.device)
        self._t, self._row = time.perf_counter(), {}

    def mark(self, name: str):
        bso.sync(self.device)
        now = time.perf_counter()
        self._row[name] = self._row.get(name, 0.0) + now - self._t
        self._t = now

    def end(self):
        self.rows.append(self._row)

    def medians(self, last: int) -> dict:
        import numpy as np

        rows = self.rows[-last:]
        return {k: float(np.median([r.get(k, 0.0) for r in rows])) for k in rows[0]} if rows else {}


def _adamw(params, s: ScaleSettings):
    """torch.optim.AdamW, fused where it works on these parameters' device (else foreach), and its name."""
    import torch

    try:
        return torch.optim.AdamW(params, lr=s.lr, weight_decay=s.weight_decay, fused=True), "torch.optim.AdamW fused"
    except (RuntimeError, TypeError) as exc:
        return (torch.optim.AdamW(params, lr=s.lr, weight_decay=s.weight_decay, foreach=True),
                f"torch.optim.AdamW foreach (fused failed: {exc})")


def _plain_step(s, model, opt, device, phases: Phases, autocast: bool):
    """One optimizer step of a plain (torch / FSDP2) model: accumulate, clip, step; its phases timed."""
    import torch

    vocab = model.config.vocab_size

    def step(i):
        phases.start()
        total = torch.zeros((), device=device)
        for micro in range(s.accum):
            ids = _ids(s, vocab, i, micro, device)
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
                loss = model(input_ids=ids, labels=ids).loss / s.accum
            loss.backward()
            total += loss.detach()
        phases.mark("forward_backward_s")
        torch.nn.utils.clip_grad_norm_(model.parameters(), s.clip)
        phases.mark("clip_s")
        opt.step()
        opt.zero_grad(set_to_none=True)
        phases.mark("optimizer_s")
        phases.end()
        return float(total)

    return step


def run_torch(s: ScaleSettings) -> dict:
    import torch
    from transformers import LlamaForCausalLM

    from offload.finetune.job import checkpointing_on

    device = _device(s)
    t0 = time.perf_counter()
    torch.manual_seed(s.seed)
    with torch.device(device):  # fp32 parameters made and initialized on the device
        model = LlamaForCausalLM(llama_config(s))
    checkpointing_on(model)
    model.train()
    opt, impl = _adamw(model.parameters(), s)
    build_s = time.perf_counter() - t0
    phases = Phases(device)
    out = bso.timed_steps(s, _plain_step(s, model, opt, device, phases, autocast=True))
    compute = Phases(device)  # the bound's compute term: forward + backward alone, one step
    opt.zero_grad(set_to_none=True)
    compute.start()
    for micro in range(s.accum):
        ids = _ids(s, model.config.vocab_size, 0, micro, device)
        with torch.autocast(device.type, dtype=torch.bfloat16):
            (model(input_ids=ids, labels=ids).loss / s.accum).backward()
    compute.mark("compute_only_s")
    compute.end()
    return {**out, "n_params": sum(p.numel() for p in model.parameters()), "optimizer": impl, "build_s": build_s,
            "phases": phases.medians(s.steps), "compute_only_s": compute.rows[0]["compute_only_s"],
            "peak_gpu_bytes": _peak_gpu(device), "peak_rss_bytes": bso.peak_rss_bytes()}


def run_fsdp2(s: ScaleSettings) -> dict:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
    from transformers import LlamaForCausalLM

    from offload.finetune.job import checkpointing_on

    device = _device(s)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    t0 = time.perf_counter()
    mesh = init_device_mesh(device.type, (1,))
    torch.manual_seed(s.seed)
    with torch.device(device):  # made on the device; fully_shard moves the fp32 shards to (pinned) host memory
        model = LlamaForCausalLM(llama_config(s))
    checkpointing_on(model)
    model.train()
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    policy = CPUOffloadPolicy(pin_memory=device.type == "cuda")  # (pinning needs an accelerator)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp, offload_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=mp, offload_policy=policy)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    opt, impl = _adamw(model.parameters(), s)
    n_params = sum(p.numel() for p in model.parameters())
    build_s = time.perf_counter() - t0
    phases = Phases(device)
    out = bso.timed_steps(s, _plain_step(s, model, opt, device, phases, autocast=False))
    dist.destroy_process_group()
    # host <-> device per step, by FSDP2's design: each micro-batch's two all-gathers copy the fp32 shards up
    # (forward and backward: reshard_after_forward) and its reduce-scatter the fp32 gradient down
    return {**out, "n_params": n_params, "optimizer": impl + " (CPU)", "build_s": build_s,
            "phases": phases.medians(s.steps), "peak_gpu_bytes": _peak_gpu(device),
            "peak_rss_bytes": bso.peak_rss_bytes(), "pcie_bytes_per_step": 12.0 * n_params * s.accum,
            "pcie_bytes_source": "estimated: 2 x 4 B up (fp32 all-gathers) + 4 B down (fp32 gradient) per param "
                                 "and micro-batch"}


def ds_config(s: ScaleSettings) -> dict:
    return {"train_micro_batch_size_per_gpu": s.batch, "gradient_accumulation_steps": s.accum,
            "gradient_clipping": s.clip, "bf16": {"enabled": True},
            "optimizer": {"type": "AdamW", "params": {"lr": s.lr, "weight_decay": s.weight_decay,
                                                      "betas": [0.9, 0.999], "eps": 1e-8}},
            "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": True},
                                  "overlap_comm": True, "contiguous_gradients": True},
            "steps_per_print": 1 << 30, "wall_clock_breakdown": False}


def run_deepspeed(s: ScaleSettings) -> dict:
    import deepspeed
    import torch
    from transformers import LlamaForCausalLM

    from offload.finetune.job import checkpointing_on

    device = _device(s)
    deepspeed.init_distributed(dist_backend="nccl" if device.type == "cuda" else "gloo")
    config, client, note = ds_config(s), None, "DeepSpeedCPUAdam"
    t0 = time.perf_counter()
    try:
        from deepspeed.ops.op_builder import CPUAdamBuilder

        CPUAdamBuilder().load()  # JIT-built on first use
    except Exception as exc:  # noqa: BLE001 - no compiler / CUDA headers: torch's AdamW on its CPU partitions
        config.pop("optimizer")
        config["zero_force_ds_cpu_optimizer"] = False
        note = f"torch.optim.AdamW on the CPU partitions (DeepSpeedCPUAdam could not be built: {exc!r:.300})"
    build_op_s = time.perf_counter() - t0
    torch.manual_seed(s.seed)
    with deepspeed.zero.Init(config_dict_or_path=config):  # partitioned on the device as each module is made
        model = LlamaForCausalLM(llama_config(s))
    checkpointing_on(model)
    model.train()
    if "optimizer" not in config:
        client = torch.optim.AdamW(model.parameters(), lr=s.lr, weight_decay=s.weight_decay)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config,
                                           optimizer=client)
    n_params = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())
    build_s = time.perf_counter() - t0
    phases = Phases(device)
    vocab = model.config.vocab_size

    def step(i):
        phases.start()
        total = 0.0
        for micro in range(s.accum):
            ids = _ids(s, vocab, i, micro, device)
            loss = engine(input_ids=ids, labels=ids).loss
            engine.backward(loss)  # (scaled by 1 / accum inside)
            engine.step()  # steps, clipped, at the accumulation boundary only
            total += float(loss) / s.accum
        phases.mark("step_s")
        phases.end()
        return total

    out = bso.timed_steps(s, step)
    if hasattr(engine, "destroy"):
        engine.destroy()
    return {**out, "n_params": n_params, "optimizer": note, "build_s": build_s, "build_op_s": build_op_s,
            "phases": phases.medians(s.steps), "peak_gpu_bytes": _peak_gpu(device),
            "peak_rss_bytes": bso.peak_rss_bytes(), "pcie_bytes_per_step": (4.0 * s.accum + 2.0) * n_params,
            "pcie_bytes_source": "estimated: 4 B down (fp32 gradient partition) per param and micro-batch, 2 B up "
                                 "(bf16 params) per step", "ds_config": config}


def run_offload(s: ScaleSettings) -> dict:
    import torch
    from transformers import LlamaForCausalLM

    import offload
    from offload.finetune.job import checkpointing_on

    device = _device(s)
    nvme = s.contender == "offloadnvme"
    cfg = offload.Config(params="device", grads="device", optimizer="nvme" if nvme else "cpu",
                         nvme_path=s.nvme_dir if nvme else None, compute_dtype="bf16", cpu_budget=s.cpu_budget,
                         device_budget=s.device_budget, optimizer_states=s.family, seed=s.seed)
    t0 = time.perf_counter()
    with offload.init(cfg) as rt:
        model = LlamaForCausalLM(llama_config(s))  # placeholders: each unit is made on the GPU when sharded
        rt.wrap(model)
        checkpointing_on(model)  # (after the wrap, as `offload finetune` does)
        model.train()
        optimizer = offload.AdamW8bit if s.family == "adamw8bit" else offload.AdamW
        opt = optimizer(model.parameters(), lr=s.lr, weight_decay=s.weight_decay)
        n_params = sum(p.numel() for p in model.parameters())
        build_s = time.perf_counter() - t0
        vocab, splits = model.config.vocab_size, []

        def step(i):
            total = torch.zeros((), device=rt.device)
            for micro in range(s.accum):
                ids = _ids(s, vocab, i, micro, rt.device)
                with rt.accumulating() if micro < s.accum - 1 else contextlib.nullcontext():
                    loss = model(input_ids=ids, labels=ids).loss / s.accum
                    loss.backward()
                total += loss.detach()
            rt.clip_grad_norm_(s.clip)
            opt.step()
            opt.zero_grad()
            splits.append(rt.stats()["last_step"])
            return float(total)

        marks = []
        out = bso.timed_steps(s, step, drain=rt.quiesce, at_start=lambda: marks.append(rt.stats()))
        before, after = marks[0], rt.stats()
        tiers = {"params": rt.params_tier, "optimizer": rt.optimizer_tier, "grads": rt.grads_tier}
    per_step = lambda key: (after[key] - before[key]) / s.steps  # noqa: E731
    return {**out, "n_params": n_params, "optimizer": type(opt).__name__, "build_s": build_s, "tiers": tiers,
            "split": emu._split(splits[-s.steps:]), "last_steps": splits[-s.steps:],
            "throughput": splits[-1].get("throughput"), "peak_gpu_bytes": _peak_gpu(device),
            "peak_rss_bytes": bso.peak_rss_bytes(), "budgets": after["budgets"],
            "pcie_bytes_per_step": per_step("host_to_device_bytes") + per_step("device_to_host_bytes"),
            "pcie_bytes_source": "rt.stats()",
            "disk_bytes_per_step": per_step("nvme_read_bytes") + per_step("nvme_written_bytes"),
            "nvme_read_bytes_per_step": per_step("nvme_read_bytes"),
            "nvme_written_bytes_per_step": per_step("nvme_written_bytes")}


def probe_host(s: ScaleSettings) -> dict:
    """The host's memory traffic (offload's multi-threaded copy, all cores) and the fused CPU AdamW's rate."""
    from offload.bench.host import adam_bench, memcpy_bench

    bso.setup_threads(s)
    size = 64 << 20 if s.tiny else GiB
    copy = memcpy_bench([size], [bso.CORES], rounds=3)
    adam = adam_bench(1 << 20 if s.tiny else 1 << 26, rounds=3)
    return {"copy_GBps": copy["best_GBps"], "host_traffic_Bps": 2e9 * copy["best_GBps"],
            "adam_params_per_s": adam["offload_params_per_s"], "adam": adam, "cores": bso.CORES}


CHILDREN = {"torch": run_torch, "fsdp2": run_fsdp2, "deepspeed": run_deepspeed, "probe-host": probe_host,
            "probe-nvme": lambda s: bso.probe_nvme(s, size=(64 << 20) if s.tiny else GiB),
            **{c: run_offload for c in ("offload", "offload8bit", "offloadnvme")}}


def child_main(name: str, settings_json: str) -> None:
    s = ScaleSettings(**json.loads(settings_json))
    result = CHILDREN[name](s)
    result["contender"] = name
    bso.emit(result)


# ---- parent: the figures of a run --------------------------------------------------------------------

def update_bytes(family: str) -> float:
    from offload.optim.schema import by_name

    return by_name(family).update_bytes


def host_ram_bytes() -> int:
    import psutil

    return psutil.virtual_memory().total


def plan_prediction(s: ScaleSettings, host: dict, pcie_Bps: float, placement: tuple, work: str) -> dict:
    """`offload plan`'s step model for this run: the plan built from the same flags the CLI takes (this model's
    config.json, one GPU, this host's RAM and measured CPU AdamW rate, the PCIe rate), then its prediction for
    the placement the run used (the plan's own choice beside it)."""
    from offload.cli import build_parser
    from offload.plan.cli import plan_from_args
    from offload.plan.memory import Placement, Workload, tier_bytes
    from offload.plan.model_spec import model_from
    from offload.plan.sizing import capacity
    from offload.plan.step_time import Machine, predict

    path = os.path.join(work, f"config-{'tiny' if s.tiny else s.model}.json")
    llama_config(s).to_json_file(path)
    # the machine's stated RAM (a VM's MemTotal can start lower and grow as it is used)
    ram = host_ram_bytes() if s.tiny else 128 * GiB
    argv = ["plan", "--model", path, "--gpus", "1", "--gpu", "cpu" if s.tiny else "h200", "--cpu-mem",
            f"{ram >> 20}MiB", "--micro-batch", str(s.batch), "--seq-len", str(s.seq), "--grad-accum",
            str(s.accum), "--optimizer-states", s.family, "--pcie", f"{pcie_Bps / 1e9:g}GB/s",
            "--adam-params-per-s", f"{host['adam_params_per_s']:.4g}"]
    plan = plan_from_args(build_parser(only="plan").parse_args(argv))
    m, w, mc = model_from(path), Workload(**plan["workload"]), Machine(**plan["machine"])
    place = Placement(*placement)
    cap = capacity(1, ram, None)
    room = cap.cpu_per_node - sum(tier_bytes(m, w, 1, place)["cpu"].values())
    p = predict(m, w, place, mc, resident_bytes=max(0.0, room))
    chosen = plan["chosen"]
    return {"command": "offload " + " ".join(argv), "placement": str(place), "predicted_s": p["step_s"],
            "tokens_per_s": p["tokens_per_s"], "resources": p["resources"], "bottleneck": p["bottleneck"],
            "mfu_assumed": mc.mfu, "device_flops": mc.device_flops,
            "plan_chose": str(chosen["placement"]) if chosen else None,
            "plan_chose_s": chosen["prediction"]["step_s"] if chosen else None}


def offload_cpu_budget(s: ScaleSettings) -> str:
    """The cpu tier an offload run asks for: what the plan puts there for its placement (master + moments, and
    staging with nvme), 10% more and 2 GiB for the lanes; `auto` with states on nvme (the tier keeps what fits)."""
    if s.contender == "offloadnvme":
        return "auto"
    if s.tiny:
        return "256MiB"
    from offload.plan.memory import Placement, Workload, tier_bytes
    from offload.plan.model_spec import spec_from_config

    m = spec_from_config(llama_config(s).to_dict(), s.model)
    w = Workload(micro_batch=s.batch, seq_len=s.seq, grad_accum=s.accum, optimizer_states=s.family)
    need = sum(tier_bytes(m, w, 1, Placement("device", "cpu", "device"))["cpu"].values())
    return f"{int(need * 1.1 / GiB) + 2}GiB"


def bound(row: dict, s: ScaleSettings, host: dict, nvme: dict | None, rows: dict, args) -> dict:
    """max(compute, host Adam, PCIe, disk) for a run (module docstring), each term and which one binds."""
    flops = 8.0 * row["n_params"] * s.tokens_per_step  # forward, backward and the recomputed forward (6 + 2)
    same = next((r for r in rows.values() if r.get("contender") == "torch" and r["model"] == s.model
                 and r["tokens_per_step"] == s.tokens_per_step and r.get("compute_only_s")), None)
    any_torch = next((r for r in rows.values() if r.get("contender") == "torch" and r.get("compute_only_s")), None)
    if same and same.get("compute_only_s"):
        compute, source = same["compute_only_s"], f"{same['run']}: forward + backward measured"
    elif any_torch:
        rate = 8.0 * any_torch["n_params"] * any_torch["tokens_per_step"] / any_torch["compute_only_s"]
        compute = flops / rate
        source = f"{any_torch['run']}'s achieved rate ({rate / 1e12:.0f} TFLOP/s) x this run's FLOPs"
    else:
        compute, source = flops / (args.peak_tflops * 1e12), f"FLOPs at {args.peak_tflops:g} TFLOP/s"
    on_host = row["contender"] != "torch"
    family = FAMILY.get(row["contender"], "adamw")
    terms = {"compute": compute,
             "host_adam": update_bytes(family) * row["n_params"] / host["host_traffic_Bps"] if on_host else 0.0,
             "pcie": (row.get("pcie_bytes_per_step") or 0.0) / (args.pcie_GBps * 1e9),
             "disk": 0.0}
    if row.get("disk_bytes_per_step") and nvme:
        terms["disk"] = (row["nvme_read_bytes_per_step"] / nvme["read_Bps"]
                         + row["nvme_written_bytes_per_step"] / nvme["write_Bps"])
    binds = max(terms, key=terms.get)
    return {"terms_s": terms, "binds": binds, "bound_s": terms[binds], "efficiency": terms[binds] / row["s_per_step"],
            "compute_source": source, "host_adam_bytes_per_param": update_bytes(family) if on_host else 0.0,
            "kernel_s": row["n_params"] / host["adam_params_per_s"] * update_bytes(family) / 28.0 if on_host else 0.0}


def summarize(name: str, res: dict, s: ScaleSettings, host: dict, nvme: dict | None, rows: dict, args,
              work: str) -> dict:
    from offload.throughput import model_tflops

    row = {"run": name, "contender": s.contender, "model": s.model, "tokens_per_step": s.tokens_per_step,
           "micro_batch": s.batch, "accum": s.accum, "seq": s.seq, "child_wall_s": res.get("child_wall_s")}
    if "error" in res:
        return {**row, "error": res["error"], "output_tail": res.get("output_tail")}
    sps = res["s_per_step"]
    row.update({k: res.get(k) for k in ("n_params", "step_s", "losses", "optimizer", "build_s", "peak_gpu_bytes",
                                        "peak_rss_bytes", "pcie_bytes_per_step", "pcie_bytes_source",
                                        "compute_only_s", "tiers", "throughput", "nvme_read_bytes_per_step",
                                        "nvme_written_bytes_per_step", "build_op_s", "last_steps", "budgets",
                                        "phases", "ds_config")})
    row["disk_bytes_per_step"] = res.get("disk_bytes_per_step", 0.0)
    if s.contender == "torch":
        row["pcie_bytes_per_step"], row["pcie_bytes_source"] = 0.0, "none: everything in GPU memory"
    tflops = model_tflops(row["n_params"], s.tokens_per_step, sps)
    row.update(s_per_step=sps, tokens_per_s=s.tokens_per_step / sps, model_tflops=tflops,
               mfu=tflops / args.peak_tflops, split=res.get("split") or res.get("phases"))
    row["bound"] = bound(row, s, host, nvme, {**rows, name: row}, args)
    placement = {"torch": ("device", "device", None), "offloadnvme": ("device", "nvme", "device")}.get(
        s.contender, ("device", "cpu", "device") if s.contender.startswith("offload") else None)
    row["plan"] = None
    if placement is not None:
        try:
            row["plan"] = plan_prediction(s, host, args.pcie_GBps * 1e9, placement, work)
            row["plan"]["error"] = row["plan"]["predicted_s"] / sps - 1.0
        except Exception as exc:  # noqa: BLE001 - the measurement stands without its prediction
            row["plan"] = {"error_text": repr(exc)}
    return row


def fmt_gib(n) -> str:
    return bso.fmt_bytes(n) if n is not None else "-"


def print_row(row: dict) -> None:
    if "error" in row:
        print(f"!! {row['run']}: {row['error']}", flush=True)
        return
    b = row["bound"]
    print(f"== {row['run']}: {row['n_params'] / 1e9:.3f}B params, {row['tokens_per_step']} tokens/step "
          f"({row['accum']} x {row['micro_batch']} x {row['seq']}): {row['s_per_step']:.3f} s/step, "
          f"{row['tokens_per_s']:.0f} tok/s, {row['model_tflops']:.1f} model TFLOPS, MFU {100 * row['mfu']:.1f}%, "
          f"peak GPU {fmt_gib(row['peak_gpu_bytes'])}, peak RSS {fmt_gib(row['peak_rss_bytes'])}, "
          f"build {row['build_s']:.1f} s, {row['optimizer']}", flush=True)
    split = row.get("split") or {}
    if "wall_s" in split:
        links = split["links"].items()
        print(f"   split: {emu.fmt_split(split)} | links "
              + ", ".join(f"{k} {bso.fmt_bytes(v['bytes'])} busy {v['busy_s']:.3f}s" for k, v in links))
    elif split:
        print("   split: " + ", ".join(f"{k} {v:.3f}" for k, v in split.items()))
    print(f"   bound {b['bound_s']:.3f} s ({b['binds']}; " + ", ".join(f"{k} {v:.3f}" for k, v in b["terms_s"].items())
          + f"; compute: {b['compute_source']}), efficiency {b['efficiency']:.2f}", flush=True)
    p = row.get("plan")
    if p and "predicted_s" in p:
        print(f"   plan {p['placement']}: predicted {p['predicted_s']:.3f} s ({p['bottleneck']}), measured "
              f"{row['s_per_step']:.3f} s, error {100 * p['error']:+.1f}%; the plan would choose {p['plan_chose']}",
              flush=True)


def targets(rows: dict) -> dict:
    """Issue 42's targets, from the runs that ran (None where a run is missing)."""
    def tps(name):
        r = rows.get(name, {})
        return r.get("tokens_per_s")

    def ratio(a, b):
        return tps(a) / tps(b) if tps(a) and tps(b) else None

    out = {"3b_64k_offload_over_torch (>= 0.85)": ratio("offload-3b-64k", "torch-3b-64k"),
           "3b_16k_offload_bound_over_step (>= 0.8)": (rows.get("offload-3b-16k", {}).get("bound") or {}).get(
               "efficiency"),
           "3b_16k_offload_over_deepspeed (>= 1.5)": ratio("offload-3b-16k", "deepspeed-3b-16k"),
           "3b_16k_offload_over_fsdp2 (>= 1.5)": ratio("offload-3b-16k", "fsdp2-3b-16k"),
           "8b_64k_8bit_model_tflops (>= 300)": rows.get("offload8bit-8b-64k", {}).get("model_tflops")}
    errors = {n: r["plan"]["error"] for n, r in rows.items() if (r.get("plan") or {}).get("error") is not None}
    out["plan_error_within_10pct"] = {n: abs(e) <= 0.10 for n, e in errors.items()}
    return out


# ---- parent ---------------------------------------------------------------------------------------------

def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", default=",".join(DEFAULT_RUNS), help="CONTENDER-MODEL-TOKENSk names, in order")
    ap.add_argument("--tiny", action="store_true", help="a tiny Llama on whatever device there is (the CPU test)")
    ap.add_argument("--dry-run", action="store_true", help="print the runs, limits and settings; run nothing")
    ap.add_argument("--budget-s", type=float, default=520.0, help="wall time for every run together")
    ap.add_argument("--limit-scale", type=float, default=1.0, help="multiplies every run's own time limit")
    ap.add_argument("--micro-batch", type=int, default=None, help="sequences per micro-batch (default 4; tiny 2)")
    ap.add_argument("--seq", type=int, default=None, help="tokens per sequence (default 4096; tiny 64)")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--steps", type=int, default=2, help="timed steps after --warmup")
    ap.add_argument("--threads", type=int, default=bso.CORES)
    ap.add_argument("--peak-tflops", type=float, default=790.0, help="MFU's denominator (the H200's measured bf16)")
    ap.add_argument("--pcie-GBps", type=float, default=55.0, help="the bound's PCIe rate per direction")
    ap.add_argument("--nvme-path", default=None, help="swap directory of offloadnvme (default: a temp dir)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--settings", default=None, help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.child:
        child_main(args.child, args.settings)
        return 0
    started = time.time()
    # a SIGTERM (gpu_scale.sh's timeout) unwinds like Ctrl-C, so the run in flight (its own process group) goes too
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    seq = args.seq or (64 if args.tiny else 4096)
    batch = args.micro_batch or (2 if args.tiny else 4)
    names = [n.strip() for n in args.runs.split(",") if n.strip()]
    base = ScaleSettings(seq=seq, batch=batch, warmup=args.warmup, steps=args.steps, threads=args.threads,
                         tiny=args.tiny)
    plans = {}
    for name in names:
        s = dataclasses.replace(base, run=name, **parse_run(name, args.tiny, seq))
        if s.tokens_per_step % (s.batch * s.seq):
            raise SystemExit(f"--runs {name}: {s.tokens_per_step} tokens per step is not a multiple of --micro-batch "
                             f"{s.batch} x --seq {s.seq}; choose a micro-batch that divides it")
        if s.contender.startswith("offload"):
            s = dataclasses.replace(s, cpu_budget=offload_cpu_budget(s))
        plans[name] = (s, LIMIT_S[s.contender] * args.limit_scale)
    print(f"# gpu_scale: {len(names)} runs, budget {args.budget_s:.0f} s; {FLOPS_NOTE}; MFU against "
          f"{args.peak_tflops:g} TFLOP/s", flush=True)
    for name, (s, limit) in plans.items():
        print(f"#   {name:<22} {s.contender:<12} {'tiny' if s.tiny else s.model} {s.tokens_per_step} tokens/step = "
              f"{s.accum} x {s.batch} x {s.seq}, limit {limit:.0f} s" + (f", cpu_budget {s.cpu_budget}"
                                                                         if s.contender.startswith("offload") else ""))
    if args.dry_run:
        return 0
    work = tempfile.mkdtemp(prefix="gpu-scale-")
    root = args.nvme_path or work
    left = lambda: args.budget_s - (time.time() - started)  # noqa: E731
    import psutil

    vm = psutil.virtual_memory()  # at the start: offload's budgets are checked against the host's memory
    print(f"# host memory: {bso.fmt_bytes(vm.total)} total, {bso.fmt_bytes(vm.available)} available", flush=True)
    doc = {"command": [sys.executable] + sys.argv, "machine": {**bso.machine_info(), "host_memory_total": vm.total,
                                                               "host_memory_available": vm.available},
           "flops_note": FLOPS_NOTE,
           "peak_tflops": args.peak_tflops, "pcie_GBps": args.pcie_GBps, "budget_s": args.budget_s,
           "tiny": args.tiny, "order": names, "probes": {}, "runs": {}, "skipped": {}}

    def write():
        doc["wall_s"] = time.time() - started
        doc["targets"] = targets(doc["runs"])
        if args.json:
            tmp = args.json + ".partial"
            with open(tmp, "w") as f:
                json.dump(doc, f, indent=1, default=str)
            os.replace(tmp, args.json)

    probe = dataclasses.replace(base, nvme_dir=os.path.join(root, "probe-host"))
    host = bso.spawn("probe-host", probe, script=SCRIPT, timeout_s=min(60.0, max(5.0, left())))
    doc["probes"]["host"] = host
    if "error" in host:
        print("!! probe-host failed: the bound's host Adam term and the plan use 10 GB/s and 1e9 params/s", flush=True)
        host = {"host_traffic_Bps": 10e9, "adam_params_per_s": 1e9, "copy_GBps": 5.0}
    print(f"# host: copy {host['copy_GBps']:.1f} GB/s (traffic {host['host_traffic_Bps'] / 1e9:.1f} GB/s), fused CPU "
          f"AdamW {host['adam_params_per_s'] / 1e9:.2f} G params/s", flush=True)
    nvme = None
    if any(s.contender == "offloadnvme" for s, _ in plans.values()):
        nvme = bso.spawn("probe-nvme", dataclasses.replace(base, nvme_dir=os.path.join(root, "probe-nvme")),
                         script=SCRIPT, timeout_s=min(60.0, max(5.0, left())))
        doc["probes"]["nvme"] = nvme
        nvme = None if "error" in nvme else nvme
    write()
    has_ds = importlib.util.find_spec("deepspeed") is not None
    for name, (s, limit) in plans.items():
        if s.contender == "deepspeed" and not has_ds:
            doc["skipped"][name] = "deepspeed is not importable (carry .whl/ from benchmarks/deepspeed_wheels.sh)"
            print(f"-- {name}: skipped: {doc['skipped'][name]}", flush=True)
            continue
        budget = min(limit, left() - 5.0)
        if budget < min(30.0, limit):
            doc["skipped"][name] = f"{left():.0f} s of the budget left"
            print(f"-- {name}: skipped: {doc['skipped'][name]}", flush=True)
            continue
        print(f"# {name} (limit {budget:.0f} s) ...", flush=True)
        res = bso.spawn(s.contender, dataclasses.replace(s, nvme_dir=os.path.join(root, name)), script=SCRIPT,
                        timeout_s=budget)
        doc["runs"][name] = summarize(name, res, s, host, nvme, doc["runs"], args, work)
        print_row(doc["runs"][name])
        write()
    write()
    print("# targets: " + json.dumps(doc["targets"], default=str), flush=True)
    print(f"# {time.time() - started:.0f} s" + (f"; wrote {args.json}" if args.json else ""), flush=True)
    return 0 if all("error" not in r for r in doc["runs"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
