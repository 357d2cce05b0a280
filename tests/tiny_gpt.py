"""A small GPT (tied embedding, pre-LN blocks) and a synthetic, learnable task for it: each sequence follows
t[i+1] = (a * t[i] + b) mod vocab for one of two (a, b) rules, so the model must read the context to tell
them apart. Used by the RSS probe (tests/zero_rss_probe.py) and benchmarks/bench_zero_step.py.
"""
from __future__ import annotations

import math


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
