"""What a model is, for sizing: parameter count and the shapes that set activations and unit sizes.

From a Hugging Face config.json (Llama-family keys: vocab_size, hidden_size, intermediate_size,
num_hidden_layers, num_attention_heads, num_key_value_heads, tie_word_embeddings; GPT-2's n_embd/n_layer/
n_head are mapped) or a preset. Parameter counts are exact for Llama-architecture models (bias-free
projections, gated MLP, RMSNorm).
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    name: str
    vocab: int
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    tied: bool = False
    max_seq: int = 4096
    explicit_head_dim: int | None = None  # config.json's head_dim where it is not hidden / heads (Qwen3, Gemma)

    @property
    def head_dim(self) -> int:
        return self.explicit_head_dim or self.hidden // self.heads

    @property
    def layer_params(self) -> int:
        h, q, kv = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim
        attention = h * q + 2 * h * kv + q * h  # q, k, v, o
        mlp = 3 * h * self.intermediate  # gate, up, down
        return attention + mlp + 2 * h  # two RMSNorm weights

    @property
    def embedding_params(self) -> int:
        return self.vocab * self.hidden

    @property
    def params(self) -> int:
        head = 0 if self.tied else self.vocab * self.hidden
        return self.embedding_params + self.layers * self.layer_params + self.hidden + head

    @property
    def largest_unit_params(self) -> int:
        """The biggest unit the runtime gathers at once: a decoder layer, or the embedding / LM head."""
        return max(self.layer_params, self.embedding_params)


PRESETS = {
    "llama-7b": ModelSpec("llama-7b", 32000, 4096, 11008, 32, 32, 32, max_seq=4096),
    "llama-13b": ModelSpec("llama-13b", 32000, 5120, 13824, 40, 40, 40, max_seq=4096),
    "llama-70b": ModelSpec("llama-70b", 32000, 8192, 28672, 80, 64, 8, max_seq=4096),
    "llama3-8b": ModelSpec("llama3-8b", 128256, 4096, 14336, 32, 32, 8, max_seq=8192),
    "llama3-70b": ModelSpec("llama3-70b", 128256, 8192, 28672, 80, 64, 8, max_seq=8192),
    "llama3-405b": ModelSpec("llama3-405b", 128256, 16384, 53248, 126, 128, 8, max_seq=8192),
}


def model_from(source: str) -> ModelSpec:
    """A preset name, or a path to a config.json (or to the directory holding one)."""
    if source in PRESETS:
        return PRESETS[source]
    path = Path(source)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ValueError(f"--model {source}: neither a preset ({', '.join(PRESETS)}) nor a config.json path")
    c = json.loads(path.read_text())
    get = lambda *keys, default=None: next((c[k] for k in keys if k in c), default)  # noqa: E731
    hidden = get("hidden_size", "n_embd")
    heads = get("num_attention_heads", "n_head")
    if hidden is None or heads is None or get("num_hidden_layers", "n_layer") is None or get("vocab_size") is None:
        raise ValueError(f"--model {path}: missing vocab_size / hidden_size / num_attention_heads / "
                         "num_hidden_layers")
    return ModelSpec(name=get("_name_or_path", default=path.parent.name) or path.parent.name,
                     vocab=get("vocab_size"), hidden=hidden,
                     intermediate=get("intermediate_size", "n_inner", default=None) or 4 * hidden,
                     layers=get("num_hidden_layers", "n_layer"), heads=heads,
                     kv_heads=get("num_key_value_heads", default=heads) or heads,
                     tied=bool(get("tie_word_embeddings", default=False)),
                     max_seq=get("max_position_embeddings", "n_positions", default=4096),
                     explicit_head_dim=get("head_dim", default=None))
