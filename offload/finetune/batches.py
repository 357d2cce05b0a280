"""Token blocks and which of them each rank trains on at each step.

Documents are packed: concatenated with an end-of-text token between them and cut into blocks of
seq_len + 1 tokens (inputs are the first seq_len, labels the last seq_len: next-token prediction, every
position counts). A prompt/response pair is one block of its own: prompt + response + end-of-text,
truncated to seq_len + 1, padded, labels -100 (no loss) on the prompt and the padding. Where the tokenizer
marks a sequence's start itself (Llama, Mistral, Gemma: a BOS token, what the model saw in pretraining and
sees at inference), each document and each prompt starts with it.

The held-out evaluation set is the tail of the blocks (the last documents: for the default corpus, other
source files than the ones trained on). The training blocks are shuffled once per epoch from the seed.
Sample g of the run (g = (step * grad_accum + micro) * global_micro + rank * micro_batch + j) is block
perm[epoch][g mod N]: the same global batch for every world size with the same micro_batch * world, so
one process and torchrun give the same losses.
"""
from __future__ import annotations

import dataclasses

import torch

from .corpus import Example

IGNORE = -100  # torch's cross_entropy ignore_index: a position without loss


@dataclasses.dataclass
class TokenBlocks:
    inputs: torch.Tensor  # [n, seq_len] int64
    labels: torch.Tensor  # [n, seq_len] int64, IGNORE where there is no loss

    def __len__(self) -> int:
        return self.inputs.shape[0]

    def take(self, index: torch.Tensor) -> "TokenBlocks":
        return TokenBlocks(self.inputs[index], self.labels[index])


def start_tokens(tokenizer) -> list[int]:
    """[BOS] when the tokenizer puts it in front of a text it encodes with its special tokens, else []."""
    bos = tokenizer.bos_token_id
    if bos is None:
        return []
    probe = tokenizer("a", add_special_tokens=True)["input_ids"]
    return [bos] if probe and probe[0] == bos else []


def _encode(tokenizer, texts: list[str], bar) -> list[list[int]]:
    """The texts' token ids, a batch of documents at a time (the same ids as one call) so the bar moves."""
    out, step = [], max(64, len(texts) // 100)
    for i in range(0, len(texts), step):
        out.extend(tokenizer(texts[i:i + step], add_special_tokens=False)["input_ids"])
        bar.update(len(texts[i:i + step]))
    return out


def build_blocks(examples: list[Example], tokenizer, seq_len: int, show_progress: bool = False) -> TokenBlocks:
    """show_progress: a bar of the texts tokenized, where that takes more than a couple of seconds."""
    from tqdm import tqdm

    n_texts = sum(1 if e.response is None else 2 for e in examples)
    with tqdm(total=n_texts, desc="tokenizing", unit="text", delay=2, disable=not show_progress,
              dynamic_ncols=True) as bar:
        return _build_blocks(examples, tokenizer, seq_len, bar)


def _build_blocks(examples: list[Example], tokenizer, seq_len: int, bar) -> TokenBlocks:
    eos = tokenizer.eos_token_id
    bos = start_tokens(tokenizer)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    docs = [e for e in examples if e.response is None]
    pairs = [e for e in examples if e.response is not None]
    rows_in, rows_lab = [], []
    if docs:
        ids = _encode(tokenizer, [e.text for e in docs], bar)
        stream = torch.tensor([t for doc in ids for t in (*bos, *doc, eos)], dtype=torch.long)
        n = (stream.numel() - 1) // seq_len
        if n:
            # block i is tokens [i*seq_len, (i+1)*seq_len] inclusive: inputs and labels shifted by one
            rows_in.append(stream[:n * seq_len].view(n, seq_len))
            rows_lab.append(stream[1:n * seq_len + 1].view(n, seq_len))
    if pairs:
        prompts = _encode(tokenizer, [e.text for e in pairs], bar)
        responses = _encode(tokenizer, [e.response for e in pairs], bar)
        ins = torch.full((len(pairs), seq_len + 1), pad, dtype=torch.long)
        lab = torch.full((len(pairs), seq_len + 1), IGNORE, dtype=torch.long)
        for i, (p, r) in enumerate(zip(prompts, responses)):
            p = bos + list(p)
            seq = (p + list(r) + [eos])[:seq_len + 1]
            ins[i, :len(seq)] = torch.tensor(seq)
            lab[i, len(p):len(seq)] = torch.tensor(seq[len(p):], dtype=torch.long)
        rows_in.append(ins[:, :-1])
        rows_lab.append(lab[:, 1:])
    if not rows_in:
        return TokenBlocks(torch.empty(0, seq_len, dtype=torch.long), torch.empty(0, seq_len, dtype=torch.long))
    return TokenBlocks(torch.cat(rows_in), torch.cat(rows_lab))


def split_heldout(blocks: TokenBlocks, eval_blocks: int) -> tuple[TokenBlocks, TokenBlocks]:
    """(train, eval): the last `eval_blocks` blocks are held out."""
    n = len(blocks)
    cut = n - eval_blocks
    return blocks.take(torch.arange(cut)), blocks.take(torch.arange(cut, n))


class Sampler:
    """Which training blocks a rank takes for a micro-batch (module docstring)."""

    def __init__(self, n_blocks: int, micro_batch: int, grad_accum: int, world_size: int, seed: int):
        self.n, self.micro_batch, self.grad_accum, self.world = n_blocks, micro_batch, grad_accum, world_size
        self.seed = seed
        self._perms: dict[int, torch.Tensor] = {}

    @property
    def global_batch(self) -> int:
        return self.micro_batch * self.grad_accum * self.world

    def _block(self, g: torch.Tensor) -> torch.Tensor:
        epoch, pos = g // self.n, g % self.n
        out = torch.empty_like(g)
        for e in epoch.unique().tolist():
            if e not in self._perms:
                self._perms = {e: torch.randperm(self.n, generator=torch.Generator().manual_seed(self.seed + e))}
            mask = epoch == e
            out[mask] = self._perms[e][pos[mask]]
        return out

    def indices(self, step: int, micro: int, rank: int) -> torch.Tensor:
        base = (step * self.grad_accum + micro) * self.micro_batch * self.world + rank * self.micro_batch
        return self._block(torch.arange(base, base + self.micro_batch))

    def step_indices(self, step: int) -> torch.Tensor:
        """Every block of the step's global batch (all ranks, all micro-batches)."""
        base = step * self.global_batch
        return self._block(torch.arange(base, base + self.global_batch))
