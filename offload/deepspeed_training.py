"""The training sections of a DeepSpeed JSON (optimizer, scheduler, clipping, batch sizes): which keys they are and
what they may hold, checked as `Config.from_deepspeed` reads the file, before any of it is applied. Below the
Config; integrations/deepspeed.py matches and applies the checked sections (OffloadTrainer, `offload finetune`).
Imports neither torch nor transformers."""
from __future__ import annotations

import copy

# the top-level keys of the training sections (validated here, matched by integrations/deepspeed.py)
TRAINING_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
                 "gradient_clipping", "optimizer", "scheduler")
OPTIMIZER_TYPES = ("Adam", "AdamW")  # DeepSpeed's names (case-insensitive): the same decoupled AdamW as offload's
# optimizer.params keys: the four values, and switches that must keep the value offload's AdamW has
_OPT_VALUES = ("lr", "betas", "eps", "weight_decay")
_OPT_FIXED = {"bias_correction": True, "amsgrad": False, "adam_w_mode": True}
_OPT_NO_EFFECT = ("torch_adam", "fp32_optimizer_states")  # which implementation runs: offload's fused one does
SCHEDULERS = {
    "WarmupLR": ("warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type"),
    "WarmupDecayLR": ("total_num_steps", "warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type"),
    "WarmupCosineLR": ("total_num_steps", "warmup_min_ratio", "warmup_num_steps", "cos_min_ratio", "warmup_type"),
}


def validate(ds: dict) -> dict:
    """The training sections of a DeepSpeed config (a deep copy), checked for shape: an optimizer or scheduler
    offload cannot run, or an unknown key in them, raises ValueError naming the key and the fix."""
    out = {k: copy.deepcopy(ds[k]) for k in TRAINING_KEYS if k in ds}
    for key in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
                "gradient_clipping"):
        value = out.get(key)
        if value is not None and value != "auto" and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise ValueError(f"from_deepspeed: {key}={value!r} is not a number; give one, or \"auto\"")
    opt = out.get("optimizer")
    if opt is not None:
        if not isinstance(opt, dict):
            raise ValueError(f"from_deepspeed: optimizer={opt!r}; expected a section with type and params")
        kind = str(opt.get("type", ""))
        if kind.lower() not in [t.lower() for t in OPTIMIZER_TYPES]:
            raise ValueError(f"from_deepspeed: optimizer.type={opt.get('type')!r}; offload runs AdamW (DeepSpeed's "
                             f"{' or '.join(OPTIMIZER_TYPES)}): give one of those, or drop the optimizer section")
        unknown = set(opt) - {"type", "params"}
        if unknown:
            raise ValueError(f"from_deepspeed: unknown key optimizer.{sorted(unknown)[0]}")
        params = opt.get("params") or {}
        for key, value in params.items():
            if key in _OPT_FIXED:
                want = _OPT_FIXED[key]
                if kind.lower() == "adamw" and key == "adam_w_mode":
                    continue  # DeepSpeed's AdamW is decoupled whatever this says
                if value != want:
                    raise ValueError(f"from_deepspeed: optimizer.params.{key}={value!r}; offload's AdamW runs with "
                                     f"{key}={want}: give that, or drop the key")
            elif key not in _OPT_VALUES and key not in _OPT_NO_EFFECT:
                raise ValueError(f"from_deepspeed: unknown key optimizer.params.{key}")
        betas = params.get("betas")
        if betas is not None and betas != "auto" and not (isinstance(betas, (list, tuple)) and len(betas) == 2):
            raise ValueError(f"from_deepspeed: optimizer.params.betas={betas!r}; give two numbers, or \"auto\"")
    sched = out.get("scheduler")
    if sched is not None:
        if not isinstance(sched, dict) or sched.get("type") not in SCHEDULERS:
            kind = sched.get("type") if isinstance(sched, dict) else sched
            raise ValueError(f"from_deepspeed: scheduler.type={kind!r}; offload runs DeepSpeed's "
                             f"{', '.join(SCHEDULERS)}: give one of those, or drop the scheduler section (Trainer's "
                             "lr_scheduler_type then applies)")
        unknown = set(sched) - {"type", "params"}
        if unknown:
            raise ValueError(f"from_deepspeed: unknown key scheduler.{sorted(unknown)[0]}")
        for key, value in (sched.get("params") or {}).items():
            if key not in SCHEDULERS[sched["type"]]:
                raise ValueError(f"from_deepspeed: scheduler.params.{key} is not a parameter of {sched['type']} "
                                 f"(it takes {', '.join(SCHEDULERS[sched['type']])})")
            if key == "warmup_type":
                if value not in ("log", "linear"):
                    raise ValueError(f"from_deepspeed: scheduler.params.warmup_type={value!r}; give 'log' or "
                                     "'linear'")
            elif value != "auto" and (isinstance(value, bool) or not isinstance(value, (int, float))):
                raise ValueError(f"from_deepspeed: scheduler.params.{key}={value!r} is not a number; give one, or "
                                 "\"auto\"")
    return out
