"""What a model is, for sizing: parameter count (all of it, and the part a token runs through) and the shapes that
set activations and unit sizes.

From a Hugging Face config.json or a preset. The count is exact (each family's own `num_parameters()`, tests/
test_plan.py builds them on the meta device) for Llama, Mistral, Qwen2, Qwen3, Phi-3 and GPT-2 and for the
mixture-of-experts families Mixtral (num_local_experts), Qwen2-MoE / Qwen3-MoE (num_experts, moe_intermediate_size,
shared_expert_intermediate_size, MoE layers every decoder_sparse_step but mlp_only_layers), DeepSeek-V3 (multi-head
latent attention, n_routed_experts + n_shared_experts of moe_intermediate_size, dense layers before
first_k_dense_replace) and GPT-OSS (biased experts and router, attention sinks); other families are counted as the
Llama shape with their experts, biases and norms where the keys say so. A MoE layer counts every expert and its
router: ZeRO-3 gathers the whole layer. The compute per token counts the active parameters: num_experts_per_tok
routed experts of each MoE layer (and the shared ones).
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
    intermediate: int  # the dense MLP's width (the layers that are not MoE)
    layers: int
    heads: int
    kv_heads: int
    tied: bool = False
    max_seq: int = 4096
    explicit_head_dim: int | None = None  # config.json's head_dim where it is not hidden / heads (Qwen3, Gemma)
    # mixture of experts (experts 0: a dense model)
    experts: int = 0  # routed experts in each MoE layer
    experts_per_token: int = 0  # routed experts a token runs through (num_experts_per_tok)
    expert_intermediate: int = 0  # one routed expert's MLP width
    shared_intermediate: int = 0  # the always-on shared experts' MLP width in all (Qwen2-MoE, DeepSeek)
    moe_layers: int = 0  # how many of the layers are MoE (the rest have the dense MLP)
    # what the Llama shape (bias-free q/k/v/o, gated MLP, RMSNorm) leaves out
    mlp_matrices: int = 3  # the dense MLP's matrices: 3 gated (gate, up, down), 2 plain (GPT-2's fc, proj)
    attention_params: int = 0  # per layer where attention is not q/k/v/o (DeepSeek's latent attention); 0: q/k/v/o
    layer_extra: int = 0  # per layer: biases, q/k norms, LayerNorm biases, attention sinks
    dense_mlp_extra: int = 0  # per dense layer: the MLP's biases
    expert_extra: int = 0  # per routed expert: its biases (GPT-OSS)
    moe_extra: int = 0  # per MoE layer beyond the router's hidden x experts: router bias, shared-expert gate
    extra: int = 0  # outside the layers: learned positions, the final norm's bias

    @property
    def head_dim(self) -> int:
        return self.explicit_head_dim or self.hidden // self.heads

    @property
    def attention(self) -> int:
        if self.attention_params:
            return self.attention_params
        h, q, kv = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim
        return h * q + 2 * h * kv + q * h  # q, k, v, o

    @property
    def expert_params(self) -> int:
        """One routed expert: a gated MLP of expert_intermediate."""
        return 3 * self.hidden * self.expert_intermediate + self.expert_extra

    @property
    def dense_layer_params(self) -> int:
        mlp = self.mlp_matrices * self.hidden * self.intermediate + self.dense_mlp_extra
        return self.attention + mlp + 2 * self.hidden + self.layer_extra  # (two norms' weights)

    @property
    def moe_layer_params(self) -> int:
        """Every expert, the router (hidden x experts) and the shared experts."""
        h = self.hidden
        moe = (self.experts * self.expert_params + h * self.experts + 3 * h * self.shared_intermediate
               + self.moe_extra)
        return self.attention + moe + 2 * h + self.layer_extra

    @property
    def layer_params(self) -> int:
        """The largest decoder layer (a MoE one with all its experts, where there are MoE layers)."""
        if not self.moe_layers:
            return self.dense_layer_params
        if self.moe_layers == self.layers:
            return self.moe_layer_params
        return max(self.dense_layer_params, self.moe_layer_params)

    @property
    def embedding_params(self) -> int:
        return self.vocab * self.hidden

    @property
    def params(self) -> int:
        head = 0 if self.tied else self.vocab * self.hidden
        body = (self.layers - self.moe_layers) * self.dense_layer_params + self.moe_layers * self.moe_layer_params
        return self.embedding_params + body + self.hidden + self.extra + head

    @property
    def active_params(self) -> int:
        """The parameters one token runs through: every routed expert it is not sent to left out."""
        idle = max(0, self.experts - self.experts_per_token)
        return self.params - self.moe_layers * idle * self.expert_params

    @property
    def unit_params(self) -> list[int]:
        """Parameters of each unit the runtime gathers and pages: the embedding, every decoder layer, the LM head
        when untied (the final norm, always gathered and a few KiB, left out)."""
        dense = [self.dense_layer_params] * (self.layers - self.moe_layers)
        head = [] if self.tied else [self.vocab * self.hidden]
        return [self.embedding_params] + dense + [self.moe_layer_params] * self.moe_layers + head

    @property
    def largest_unit_params(self) -> int:
        """The biggest unit the runtime gathers at once: a decoder layer, or the embedding / LM head."""
        return max(self.layer_params, self.embedding_params)


def spec_from_config(c: dict, name: str) -> ModelSpec:
    """A ModelSpec from a config.json's keys (module docstring for the families counted exactly)."""
    family = c.get("model_type", "")
    get = lambda *keys, default=None: next((c[k] for k in keys if c.get(k) is not None), default)  # noqa: E731
    hidden, heads = get("hidden_size", "n_embd"), get("num_attention_heads", "n_head")
    layers, vocab = get("num_hidden_layers", "n_layer"), get("vocab_size")
    if hidden is None or heads is None or layers is None or vocab is None:
        raise ValueError(f"--model {name}: missing vocab_size / hidden_size / num_attention_heads / "
                         "num_hidden_layers")
    intermediate = get("intermediate_size", "n_inner") or 4 * hidden
    kv_heads = get("num_key_value_heads", default=heads)
    head_dim = get("head_dim")
    q, kv = heads * (head_dim or hidden // heads), kv_heads * (head_dim or hidden // heads)
    fields: dict = {}
    layer_extra = 0

    # attention
    if get("kv_lora_rank") is not None:  # DeepSeek-V2/V3: multi-head latent attention
        rope, nope = get("qk_rope_head_dim", default=0), get("qk_nope_head_dim", default=0)
        v_dim, kv_rank, q_rank = get("v_head_dim", default=nope), get("kv_lora_rank"), get("q_lora_rank")
        bias = bool(get("attention_bias", default=False))
        qk = heads * (nope + rope)
        attn = (hidden * qk if q_rank is None else hidden * q_rank + bias * q_rank + q_rank + q_rank * qk)
        attn += hidden * (kv_rank + rope) + bias * (kv_rank + rope) + kv_rank + kv_rank * heads * (nope + v_dim)
        attn += heads * v_dim * hidden + bias * hidden
        fields["attention_params"] = attn
    elif family == "gpt2":  # Conv1D c_attn (q, k, v) and c_proj with biases, LayerNorms with biases
        layer_extra += 3 * hidden + hidden + 2 * hidden
        fields["mlp_matrices"] = 2
        fields["dense_mlp_extra"] = intermediate + hidden
        fields["extra"] = get("n_positions", "max_position_embeddings", default=1024) * hidden + hidden
    else:
        if family == "qwen2" or (family == "qwen2_moe" and get("qkv_bias", default=True)):
            layer_extra += q + 2 * kv  # q, k, v biases
        elif get("attention_bias", default=False):
            layer_extra += q + 2 * kv + hidden  # q, k, v, o biases
        if family in ("qwen3", "qwen3_moe"):
            layer_extra += 2 * (head_dim or hidden // heads)  # q_norm, k_norm
        if family == "gpt_oss":
            layer_extra += heads  # attention sinks
        if get("mlp_bias", default=False):
            fields["dense_mlp_extra"] = 2 * intermediate + hidden

    # experts
    experts = get("num_local_experts", "num_experts", "n_routed_experts", default=0) or 0
    if experts:
        expert_width = get("moe_intermediate_size", default=intermediate)
        shared = get("shared_expert_intermediate_size", default=0) or 0
        moe_extra = hidden if "shared_expert_intermediate_size" in c else 0  # Qwen2-MoE's shared-expert gate
        if get("n_shared_experts"):
            shared += get("n_shared_experts") * expert_width
        if family == "gpt_oss":
            fields["expert_extra"] = 2 * expert_width + hidden  # gate_up and down biases
            moe_extra += experts  # the router's bias
        if get("first_k_dense_replace") is not None:  # DeepSeek: dense layers first (then every moe_layer_freq-th)
            freq = get("moe_layer_freq", default=1) or 1
            moe = [i >= get("first_k_dense_replace") and i % freq == 0 for i in range(layers)]
        elif "decoder_sparse_step" in c or "mlp_only_layers" in c:  # Qwen-MoE: every step-th layer but the listed
            step, dense = get("decoder_sparse_step", default=1) or 1, set(get("mlp_only_layers", default=[]) or [])
            moe = [i not in dense and (i + 1) % step == 0 for i in range(layers)]
        else:
            moe = [True] * layers
        fields.update(experts=experts, experts_per_token=get("num_experts_per_tok", "experts_per_token",
                                                              default=experts),
                      expert_intermediate=expert_width, shared_intermediate=shared, moe_extra=moe_extra,
                      moe_layers=sum(moe))
    return ModelSpec(name=name, vocab=vocab, hidden=hidden, intermediate=intermediate, layers=layers, heads=heads,
                     kv_heads=kv_heads, tied=bool(get("tie_word_embeddings", default=family == "gpt2")),
                     max_seq=get("max_position_embeddings", "n_positions", default=4096),
                     explicit_head_dim=head_dim if get("kv_lora_rank") is None else None,
                     layer_extra=layer_extra, **fields)


MIXTRAL_8X7B = {"model_type": "mixtral", "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336,
                "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
                "num_local_experts": 8, "num_experts_per_tok": 2, "max_position_embeddings": 32768,
                "tie_word_embeddings": False}

PRESETS = {
    "llama-7b": ModelSpec("llama-7b", 32000, 4096, 11008, 32, 32, 32, max_seq=4096),
    "llama-13b": ModelSpec("llama-13b", 32000, 5120, 13824, 40, 40, 40, max_seq=4096),
    "llama-70b": ModelSpec("llama-70b", 32000, 8192, 28672, 80, 64, 8, max_seq=4096),
    "llama3-8b": ModelSpec("llama3-8b", 128256, 4096, 14336, 32, 32, 8, max_seq=8192),
    "llama3-70b": ModelSpec("llama3-70b", 128256, 8192, 28672, 80, 64, 8, max_seq=8192),
    "llama3-405b": ModelSpec("llama3-405b", 128256, 16384, 53248, 126, 128, 8, max_seq=8192),
    "mixtral-8x7b": spec_from_config(MIXTRAL_8X7B, "mixtral-8x7b"),
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
    return spec_from_config(c, c.get("_name_or_path") or path.parent.name)
