"""`offload demo`: train a small transformer with its parameters and optimizer states paged to a disk
directory through `offload.init`, printing loss and step time per step, then bytes moved per tier and
peak RSS. Runs on a laptop CPU in about a minute; on a GPU machine the compute runs on the GPU.

The task is synthetic and learnable (each sequence follows t[i+1] = (a * t[i] + b) mod vocab for one of two
(a, b) rules, so the model must read the context to tell them apart); the loss falls from ln(vocab).
"""
from __future__ import annotations

import argparse
import math
import os
import tempfile
import time

DEFAULTS = dict(steps=30, dim=192, layers=4, vocab=128, seq=64, batch=8, lr=1e-2)


def build_model(vocab: int, dim: int, layers: int, seq: int):
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln1 = nn.LayerNorm(dim)
            self.qkv = nn.Linear(dim, 3 * dim, bias=False)
            self.proj = nn.Linear(dim, dim, bias=False)
            self.ln2 = nn.LayerNorm(dim)
            self.fc1 = nn.Linear(dim, 4 * dim)
            self.fc2 = nn.Linear(4 * dim, dim)
            self.heads = max(1, dim // 64)

        def forward(self, x):
            b, t, d = x.shape
            q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
            return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))

    class TinyGPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.tok = nn.Embedding(vocab, dim)
            self.pos = nn.Embedding(seq, dim)
            self.blocks = nn.ModuleList(Block() for _ in range(layers))
            self.ln_f = nn.LayerNorm(dim)
            self.head = nn.Linear(dim, vocab, bias=False)
            self.head.weight = self.tok.weight  # tied

        def forward(self, ids):
            h = self.tok(ids) + self.pos(torch.arange(ids.shape[1], device=ids.device))
            for block in self.blocks:
                h = block(h)
            return self.head(self.ln_f(h)) / math.sqrt(dim)  # unit-scale logits with the N(0, 1) tied embedding

    return TinyGPT()


def make_batch(step: int, batch: int, seq: int, vocab: int, device):
    import torch

    g = torch.Generator().manual_seed(step)
    rules = torch.tensor([[5, 1], [7, 3]])
    rule = rules[torch.randint(0, len(rules), (batch,), generator=g)]
    ids = torch.empty(batch, seq + 1, dtype=torch.long)
    ids[:, 0] = torch.randint(0, vocab, (batch,), generator=g)
    for i in range(seq):
        ids[:, i + 1] = (rule[:, 0] * ids[:, i] + rule[:, 1]) % vocab
    return ids[:, :-1].to(device), ids[:, 1:].to(device)


def run_demo(args: argparse.Namespace) -> int:
    import torch.nn.functional as F

    import offload
    from offload.config import format_size

    owned_dir = None
    nvme_dir = args.dir
    if nvme_dir is None:
        owned_dir = tempfile.TemporaryDirectory(prefix="offload-demo-")
        nvme_dir = owned_dir.name
    os.makedirs(nvme_dir, exist_ok=True)
    cfg = offload.Config(params=args.params, optimizer=args.optimizer, nvme_path=nvme_dir,
                         compute_dtype=args.compute_dtype, cpu_budget=args.cpu_budget,
                         device_budget=args.device_budget, seed=args.seed)
    print(f"offload demo: {args.layers} blocks x dim {args.dim}, vocab {args.vocab}, seq {args.seq}, "
          f"batch {args.batch}; params={cfg.params} optimizer={cfg.optimizer} compute={cfg.compute_dtype}; "
          f"swap dir {nvme_dir}")
    try:
        with offload.init(cfg) as rt:
            model = build_model(args.vocab, args.dim, args.layers, args.seq)  # sharded as it is built
            opt = offload.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
            n_params = sum(p.numel() for p in model.parameters())
            print(f"{n_params / 1e6:.2f} M parameters in {len(rt.units)} units; world size {rt.world_size}; "
                  f"states: params on {rt.params_tier}, optimizer on {rt.optimizer_tier}")
            first = last = None
            for step in range(1, args.steps + 1):
                t0 = time.perf_counter()
                # each rank its own samples (torchrun --nproc_per_node N -m offload.cli demo)
                ids, targets = make_batch(step * rt.world_size + rt.rank, args.batch, args.seq, args.vocab,
                                          rt.device)
                logits = model(ids)
                loss = F.cross_entropy(logits.float().reshape(-1, args.vocab), targets.reshape(-1))
                loss.backward()
                norm = rt.clip_grad_norm_(1.0)
                opt.step()
                opt.zero_grad()
                value = loss.item()
                first = value if first is None else first
                last = value
                if rt.rank == 0:
                    print(f"step {step:3d}/{args.steps}  loss {value:7.4f}  grad-norm {float(norm):6.3f}  "
                          f"time {time.perf_counter() - t0:6.3f} s", flush=True)
            stats = rt.stats()
    finally:
        if owned_dir is not None:
            owned_dir.cleanup()
    if rt.rank == 0:
        print(f"loss {first:.4f} -> {last:.4f} (ln(vocab) = {math.log(args.vocab):.4f})")
        print("bytes moved" + (" (rank 0)" if rt.world_size > 1 else "") + ":")
        rows = [
            ("nvme -> host (read)", stats["nvme_read_bytes"]),
            ("host -> nvme (written)", stats["nvme_written_bytes"]),
            ("host -> device", stats["host_to_device_bytes"]),
            ("device -> host", stats["device_to_host_bytes"]),
            ("all-gather (params)", stats["allgather_bytes"]),
            ("reduce-scatter (grads)", stats["reduce_scatter_bytes"]),
        ]
        for label, value in rows:
            print(f"  {label:<24} {format_size(value):>12}")
        print(f"peak gathered on device   {format_size(stats['peak_gathered_bytes']):>12} "
              f"(bound {format_size(stats['gathered_bound_bytes'])})")
        print(f"peak RSS                  {format_size(stats['peak_rss_bytes']):>12}")
    return 0


def add_demo_parser(sub) -> None:
    p = sub.add_parser("demo", help="train a small transformer with params and optimizer paged to disk",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=DEFAULTS["steps"])
    p.add_argument("--dim", type=int, default=DEFAULTS["dim"])
    p.add_argument("--layers", type=int, default=DEFAULTS["layers"])
    p.add_argument("--vocab", type=int, default=DEFAULTS["vocab"])
    p.add_argument("--seq", type=int, default=DEFAULTS["seq"])
    p.add_argument("--batch", type=int, default=DEFAULTS["batch"])
    p.add_argument("--lr", type=float, default=DEFAULTS["lr"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dir", default=None, help="swap directory (default: a temporary directory, removed after)")
    p.add_argument("--params", default="nvme", choices=("device", "cpu", "nvme", "auto"))
    p.add_argument("--optimizer", default="nvme", choices=("device", "cpu", "nvme", "auto"))
    p.add_argument("--compute-dtype", default="fp32", choices=("fp32", "bf16"))
    p.add_argument("--cpu-budget", default="auto")
    p.add_argument("--device-budget", default="auto")
    p.set_defaults(func=run_demo)
