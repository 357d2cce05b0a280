"""`offload plan`: will a fine-tune fit, where will each state live, and how long will a step take.

    offload plan --model llama-70b --gpus 8 --gpu-mem 80GiB --cpu-mem 1TiB --nvme-read 25GB/s --nvme-write 12GB/s

Prints the bytes of each state class per tier per rank for the chosen placement, whether it fits (or what
is short by how much), the predicted step time split by resource, the bottleneck, tokens/s, and the
smallest changes worth making. Bandwidths come from flags, or from an `offload bench --json` file.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from ..config import parse_size
from ..store.sizes import format_bytes
from .memory import Workload, state_bytes
from .model_spec import PRESETS, model_from
from .sizing import DEVICES, SEQ_MAX, advice, capacity, choose, config_for, evaluate, longest_sequences
from ..bench.figures import bench_figures
from .step_time import Machine

# the built-in optimizer families (offload.optim.schema.names(); spelled out: building the parser imports no torch)
OPTIMIZER_STATES = ("adamw", "adamw-bf16", "adamw8bit", "lion")


def parse_rate(text: str, flag: str) -> float:
    """Bytes/s from "25GB/s" / "3.5GiB/s" / a number."""
    value = text.strip()
    if value.lower().endswith("/s"):
        value = value[:-2]
    try:
        rate = float(parse_size(value, flag))
    except ValueError:
        raise ValueError(f"{flag} {text!r}: give a rate such as 25GB/s or 3.5GiB/s") from None
    if rate <= 0:
        raise ValueError(f"{flag} {text!r}: a rate must be above zero; give one such as 25GB/s or 3.5GiB/s")
    return rate


def _count(flag: str, least: int = 1):
    """argparse type: an integer of at least `least` (one line naming the flag otherwise, no traceback)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if value < least:
            raise argparse.ArgumentTypeError(f"{value} is below {least}; {flag} counts {_WHAT[flag]}")
        return value
    return parse


_WHAT = {"--gpus": "GPUs per node", "--nodes": "nodes", "--micro-batch": "sequences per GPU per micro-batch",
         "--seq-len": "tokens per sequence", "--grad-accum": "micro-batches per optimizer step"}


def _positive(flag: str, most: float | None = None):
    """argparse type: a number > 0 (and <= `most`)."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not value > 0 or (most is not None and value > most):
            bound = f" and at most {most:g}" if most is not None else ""
            raise argparse.ArgumentTypeError(f"{value:g} must be above 0{bound}")
        return value
    return parse


def _size(flag: str):
    """argparse type: a size with its unit ("80GiB"): a bare number would be bytes, never what was meant."""
    def parse(text: str) -> str:
        try:  # (a number without a unit: refused by the one size rule, store/sizes.py)
            if parse_size(text, flag) <= 0:
                raise argparse.ArgumentTypeError(f"{text!r} must be above 0")
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
        return text
    return parse


def plan_from_args(args: argparse.Namespace) -> dict:
    m = model_from(args.model)
    dev = DEVICES[args.gpu]
    figures = dict(device_flops=dev["device_flops"] if args.tflops is None else args.tflops * 1e12,
                   pcie_Bps=dev["pcie_Bps"], interconnect_Bps=dev["interconnect_Bps"])
    if args.bench_json:
        figures.update(bench_figures(args.bench_json, "--bench-json"))
    for flag, key in (("nvme_read", "nvme_read_Bps"), ("nvme_write", "nvme_write_Bps"), ("pcie", "pcie_Bps")):
        if getattr(args, flag):
            figures[key] = parse_rate(getattr(args, flag), "--" + flag.replace("_", "-"))
    if args.adam_params_per_s:
        figures["adam_params_per_s"] = args.adam_params_per_s
    mc = Machine(gpus_per_node=args.gpus, nodes=args.nodes, mfu=args.mfu, **figures)
    w = Workload(micro_batch=args.micro_batch, seq_len=args.seq_len if args.seq_len is not None else min(m.max_seq, 4096),
                 grad_accum=args.grad_accum, checkpointing=not args.no_checkpointing,
                 update_in_backward=args.update_in_backward, activations=args.activations,
                 speculative_updates=not args.no_speculative_updates, unclipped=args.unclipped,
                 optimizer_states=args.optimizer_states)
    cap = capacity(parse_size(args.gpu_mem, "--gpu-mem") if args.gpu_mem else dev["memory"], parse_size(args.cpu_mem, "--cpu-mem"),
                   parse_size(args.nvme_size, "--nvme-size") if args.nvme_size else None)
    options = evaluate(m, w, mc, cap)
    chosen = choose(options)
    # for the placement chosen (or, when none fits, the closest): how long a sequence fits, activations where
    closest = chosen or min(options, key=lambda o: sum(o["short"].values()))
    model = dataclasses.asdict(m) | {"params": m.params, "active_params": m.active_params}
    return {"model": model, "workload": dataclasses.asdict(w),
            "machine": dataclasses.asdict(mc), "capacity": dataclasses.asdict(cap), "options": options,
            "chosen": chosen, "advice": advice(m, w, mc, cap, chosen),
            "config": config_for(chosen, cap, mc.gpus_per_node) if chosen else None,
            "longest_seq": {"placement": str(closest["placement"]),
                            "tokens": longest_sequences(m, w, mc, cap, closest["placement"])}}


def _count_of(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")


def _params(n: int) -> str:
    """46.70B, 12.3M, or the count itself: a tiny model is not "0.00B"."""
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M" if n >= 1e6 else f"{n:,}"


def _experts(m: dict) -> str:
    """", 12.88B active per token (2 of 8 experts in 32 of 32 layers)" for a MoE model; "" for a dense one."""
    if not m.get("experts"):
        return ""
    return (f", {_params(m['active_params'])} active per token ({m['experts_per_token']} of {m['experts']} experts "
            f"in {m['moe_layers']} of {m['layers']} layers)")


def _gib(x: float) -> str:
    return format_bytes(int(x))


def _print(plan: dict) -> None:
    m, w, mc = plan["model"], plan["workload"], plan["machine"]
    ranks = mc["gpus_per_node"] * mc["nodes"]
    print(f"{m['name']}: {_params(m['params'])} parameters{_experts(m)}; {_count_of(ranks, 'rank')} "
          f"({_count_of(mc['nodes'], 'node')} x "
          f"{mc['gpus_per_node']}); micro-batch {w['micro_batch']} x seq {w['seq_len']}, accumulation "
          f"{w['grad_accum']}, activation checkpointing {'on' if w['checkpointing'] else 'off'}"
          + (f", activations offloaded to {w['activations']}" if w['activations'] != "none" else ""))
    if w["activations"] == "auto" and plan["chosen"] is not None:
        print(f"activations auto: {plan['chosen']['activations']} for the placement chosen")
    sb = state_bytes(Workload(optimizer_states=w["optimizer_states"]))
    states = m["params"] * sb.total
    print(f"model states: {_gib(states)} in all ({sb.total:.4g} bytes/param: bf16 param, fp32 grad, master, "
          f"{w['optimizer_states']} states {sb.moments:.4g}), {_gib(states / ranks)} per rank")
    c = plan["chosen"]
    if c is None:
        print("does NOT fit any placement:")
        for tip in plan["advice"]:
            print(f"  - {tip}")
        _print_longest(plan["longest_seq"])
        return
    print(f"fits: placement {c['placement']}")
    if not c.get("gather_ahead", True):
        print("  the device budget holds one gathered unit, not the next one ahead too: the runtime gathers each "
              "unit when it is needed")
    if not c.get("speculative_updates", True) and w["speculative_updates"]:
        print("  no nvme room for speculative updates' spare slots (the optimizer states' size again): the runtime "
              "runs without them (each update waits for the step)")
    print(f"  {'per rank':<14}" + "".join(f"{t:>12}" for t in ("device", "cpu", "nvme")))
    classes = sorted({k for tier in c["tiers"].values() for k in tier})
    for cls in classes:
        print(f"  {cls:<14}" + "".join(f"{_gib(c['tiers'][t].get(cls, 0)) if cls in c['tiers'][t] else '-':>12}"
                                      for t in ("device", "cpu", "nvme")))
    print("run it with: offload.Config(" + ", ".join(f"{k}={v!r}" for k, v in plan["config"].items()) + ")")
    p = c["prediction"]
    print(f"predicted step {p['step_s']:.2f} s, {p['tokens_per_s']:.0f} tokens/s; bottleneck: {p['bottleneck']}")
    print("  busy per step: " + ", ".join(f"{k} {v:.2f} s" for k, v in p["resources"].items()))
    print("  phases: " + ", ".join(f"{k} {v:.3f} s" for k, v in p["phases"].items()))
    others = sorted((o for o in plan["options"] if not o["short"] and o is not c),
                    key=lambda o: o["prediction"]["step_s"])
    if others:
        print("other placements that fit: " + "; ".join(f"{o['placement']} {o['prediction']['step_s']:.2f} s"
                                                       for o in others))
    for tip in plan["advice"]:
        print(f"  - {tip}")
    _print_longest(plan["longest_seq"])


def _print_longest(longest: dict) -> None:
    def tokens(n: int) -> str:
        return "none" if n == 0 else (f"{n} or more" if n >= SEQ_MAX else str(n))

    t = longest["tokens"]
    print(f"longest sequence that fits {longest['placement']} (micro-batch and the rest as above): "
          f"{tokens(t['none'])} tokens with the activations on the device, {tokens(t['cpu'])} offloaded to cpu, "
          f"{tokens(t['nvme'])} to nvme, {tokens(t['auto'])} with auto")


def _cmd_plan(args: argparse.Namespace) -> int:
    try:
        plan = plan_from_args(args)
    except ValueError as exc:
        print(f"offload plan: error: {exc}", file=sys.stderr)
        return 2
    _print(plan)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(plan, f, indent=2, default=str)
    return 0


def add_plan_parser(sub, help_line: str) -> None:
    p = sub.add_parser("plan", help=help_line,
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help=f"a config.json (or its directory) or one of {', '.join(PRESETS)}")
    p.add_argument("--gpus", type=_count("--gpus"), default=8, help="GPUs per node (default 8)")
    p.add_argument("--nodes", type=_count("--nodes"), default=1, help="nodes (default 1)")
    p.add_argument("--gpu", choices=sorted(DEVICES), default="h100",
                   help="GPU model: its memory, bf16 TFLOP/s, PCIe and interconnect figures (default h100)")
    p.add_argument("--gpu-mem", type=_size("--gpu-mem"), help="memory per GPU, e.g. 80GiB (default: the GPU's)")
    p.add_argument("--cpu-mem", type=_size("--cpu-mem"), default="1TiB", help="host RAM per node (default 1TiB)")
    p.add_argument("--nvme-size", type=_size("--nvme-size"), help="free NVMe space per node (default: unbounded)")
    p.add_argument("--nvme-read", help="NVMe read per node, e.g. 25GB/s")
    p.add_argument("--nvme-write", help="NVMe write per node, e.g. 12GB/s")
    p.add_argument("--pcie", help="host<->device per GPU and direction, e.g. 50GB/s")
    p.add_argument("--bench-json", help="figures measured by offload bench --json")
    p.add_argument("--adam-params-per-s", type=_positive("--adam-params-per-s"),
                   help="CPU AdamW throughput per node")
    p.add_argument("--tflops", type=_positive("--tflops"), help="peak dense bf16 TFLOP/s per GPU (default: the GPU's)")
    p.add_argument("--mfu", type=_positive("--mfu", most=1.0), default=0.4,
                   help="fraction of the peak a step achieves (0 < mfu <= 1; default 0.4)")
    p.add_argument("--micro-batch", type=_count("--micro-batch"), default=1,
                   help="sequences per forward, per GPU (default 1)")
    p.add_argument("--seq-len", type=_count("--seq-len"), help="default: the model's maximum, at most 4096")
    p.add_argument("--grad-accum", type=_count("--grad-accum"), default=1,
                   help="micro-batches per optimizer step (default 1)")
    p.add_argument("--no-checkpointing", action="store_true", help="activation checkpointing off")
    p.add_argument("--update-in-backward", action="store_true",
                   help="model Config.update_in_backward (opt-in: each update under the backward, clipped by the "
                        "previous step's coefficient)")
    p.add_argument("--unclipped", action="store_true",
                   help="model steps whose gradient norm stays under the clip (most of a settled fine-tune): the "
                        "default's speculative updates run under the backward, exactly")
    p.add_argument("--no-speculative-updates", action="store_true",
                   help="model Config.speculative_updates=False (no spare nvme slots; every update waits for the step)")
    p.add_argument("--activations", choices=("none", "cpu", "nvme", "auto"), default="none",
                   help="model Config.activations: the saved activations wait in host memory or on nvme instead of "
                        "the GPU, or (auto) in host memory where they fit there, else on nvme (default none)")
    p.add_argument("--optimizer-states", choices=OPTIMIZER_STATES, default="adamw",
                   help="the optimizer family's states: adamw (fp32 moments, 8 bytes/param), adamw-bf16 (bf16 "
                        "moments, 4), adamw8bit (8-bit moments, about 2), lion (one fp32 moment, 4); default adamw")
    p.add_argument("--json", help="write the whole plan as JSON")
    p.set_defaults(func=_cmd_plan)
