"""Build, load and shard at real shapes (issue 42 section 1, its fourth question): a transformers Llama saved as
safetensors (random bf16 values), loaded by `from_pretrained` inside `offload.init` with params and optimizer
states on nvme, in a fresh process: the peak host RSS beside the budgets, the time to the loaded model and to the
end of the first step (forward, backward, clip, AdamW8bit step), and `offload plan`'s prediction for the same
model beside it.

    PYTHONPATH=. python benchmarks/bench_scale_load.py --shape llama3-70b-2layers --dir /tmp/l70 --nvme-dir /tmp/sw
        (budgets cpu 5GiB + device 12GiB by default; measured in benchmarks/RESULTS.md: peak RSS 14.95 GiB)
    PYTHONPATH=. python benchmarks/bench_scale_load.py --shape tiny --json out.json   # CI (tests/test_bench_scale.py)

The checkpoint is written once into --dir (kept for a second run; --keep no removes it) and the swap directory is
removed at the end. Shapes: llama3-70b-2layers (Llama-3-70B's embedding, head and two of its decoder layers:
3.8B params, 7.6 GB), llama3-8b (8.0B, 16 GB: needs 16 GB of RAM to write and ~90 GB of disk with fp32 states),
tiny.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time

SHAPES = {
    "llama3-70b-2layers": dict(vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_hidden_layers=2,
                               num_attention_heads=64, num_key_value_heads=8),
    "llama3-8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=8),
    "tiny": dict(vocab_size=256, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2),
}


def write_checkpoint(shape: str, path: str) -> float:
    """A Llama of `shape` with random bf16 values, saved by save_pretrained (safetensors); seconds taken."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    if os.path.exists(os.path.join(path, "config.json")):
        return 0.0
    t0 = time.perf_counter()
    cfg = LlamaConfig(**SHAPES[shape], tie_word_embeddings=False, max_position_embeddings=256)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    model = model.to_empty(device="cpu").to(torch.bfloat16)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():  # (one tensor at a time: no fp32 copy of the model; the rotary
            # buffer, left empty by to_empty, is not saved: from_pretrained computes it)
            p.normal_(0.0, 0.02, generator=gen)
    model.save_pretrained(path, max_shard_size="2GB")
    return time.perf_counter() - t0


CHILD = textwrap.dedent("""
    import json, sys, time
    t0 = time.perf_counter()
    import torch, offload
    from transformers import AutoModelForCausalLM
    def status(field):
        return int(next(l for l in open("/proc/self/status") if l.startswith(field)).split()[1]) * 1024
    def phase(what):  # to stderr as it happens: a run the kernel kills for memory still says how far it got
        print(f"phase {what}: {time.perf_counter() - t0:.1f} s, RSS {status('VmRSS') / 2**30:.2f} GiB, "
              f"peak {status('VmHWM') / 2**30:.2f} GiB", file=sys.stderr, flush=True)
    model_dir, nvme, cpu_budget, device_budget = sys.argv[1:5]
    cfg = offload.Config(params="nvme", optimizer="nvme", nvme_path=nvme, cpu_budget=cpu_budget,
                         device_budget=device_budget, compute_dtype="bf16", optimizer_states="adamw8bit")
    with offload.init(cfg) as rt:
        rss_open = status("VmRSS")
        phase("runtime open")
        t_open = time.perf_counter()
        model = AutoModelForCausalLM.from_pretrained(model_dir)
        t_loaded = time.perf_counter()
        rss_loaded_peak = status("VmHWM")
        phase("loaded")
        opt = offload.AdamW8bit(model.parameters(), lr=1e-5)
        ids = torch.randint(0, model.config.vocab_size, (1, 16), generator=torch.Generator().manual_seed(1))
        loss = model(input_ids=ids, labels=ids).loss
        phase("forward")
        loss.backward()
        phase("backward")
        rt.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad()
        rt.quiesce()
        phase("step")
        t_step = time.perf_counter()
        params = sum(p.numel() for p in model.parameters())
        stats = rt.stats()
    print("RESULT", json.dumps({
        "params": params, "loss": float(loss), "import_and_open_s": t_open - t0, "load_s": t_loaded - t_open,
        "first_step_s": t_step - t_loaded, "to_first_step_s": t_step - t0, "rss_at_open": rss_open,
        "peak_rss_loading": rss_loaded_peak, "peak_rss": status("VmHWM"),
        "nvme_bytes": stats["memory"].get("nvme_bytes") if isinstance(stats.get("memory"), dict) else None}))
""")


def plan_prediction(model_dir: str, cpu_budget: str, device_budget: str, swap: str) -> str:
    """`offload plan`'s lines for the same model on this machine's CPU (its per-tier bytes)."""
    cmd = [sys.executable, "-m", "offload.cli", "plan", "--model", os.path.join(model_dir, "config.json"),
           "--gpus", "1", "--gpu", "cpu", "--gpu-mem", device_budget, "--cpu-mem", cpu_budget,
           "--optimizer-states", "adamw8bit",
           "--nvme-size", f"{shutil.disk_usage(swap).free >> 30}GiB",
           "--seq-len", "16", "--micro-batch", "1"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    return (out.stdout or out.stderr).strip()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="llama3-70b-2layers")
    ap.add_argument("--dir", default=None, help="where the checkpoint is written (default: a temp dir)")
    ap.add_argument("--nvme-dir", default=None, help="the swap directory's parent (default: a temp dir)")
    ap.add_argument("--cpu-budget", default="5GiB")
    ap.add_argument("--device-budget", default="12GiB",
                    help="the device tier (host memory on a CPU); the 70B shape's 1.05B-param embedding needs at least "
                         "9.79 GiB for its step (11.74 gathering ahead), below which the runtime refuses it")
    ap.add_argument("--keep", choices=("yes", "no"), default="yes", help="keep the written checkpoint")
    ap.add_argument("--timeout", type=int, default=1800, help="the loading process's limit, seconds")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    ckpt = args.dir or tempfile.mkdtemp(prefix="scale-load-")
    swap_parent = args.nvme_dir or tempfile.mkdtemp(prefix="scale-swap-")
    swap = os.path.join(swap_parent, "swap")
    os.makedirs(swap, exist_ok=True)
    try:
        write_s = write_checkpoint(args.shape, ckpt)
        proc = subprocess.run([sys.executable, "-c", CHILD, ckpt, swap, args.cpu_budget, args.device_budget],
                              capture_output=True, text=True, timeout=args.timeout,
                              env=dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "2")))
        if proc.returncode != 0:
            print(f"the loading process exited with {proc.returncode}"
                  f"{' (killed: out of memory?)' if proc.returncode == -9 else ''}; its last lines:\n"
                  + proc.stderr[-4000:], file=sys.stderr)
            return 1
        r = json.loads(next(x for x in proc.stdout.splitlines() if x.startswith("RESULT"))[len("RESULT "):])
        budgets = _bytes(args.cpu_budget) + _bytes(args.device_budget)
        r.update(shape=args.shape, write_checkpoint_s=write_s, budgets_bytes=budgets,
                 peak_growth=r["peak_rss"] - r["rss_at_open"], goal_peak_growth=budgets + (1 << 30),
                 plan=plan_prediction(ckpt, args.cpu_budget, args.device_budget, swap),
                 phases=[x for x in proc.stderr.splitlines() if x.startswith("phase ")])
        gib = 1 << 30
        print(f"# build, load and shard: {args.shape}, {r['params'] / 1e9:.2f}B params, params and AdamW8bit states "
              f"on nvme, budgets cpu {args.cpu_budget} + device {args.device_budget}")
        print(f"checkpoint written in {write_s:.1f} s (0: reused); import and open {r['import_and_open_s']:.1f} s, "
              f"from_pretrained {r['load_s']:.1f} s, first step {r['first_step_s']:.1f} s "
              f"(to the first step's end {r['to_first_step_s']:.1f} s)")
        print(f"peak RSS {r['peak_rss'] / gib:.2f} GiB ({r['peak_growth'] / gib:.2f} GiB above the open runtime's; "
              f"goal <= budgets + 1 GiB = {r['goal_peak_growth'] / gib:.2f} GiB); while loading "
              f"{r['peak_rss_loading'] / gib:.2f} GiB")
        print("\n".join(r["phases"]))
        print("offload plan:\n" + textwrap.indent(r["plan"], "  "))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(r, f, indent=1)
        return 0
    finally:
        shutil.rmtree(swap_parent if args.nvme_dir is None else swap, ignore_errors=True)
        if args.keep == "no" or args.dir is None:
            shutil.rmtree(ckpt, ignore_errors=True)


def _bytes(size: str) -> int:
    from offload.config import parse_size

    return parse_size(size)


if __name__ == "__main__":
    sys.exit(main())
