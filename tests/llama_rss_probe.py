"""Host memory of a transformers Llama trained with params and optimizer on nvme, step by step (run as a subprocess
by test_zero_memory.py, so the peak covers only this run). argv: swap dir, cpu budget, device budget, steps, and
optionally a JSON object of more offload.Config fields and glibc's mmap threshold in bytes (a diagnostic: which
allocations stay in the heap). Prints one JSON line (with RSS_PROBE_OUT=DIR, writes it to DIR/rank{RANK}.json):
the resident set after the warm-up (rss0), and per step the peak so far and the resident set at its end.

    OFFLOAD_MALLOC_TUNE=fast python tests/llama_rss_probe.py /tmp/swap 64MiB 32MiB 5 '{"pipeline": false}'
"""
import ctypes
import json
import os
import sys

import psutil
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import offload
from offload.zero.host_memory import peak_rss_bytes, reset_peak_rss

VOCAB, SEQ, BATCH = 8000, 256, 2


def llama(hidden: int, layers: int) -> LlamaForCausalLM:
    return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=hidden * 11 // 4,
                                        num_hidden_layers=layers, num_attention_heads=hidden // 64,
                                        num_key_value_heads=hidden // 128, tie_word_embeddings=False))


def main():
    nvme_dir, cpu_budget, device_budget, steps = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    more = json.loads(sys.argv[5]) if len(sys.argv) > 5 else {}
    mmap_threshold = int(sys.argv[6]) if len(sys.argv) > 6 else None
    torch.set_num_threads(1)
    # warm-up: the lazily loaded machinery any torch program pays (kernels, autograd, the fused AdamW)
    warm = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                        num_attention_heads=1, num_key_value_heads=1))
    ids = torch.randint(0, 64, (2, 16))
    warm(input_ids=ids, labels=ids).loss.backward()
    offload.AdamW(warm.parameters()).step()
    del warm
    rss0 = psutil.Process().memory_info().rss
    reset_peak_rss()  # the peak from the baseline on
    cfg = offload.Config(**{**dict(params="nvme", optimizer="nvme", nvme_path=nvme_dir, cpu_budget=cpu_budget,
                                   # the dtype this CPU computes fast: bf16 where it has bf16 instructions (the
                                   # figures in test_zero_memory.py), fp32 where torch only emulates bf16 (there
                                   # each of these runs took about a minute of bf16 matmuls)
                                   device_budget=device_budget, compute_dtype="auto"), **more})
    per_step = []
    with offload.init(cfg) as rt:
        if mmap_threshold is not None:  # after the runtime set its own (offload.zero.host_memory.tune_malloc)
            ctypes.CDLL("libc.so.6").mallopt(-3, mmap_threshold)  # M_MMAP_THRESHOLD
        model = llama(384, 8)
        opt = offload.AdamW(model.parameters(), lr=1e-4)
        n = sum(p.numel() for p in model.parameters())
        g = torch.Generator().manual_seed(0)
        for _ in range(steps):
            ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            rt.clip_grad_norm_(1.0)
            opt.step()
            opt.zero_grad()
            per_step.append({"peak": peak_rss_bytes(), "rss": psutil.Process().memory_info().rss,
                             "loss": loss.item()})
        stats = rt.stats()
    line = json.dumps({"rss0": rss0, "params": n, "steps": per_step, "nvme_read": stats["nvme_read_bytes"],
                       "budgets": stats["budgets"], "memory": stats["memory"]})
    out = os.environ.get("RSS_PROBE_OUT")  # a directory: one file per rank (ranks sharing a stdout interleave)
    if out:
        with open(os.path.join(out, f"rank{os.environ.get('RANK', '0')}.json"), "w") as f:
            f.write(line)
    else:
        print(line)


if __name__ == "__main__":
    main()
