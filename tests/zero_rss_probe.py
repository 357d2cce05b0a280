"""Peak host RSS of training with params and optimizer on nvme (run as a subprocess by
test_zero_memory.py so ru_maxrss covers only this run). Prints one JSON line."""
import json
import sys

import psutil
import torch
import torch.nn.functional as F

import offload
from tiny_gpt import build_model, make_batch
from offload.zero.host_memory import peak_rss_bytes, reset_peak_rss


def main():
    nvme_dir, dim, layers, cpu_budget, device_budget = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), \
        sys.argv[4], sys.argv[5]
    torch.set_num_threads(1)
    vocab, seq, batch = 256, 32, 4
    # Warm up (imports, meta registrations, autograd and optimizer kernels: ~90 MiB of process baseline
    # that any torch program pays) so the baseline is the process before the runtime's own memory.
    with torch.device("meta"):
        build_model(vocab, 16, 2, seq)
    warm = build_model(vocab, 16, 2, seq)
    ids, targets = make_batch(0, batch, seq, vocab, "cpu")
    F.cross_entropy(warm(ids).reshape(-1, vocab), targets.reshape(-1)).backward()
    torch.optim.AdamW(warm.parameters()).step()
    offload.AdamW(warm.parameters()).step()
    del warm
    rss0 = psutil.Process().memory_info().rss
    reset_peak_rss()  # the peak from the baseline on
    cfg = offload.Config(params="nvme", optimizer="nvme", nvme_path=nvme_dir, cpu_budget=cpu_budget,
                         device_budget=device_budget)
    with offload.init(cfg) as rt:
        model = build_model(vocab, dim, layers, seq)
        opt = offload.AdamW(model.parameters(), lr=1e-3)
        n = sum(p.numel() for p in model.parameters())
        losses = []
        for step in range(3):
            ids, targets = make_batch(step, batch, seq, vocab, "cpu")
            loss = F.cross_entropy(model(ids).reshape(-1, vocab), targets.reshape(-1))
            loss.backward()
            rt.clip_grad_norm_(1.0)
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        stats = rt.stats()
        largest_shard = max(u.layout.shard_numel for u in rt.units) * 4
    print(json.dumps({
        "rss0": rss0, "peak": peak_rss_bytes(), "params": n,
        "states": n * 16, "losses": losses, "gathered_bound": stats["gathered_bound_bytes"],
        "largest_shard": largest_shard, "nvme_read": stats["nvme_read_bytes"],
        "device_tier_peak": stats["peak_resident_bytes"]["device"], "grads_tier": stats["grads_tier"],
    }))


if __name__ == "__main__":
    main()
