"""A fine-tune's settings (`offload finetune`'s flags, one field each), checked as they are made: what the job, the
preflight checks and the CLI share, below all three."""
from __future__ import annotations

import dataclasses

from ..config import parse_size
from ..errors import InputError

BUILTIN_VOCAB = 8192  # the built-in tokenizer's vocabulary (the built-in Llama: job.py's BUILTIN_LLAMA)
# Steps of the default run: within 3 minutes on a 2-core AVX2-only CPU, where "auto" computes in fp32 at about 1.3 s
# a step (benchmarks/RESULTS.md, "The first run on any machine"; 150 steps took 3:38 there, 2:21 with bf16 on
# AVX512_BF16). The loss still falls by about 3 nats.
DEFAULT_STEPS = 100
# --optim: the offload optimizer of each family (offload.optim.schema), as `offload plan --optimizer-states` names them
OPTIMIZERS = {"adamw": "AdamW", "adamw8bit": "AdamW8bit", "lion": "Lion"}


@dataclasses.dataclass
class FinetuneConfig:
    """One fine-tune run. Sizes take units ("256MiB"); None means the default described."""

    model: str | None = None  # Hugging Face model directory; None: the built-in small Llama, randomly initialized
    tokenizer: str | None = None  # tokenizer directory; None: the model's own (or, built-in: a BPE trained here)
    data: str | None = None  # plain text or JSONL file; None: the Python standard library's sources
    output: str = "offload-finetune"  # the fine-tuned model goes here (Hugging Face safetensors + config + tokenizer)
    steps: int | None = None  # optimizer steps; None: `epochs` if given, else DEFAULT_STEPS (100)
    epochs: float | None = None
    seq_len: int = 256
    micro_batch: int = 4  # sequences per forward, per rank
    grad_accum: int = 1
    lr: float = 1e-3
    warmup_steps: int | None = None  # None: 5% of the steps
    min_lr_ratio: float = 0.1  # the cosine ends at lr * min_lr_ratio
    weight_decay: float = 0.01
    max_grad_norm: float = 1.0
    optim: str = "adamw"  # the optimizer family: adamw, adamw8bit (8-bit moments) or lion
    # Runtime settings: None takes the --config file's value if it sets one, else the default named here.
    params: str | None = None  # tier of the parameters: device, cpu, nvme or auto (default nvme)
    optimizer: str | None = None  # tier of the fp32 master and AdamW moments (default nvme)
    nvme_path: str | None = None  # swap directory (default: a temporary directory, removed at the end)
    nvme_budget: str | None = None  # swap bytes per rank (default auto: 90% of the free space, split among ranks)
    cpu_budget: str | None = None  # default 256MiB for the built-in model (so shards really page), else auto
    device_budget: str | None = None  # default auto
    compute_dtype: str | None = None  # default auto: bf16 where the device multiplies it fast, else fp32
    update_in_backward: bool | None = None  # Config.update_in_backward (opt-in; default off)
    activations: str | None = None  # Config.activations: none, cpu or nvme (default none)
    grad_checkpointing: bool = False
    lora_r: int = 0  # LoRA rank: train PEFT adapters over the frozen base (0: a full fine-tune)
    lora_alpha: float | None = None  # LoRA's scale numerator (scaling = alpha / r); None: 2 x lora_r
    lora_targets: str = "q_proj,v_proj"  # comma-separated module names the adapters wrap
    lora_dropout: float = 0.0
    lora_merge: bool = False  # also write the base with the adapters merged, to OUTPUT/merged
    offload_config: str | None = None  # an offload Config JSON or a DeepSpeed JSON; the flags above override
    save_every: int = 0  # also save to OUTPUT/checkpoint-STEP every this many steps (0: only at the end)
    checkpoint_every: int = 0  # a resumable checkpoint (rt.save_checkpoint) every this many steps (0: none)
    checkpoint_dir: str | None = None  # default OUTPUT/checkpoints
    keep_checkpoints: int = 2  # the newest this many are kept
    resume: str | None = None  # a checkpoint directory (or a directory of them: its `latest`) to go on from
    max_shard_size: str = "2GiB"
    eval_blocks: int = 32  # held-out blocks (the tail of the data) for the evaluation loss
    vocab_size: int = BUILTIN_VOCAB  # the built-in tokenizer's vocabulary
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("seq_len", "micro_batch", "grad_accum"):
            if getattr(self, name) < 1:
                raise InputError(f"--{name.replace('_', '-')} must be at least 1 (got {getattr(self, name)})")
        if self.steps is not None and self.steps < 1:
            raise InputError(f"--steps must be at least 1 (got {self.steps})")
        if self.epochs is not None and self.epochs <= 0:
            raise InputError(f"--epochs must be positive (got {self.epochs})")
        if self.steps is not None and self.epochs is not None:
            raise InputError("give --steps or --epochs, not both")
        if not self.lr > 0:
            raise InputError(f"--lr must be positive (got {self.lr})")
        if not self.max_grad_norm >= 0:
            raise InputError(f"--max-grad-norm must be 0 (no clipping) or more (got {self.max_grad_norm})")
        if not self.weight_decay >= 0:
            raise InputError(f"--weight-decay must be 0 or more (got {self.weight_decay})")
        if self.optim not in OPTIMIZERS:
            raise InputError(f"--optim {self.optim!r}: choose one of {', '.join(OPTIMIZERS)}")
        if self.eval_blocks < 1:
            raise InputError(f"--eval-blocks must be at least 1 (got {self.eval_blocks})")
        if self.keep_checkpoints < 1:
            raise InputError(f"--keep-checkpoints must be at least 1 (got {self.keep_checkpoints}); to keep every "
                             "checkpoint give one at least the number of checkpoints the run saves")
        for name in ("save_every", "checkpoint_every"):
            if getattr(self, name) < 0:
                raise InputError(f"--{name.replace('_', '-')} must be 0 (never) or more (got {getattr(self, name)})")
        if self.lora_r < 0:
            raise InputError(f"--lora-r must be 0 (a full fine-tune) or more (got {self.lora_r})")
        if not self.lora_r and (self.lora_alpha is not None or self.lora_merge):
            raise InputError("--lora-alpha and --lora-merge go with --lora-r R (the adapters' rank); without it the "
                             "run is a full fine-tune")
        if self.lora_r and self.model is None:
            raise InputError("--lora-r trains adapters over a pretrained base: give --model DIR (the built-in model is "
                             "randomly initialized and not saved, so its adapters would have no base to load on)")
        if not 0 <= self.lora_dropout < 1:
            raise InputError(f"--lora-dropout must be in [0, 1) (got {self.lora_dropout})")
        if self.lora_r and not [t for t in self.lora_targets.split(",") if t.strip()]:
            raise InputError("--lora-targets names no module; give module names such as q_proj,v_proj")
        try:
            parse_size(self.max_shard_size, "--max-shard-size")
        except ValueError as exc:
            raise InputError(str(exc)) from None
