"""A DeepSpeed JSON's training sections (optimizer, scheduler, clipping, batch sizes), honoured as Hugging Face's
Trainer honours them with DeepSpeed (transformers' HfTrainerDeepSpeedConfig):

  - a value "auto" is filled from the run's own setting (TrainingArguments, or `offload finetune`'s flags);
  - an explicit value must equal the run's: every one that differs is reported at once, naming both values;
  - an `optimizer` section makes the optimizer DeepSpeed's (AdamW over every trainable parameter with the file's
    lr, betas, eps and weight decay: DeepSpeed's optimizer decays every parameter, where Trainer's spares biases
    and norms), and a `scheduler` section DeepSpeed's schedule (WarmupLR, WarmupDecayLR, WarmupCosineLR below,
    with DeepSpeed's formulas and its order: the first step runs at the schedule's starting rate).

`Config.from_deepspeed` checks these sections' shape (offload/deepspeed_training.py) and keeps them in
`Config.deepspeed_training`; OffloadTrainer and `offload finetune` match and apply them here. A loop of your own
sets them itself.
Imports no transformers.
"""
from __future__ import annotations

import copy
import math
from typing import Any

import torch

from ..deepspeed_training import SCHEDULERS

# DeepSpeed's defaults for what a file leaves out (deepspeed/runtime/lr_schedules.py)
_SCHED_DEFAULTS = {"warmup_min_lr": 0.0, "warmup_num_steps": 1000, "warmup_type": "log", "warmup_min_ratio": 0.0,
                   "cos_min_ratio": 0.0001}


def _where(ds: dict, dotted: str):
    """(the dict holding the last key of `dotted`, that key), or (None, key) where a section is missing."""
    node = ds
    *heads, last = dotted.split(".")
    for head in heads:
        node = node.get(head) if isinstance(node, dict) else None
    return (node if isinstance(node, dict) else None), last


class Matcher:
    """Hugging Face's fill_match over a copy of the training sections: "auto" takes the run's value; an explicit
    value that differs is kept in `mismatches` (all of them reported at once by `raise_mismatches`)."""

    def __init__(self, training: dict | None):
        self.config = copy.deepcopy(training or {})
        self.mismatches: list[str] = []

    def fill(self, dotted: str, ours: Any, our_name: str, must_match: bool = True) -> None:
        node, key = _where(self.config, dotted)
        if node is None or key not in node:
            return
        if node[key] == "auto":
            node[key] = ours
            return
        theirs = node[key]
        if must_match and theirs is not None and not _equal(theirs, ours):
            self.mismatches.append(f"{dotted}={theirs!r} vs {our_name}={ours!r}")

    def raise_mismatches(self, who: str, fix: str) -> None:
        if self.mismatches:
            raise ValueError(f"{who}: the DeepSpeed config differs from {fix}: " + "; ".join(self.mismatches) +
                             ". Make each pair agree, or set the DeepSpeed value to \"auto\"")


def _equal(a, b) -> bool:
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b or a == b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return float(a) == float(b)
    return a == b


def optimizer_settings(training: dict) -> dict | None:
    """offload.AdamW's keyword arguments from a filled optimizer section (None: the file has none). Values the file
    leaves out take DeepSpeed's defaults (lr 1e-3, betas (0.9, 0.999), eps 1e-8, weight decay 0)."""
    opt = training.get("optimizer")
    if opt is None:
        return None
    params = opt.get("params") or {}
    return dict(lr=float(params.get("lr", 1e-3)), betas=tuple(float(b) for b in params.get("betas", (0.9, 0.999))),
                eps=float(params.get("eps", 1e-8)), weight_decay=float(params.get("weight_decay", 0.0)))


def describe_optimizer(training: dict) -> str:
    s = optimizer_settings(training)
    return (f"AdamW(lr={s['lr']:g}, betas=({s['betas'][0]:g}, {s['betas'][1]:g}), eps={s['eps']:g}, weight_decay="
            f"{s['weight_decay']:g} on every trainable parameter, as DeepSpeed's optimizer applies it)")


def describe_scheduler(training: dict) -> str:
    sched = training["scheduler"]
    params = {k: v for k, v in (sched.get("params") or {}).items()}
    return f"{sched['type']}(" + ", ".join(f"{k}={v}" for k, v in params.items()) + ")"


def build_scheduler(optimizer: torch.optim.Optimizer, training: dict) -> torch.optim.lr_scheduler.LRScheduler:
    """DeepSpeed's schedule of a filled scheduler section, as a torch LRScheduler (stepped after each optimizer
    step, as DeepSpeed's engine steps it; its state is JSON, for checkpoints)."""
    sched = training["scheduler"]
    params = {**{k: v for k, v in _SCHED_DEFAULTS.items() if k in SCHEDULERS[sched["type"]]},
              **(sched.get("params") or {})}
    if "auto" in params.values():
        left = sorted(k for k, v in params.items() if v == "auto")
        raise ValueError(f"DeepSpeed scheduler.params {left} are still \"auto\": nothing filled them; give numbers")
    return DeepSpeedSchedule(optimizer, sched["type"], **params)


class DeepSpeedSchedule(torch.optim.lr_scheduler.LRScheduler):
    """DeepSpeed's WarmupLR / WarmupDecayLR / WarmupCosineLR (deepspeed/runtime/lr_schedules.py), over torch's
    LRScheduler. DeepSpeed's `last_batch_iteration` is torch's `last_epoch - 1`: built, the optimizer holds the
    schedule's starting rate (iteration -1: warmup_min_lr, or 0 for WarmupCosineLR), and each step() after an
    optimizer step moves one iteration on, as DeepSpeed's engine does."""

    def __init__(self, optimizer, kind: str, total_num_steps: int | None = None, warmup_min_lr: float = 0.0,
                 warmup_max_lr: float | None = None, warmup_num_steps: int = 1000, warmup_type: str = "log",
                 warmup_min_ratio: float = 0.0, cos_min_ratio: float = 0.0001):
        if kind not in SCHEDULERS:
            raise ValueError(f"DeepSpeedSchedule: {kind!r} is not one of {tuple(SCHEDULERS)}")
        if isinstance(warmup_num_steps, bool) or int(warmup_num_steps) != warmup_num_steps or warmup_num_steps <= 0:
            raise ValueError(f"DeepSpeed scheduler.params.warmup_num_steps={warmup_num_steps!r}: give a positive "
                             "whole number")
        if kind != "WarmupLR" and total_num_steps is None:
            raise ValueError(f"DeepSpeed scheduler {kind} needs params.total_num_steps (a number or \"auto\")")
        self.kind = kind
        self.total_num_steps = total_num_steps
        self.warmup_min_lr = float(warmup_min_lr)
        self.warmup_max_lr = None if warmup_max_lr is None else float(warmup_max_lr)
        self.warmup_num_steps = max(2, int(warmup_num_steps))
        self.warmup_type = warmup_type
        self.warmup_min_ratio = float(warmup_min_ratio)
        self.cos_min_ratio = float(cos_min_ratio)
        super().__init__(optimizer)

    def _warmup(self, it: int) -> float:
        if self.warmup_type == "linear":
            return it / self.warmup_num_steps
        return math.log(it + 1) / math.log(self.warmup_num_steps)

    def _rate(self, it: int, base: float) -> float:
        if self.kind == "WarmupCosineLR":
            if it < 0:
                return 0.0
            if it < self.warmup_num_steps:
                ratio = self.warmup_min_ratio + self._warmup(it) * (1.0 - self.warmup_min_ratio)
            else:
                done = min(1.0, (it - self.warmup_num_steps + 1) / max(1, self.total_num_steps - self.warmup_num_steps))
                ratio = max(0.0, self.cos_min_ratio + (1.0 - self.cos_min_ratio) * (1 + math.cos(math.pi * done)) / 2)
            return base * ratio
        top = base if self.warmup_max_lr is None else self.warmup_max_lr
        if it < 0:
            return self.warmup_min_lr
        if it < self.warmup_num_steps:
            gamma = self._warmup(it)
        elif self.kind == "WarmupDecayLR":
            gamma = max(0.0, (self.total_num_steps - it) / max(1.0, self.total_num_steps - self.warmup_num_steps))
        else:
            gamma = 1.0
        return self.warmup_min_lr + (top - self.warmup_min_lr) * gamma

    def get_lr(self):
        return [self._rate(self.last_epoch - 1, base) for base in self.base_lrs]
