"""The tokenizer: the model directory's own (transformers' AutoTokenizer), or, for the built-in model, a
byte-level BPE trained here on the training text with the `tokenizers` library in a few seconds (nothing
fetched), wrapped so it saves and loads like any Hugging Face tokenizer.
"""
from __future__ import annotations

from pathlib import Path

from .corpus import Example
from ..errors import InputError

END_OF_TEXT = "<|endoftext|>"  # separates packed documents; also the padding token (padding has no loss)


def train_bpe(examples: list[Example], vocab_size: int, show_progress: bool = False):
    """A byte-level BPE (GPT-2 style: every byte is a token, so any text encodes) trained on `examples`.
    show_progress: the `tokenizers` library's own bars (reading, counting pairs, merging) on stderr."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[END_OF_TEXT], show_progress=show_progress,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    texts = [t for e in examples for t in (e.text, e.response) if t]
    tok.train_from_iterator(texts, trainer, length=len(texts))
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=END_OF_TEXT, eos_token=END_OF_TEXT,
                                   pad_token=END_OF_TEXT, unk_token=None)


def load_tokenizer(path: str | Path, flag: str):
    """The tokenizer saved in `path` (a model directory or a tokenizer directory)."""
    from transformers import AutoTokenizer

    p = Path(path)
    if not any((p / f).is_file() for f in ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")):
        raise InputError(f"{flag} {p}: no tokenizer files (tokenizer.json, tokenizer.model or vocab.json); "
                                "save the model's tokenizer there (tokenizer.save_pretrained(DIR)) or pass "
                                "--tokenizer DIR")
    tok = AutoTokenizer.from_pretrained(str(p))
    if tok.eos_token_id is None:
        raise InputError(f"{flag} {p}: the tokenizer has no end-of-sequence token; set eos_token in its "
                         "tokenizer_config.json")
    return tok
