"""Activation offload (Config.activations) on a transformers Llama with activation checkpointing: step time and
peak memory with the saved tensors left on the compute device ("none"), in the cpu tier ("cpu") or in an nvme
swap file ("nvme"), or the cpu tier while it has room and the swap file after it ("auto"), at several sequence lengths.

Each (sequence length, contender) runs in its own subprocess, so its peak RSS (VmHWM) is its own; rounds are
interleaved, each round in an order rotated by its number. Model states live in the cpu tier (params and
optimizer "cpu"), so what differs between contenders is only where the activations wait. On a machine without a
GPU the compute device is the CPU: the "device" memory the offload frees is host memory too, so peak RSS cannot
fall; `device peak` is the figure the offload lowers: the compute device's allocator at its busiest in a timed step
(offload.device_memory.take_peak_allocated over the timed steps: on a GPU max_memory_allocated, on the CPU the host
pool's tensors of 128 KiB and up, the device tier's own region not included). `moved` is what the saved-tensor hooks
sent to the store per step, `kept` what stayed for want of room, `wait` the training thread's seconds waiting for
a tensor to come back.

Two peers, with the same model states in the cpu tier and Config.activations "none", so each differs from the
"none" row only in what its checkpointing does with the saved block inputs (not in the default list; add them
with --contenders):
  hf  transformers' own `activation_checkpointing_enable(offload=True)` (transformers 5.x): each block's saved
      inputs to pinned host memory through torch.autograd.graph.save_on_cpu, copied on the compute stream.
  ds  DeepSpeed's activation checkpointing with `cpu_checkpointing` (deepspeed.checkpointing.configure:
      partition_activations and checkpoint_in_cpu) as the model's checkpoint function.
On a CPU both copy host memory to host memory: their device peak and step cost mean something on a GPU only.

    PYTHONPATH=. python benchmarks/bench_activations.py --seqs 512,2048,4096 --rounds 2 --steps 3
    PYTHONPATH=. python benchmarks/bench_activations.py --seqs 4096,16384 --dim 1024 --contenders none,cpu,auto,hf,ds
"""
from __future__ import annotations

import argparse
import inspect
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

CONTENDERS = ("none", "cpu", "nvme", "auto")  # Config.activations
PEERS = ("hf", "ds")  # another library's activation offload, Config.activations "none"


def child(args) -> dict:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    import offload
    from offload.device_memory import take_peak_allocated
    from offload.zero.host_memory import peak_rss_bytes

    torch.set_num_threads(args.threads)
    ours = args.activations not in PEERS
    cfg = offload.Config(params="cpu", optimizer="cpu", cpu_budget=args.cpu_budget, device_budget=args.device_budget,
                         nvme_path=args.nvme_path, activations=args.activations if ours else "none",
                         compute_dtype="bf16")
    with offload.init(cfg) as rt:
        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(vocab_size=args.vocab, hidden_size=args.dim, intermediate_size=4 * args.dim,
                                             num_hidden_layers=args.layers, num_attention_heads=args.dim // 64,
                                             num_key_value_heads=args.dim // 64, max_position_embeddings=args.seq))
        enable_checkpointing(model, args.activations)
        model.train()
        opt = offload.AdamW(model.parameters(), lr=1e-4)
        g = torch.Generator().manual_seed(1)
        ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g).to(rt.device)
        times, losses, device_peaks = [], [], []
        for i in range(args.warmup + args.steps):
            rt.quiesce()
            take_peak_allocated(rt.device)  # this step's window starts here (this process is the bench's own)
            t0 = time.perf_counter()
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            rt.quiesce()  # every copy and removal of this step paid for inside its window
            if i >= args.warmup:
                times.append(time.perf_counter() - t0)
                device_peaks.append(take_peak_allocated(rt.device))
            losses.append(loss.item())
        acts = rt.stats()["activations"] or {}
        steps = args.warmup + args.steps
        out = {"s_per_step": statistics.median(times), "loss": losses[-1], "peak_rss": peak_rss_bytes(),
               "moved_per_step": acts.get("moved_bytes", 0) / steps, "kept_per_step": acts.get("kept_bytes", 0) / steps,
               "wait_per_step": acts.get("wait_s", 0.0) / steps,
               "device_peak": None if None in device_peaks else max(device_peaks)}
    return out


def enable_checkpointing(model, contender: str) -> None:
    """Activation checkpointing of every decoder block, non-reentrant, by whichever name this transformers has;
    for a peer, with that peer's offload of the saved inputs (DeepSpeed's function is reentrant)."""
    import torch

    kwargs = {"use_reentrant": False}
    if contender == "ds":
        import deepspeed
        from deepspeed.runtime.activation_checkpointing import checkpointing

        for var, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1"),
                           ("MASTER_PORT", "29547")):
            os.environ.setdefault(var, value)  # one process: no launcher set them (else DeepSpeed asks MPI)
        # its checkpointing logs through deepspeed.comm, which wraps torch.distributed's group (one rank)
        deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo")
        checkpointing.configure(None, partition_activations=True, checkpoint_in_cpu=True)
        if hasattr(model, "activation_checkpointing_enable"):  # transformers' own set-up (input grads), then
            model.activation_checkpointing_enable()  # DeepSpeed's function in place of torch's
        else:
            model.gradient_checkpointing_enable()
        model._set_gradient_checkpointing(enable=True, gradient_checkpointing_func=checkpointing.checkpoint)
    elif contender == "hf":
        if "offload" not in inspect.signature(getattr(model, "activation_checkpointing_enable", len)).parameters:
            raise SystemExit("hf: this transformers has no activation_checkpointing_enable(offload=True)")
        if not torch.cuda.is_available():
            raise SystemExit("hf: transformers' offload pins host memory, which needs a GPU")
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs, offload=True)
    elif hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def fmt(n) -> str:
    return "-" if n is None else f"{n / 2**20:.0f} MiB"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seqs", default="512,2048,4096")
    p.add_argument("--contenders", default=",".join(CONTENDERS))
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--vocab", type=int, default=8000)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--cpu-budget", default="3GiB")
    p.add_argument("--device-budget", default="1GiB")
    p.add_argument("--nvme-path", default=None, help="swap directory (default: a temporary one)")
    p.add_argument("--json", default=None)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--seq", type=int, default=512, help=argparse.SUPPRESS)
    p.add_argument("--activations", default="none", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print("RESULT " + json.dumps(child(args)), flush=True)
        return
    nvme = args.nvme_path or tempfile.mkdtemp(prefix="offload-bench-act-")
    seqs = [int(s) for s in args.seqs.split(",")]
    contenders = args.contenders.split(",")
    unknown = sorted(set(contenders) - set(CONTENDERS) - set(PEERS))
    if unknown:
        p.error(f"--contenders: {', '.join(unknown)} unknown; choose from {', '.join(CONTENDERS + PEERS)}")
    results: dict = {}
    for rnd in range(args.rounds):
        for seq in seqs:
            order = contenders[rnd % len(contenders):] + contenders[:rnd % len(contenders)]
            for name in order:
                cmd = [sys.executable, os.path.abspath(__file__), "--child", "--seq", str(seq), "--activations", name,
                       "--nvme-path", nvme] + [f"--{k}={v}" for k, v in (
                           ("steps", args.steps), ("warmup", args.warmup), ("dim", args.dim), ("layers", args.layers),
                           ("vocab", args.vocab), ("batch", args.batch), ("threads", args.threads),
                           ("cpu-budget", args.cpu_budget), ("device-budget", args.device_budget))]
                proc = subprocess.run(cmd, capture_output=True, text=True)
                line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
                if proc.returncode != 0 or line is None:
                    print(f"# round {rnd + 1} seq {seq} {name}: failed\n{proc.stderr[-2000:]}", file=sys.stderr)
                    continue
                r = json.loads(line[len("RESULT "):])
                results.setdefault((seq, name), []).append(r)
                print(f"# round {rnd + 1}/{args.rounds} seq {seq:5d} {name:5s} {r['s_per_step']:.3f} s/step "
                      f"peak RSS {fmt(r['peak_rss'])}", file=sys.stderr, flush=True)
    print(f"# Llama {args.layers} x d{args.dim} (vocab {args.vocab}), batch {args.batch}, bf16, activation checkpointing, "
          f"params/optimizer in the cpu tier; medians over {args.rounds} round(s) of {args.steps} step(s)")
    print(f"{'seq':>5} {'activations':11} {'s/step':>7} {'vs none':>7} {'peak RSS':>9} {'vs none':>8} "
          f"{'moved/step':>10} {'kept/step':>9} {'wait/step':>9} {'dev peak':>9} {'vs none':>8} {'loss':>7}")
    table = []
    for seq in seqs:
        base = results.get((seq, "none"))
        for name in contenders:
            rs = results.get((seq, name))
            if not rs:
                continue
            med = {k: statistics.median(r[k] for r in rs) for k in ("s_per_step", "peak_rss", "moved_per_step",
                                                                      "kept_per_step", "wait_per_step")}
            b = {k: statistics.median(r[k] for r in base) for k in ("s_per_step", "peak_rss")} if base else None
            peak, base_peak = rs[-1]["device_peak"], base[-1]["device_peak"] if base else None
            row = {"seq": seq, "activations": name, **med, "loss": rs[-1]["loss"], "device_peak": peak}
            table.append(row)
            print(f"{seq:5d} {name:11} {med['s_per_step']:7.3f} "
                  f"{(med['s_per_step'] / b['s_per_step'] if b else float('nan')):7.2f} {fmt(med['peak_rss']):>9} "
                  f"{(med['peak_rss'] - b['peak_rss']) / 2**20 if b else float('nan'):+7.0f}M "
                  f"{fmt(med['moved_per_step']):>10} {fmt(med['kept_per_step']):>9} {med['wait_per_step']:8.3f}s "
                  f"{fmt(peak):>9} {(peak - base_peak) / 2**20 if peak and base_peak else float('nan'):+7.0f}M "
                  f"{row['loss']:7.4f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": table}, f, indent=1)


if __name__ == "__main__":
    main()
