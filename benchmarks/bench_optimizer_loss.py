"""8-bit AdamW against fp32 AdamW and the other 8-bit AdamWs: the loss after N steps of a small transformers
Llama on real text, and the seconds per step.

Every contender trains the same model (same init, same batches, in memory on the CPU, fp32) on the fine-tune
job's built-in corpus (Python's standard library documentation, tokenized by a BPE trained on it, as `offload
finetune` does with no --data):
  torch        torch.optim.AdamW (fp32 moments: the reference)
  offload      offload.AdamW (the fused fp32 kernel)
  offload-8bit offload.AdamW8bit (8-bit block-quantized moments, this repository's kernel)
  torchao      torchao.optim.AdamW8bit       } when they import (pip install torchao bitsandbytes; not
  bnb          bitsandbytes.optim.AdamW8bit  } dependencies of offload)
Printed: the train loss (mean of the last 20 steps), the held-out loss at the end, and the median optimizer
step (seconds), per contender; their gap to torch's losses.

    python benchmarks/bench_optimizer_loss.py --steps 300
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F


def build(vocab: int, seed: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=512,
                      tie_word_embeddings=False)
    return LlamaForCausalLM(cfg)


def optimizer(name: str, params, lr: float, wd: float):
    if name == "torch":
        return torch.optim.AdamW(params, lr=lr, weight_decay=wd, foreach=False)
    if name == "offload":
        import offload
        return offload.AdamW(params, lr=lr, weight_decay=wd)
    if name == "offload-8bit":
        import offload
        return offload.AdamW8bit(params, lr=lr, weight_decay=wd)
    if name == "torchao":
        from torchao.optim import AdamW8bit
        return AdamW8bit(params, lr=lr, weight_decay=wd)
    if name == "bnb":
        import bitsandbytes as bnb
        return bnb.optim.AdamW8bit(params, lr=lr, weight_decay=wd)
    raise SystemExit(f"unknown contender {name!r}")


def data(seq_len: int, vocab: int):
    from offload.finetune.batches import build_blocks, split_heldout
    from offload.finetune.corpus import stdlib_corpus
    from offload.finetune.tokenizer import train_bpe

    examples = stdlib_corpus(2_000_000)
    tok = train_bpe(examples, vocab)
    return split_heldout(build_blocks(examples, tok, seq_len), 16), len(tok)


def run(name: str, train, held, vocab: int, a) -> dict:
    model = build(vocab, a.seed)
    try:
        opt = optimizer(name, model.parameters(), a.lr, a.weight_decay)
    except ImportError as exc:
        return {"error": f"not installed ({exc})"}
    g = torch.Generator().manual_seed(a.seed)
    losses, step_s = [], []
    for _ in range(a.steps):
        idx = torch.randint(0, len(train), (a.batch,), generator=g)
        logits = model(train.inputs[idx]).logits
        loss = F.cross_entropy(logits.flatten(0, 1), train.labels[idx].flatten(), ignore_index=-100)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        t0 = time.perf_counter()
        opt.step()
        step_s.append(time.perf_counter() - t0)
        opt.zero_grad()
        losses.append(loss.item())
    with torch.no_grad():
        logits = model(held.inputs).logits
        held_loss = F.cross_entropy(logits.flatten(0, 1), held.labels.flatten(), ignore_index=-100).item()
    return {"train_loss_last20": statistics.mean(losses[-20:]), "heldout_loss": held_loss,
            "opt_step_s": statistics.median(step_s), "losses": losses}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contenders", default="torch,offload,offload-8bit,torchao,bnb")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--weight-decay", type=float, default=0.01)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    (train, held), vocab = data(a.seq_len, a.vocab)
    rows = {}
    for name in a.contenders.split(","):
        rows[name] = run(name, train, held, vocab, a)
        r = rows[name]
        print(name, "error: " + r["error"] if "error" in r else
              f"train {r['train_loss_last20']:.4f} held-out {r['heldout_loss']:.4f} step {r['opt_step_s'] * 1e3:.1f} ms",
              flush=True)
    ref = rows.get("torch", {})
    n_params = sum(p.numel() for p in build(vocab, a.seed).parameters())
    print(f"\n# {n_params / 1e6:.1f}M params, {a.steps} steps of {a.batch} x {a.seq_len} tokens, lr {a.lr}, "
          f"{a.threads} threads")
    print(f"{'contender':<14}{'train (last 20)':>16}{'held-out':>10}{'vs torch':>10}{'opt step ms':>13}")
    for name, r in rows.items():
        if "error" in r:
            print(f"{name:<14}{r['error']}")
            continue
        gap = r["heldout_loss"] - ref["heldout_loss"] if "heldout_loss" in ref else float("nan")
        print(f"{name:<14}{r['train_loss_last20']:>16.4f}{r['heldout_loss']:>10.4f}{gap:>+10.4f}"
              f"{r['opt_step_s'] * 1e3:>13.1f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"settings": vars(a), "n_params": n_params, "rows": rows}, f)


if __name__ == "__main__":
    main()
