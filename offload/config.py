"""The typed configuration of an offload run (`offload.Config`).

Sizes are strings with units ("60GiB", "512MB", "4096B"); a number without a unit ("512", or 512) is refused
naming the field and the unit to add (store/sizes.py, the one size rule); tiers are "device", "cpu", "nvme"
or "auto" (the runtime picks the fastest tier whose budget holds the state, at wrap time).
`Config.from_deepspeed` imports a DeepSpeed `zero_optimization` section and says which keys it ignores.
Every error names the field and the fix.
"""
from __future__ import annotations

import dataclasses
import json
import os
import warnings
from pathlib import Path
from typing import Any, Mapping

from .bench.figures import bench_figures
from .deepspeed_training import TRAINING_KEYS as _DS_TRAINING_KEYS, validate as validate_training
from .store.sizes import Bytes, parse_size as _parse_size

TIERS = ("device", "cpu", "nvme", "auto")
COMPUTE_DTYPES = ("fp32", "bf16", "fp16", "auto")
REDUCE_DTYPES = ("fp32", "bf16")
ACTIVATION_HOMES = ("none", "cpu", "nvme", "auto")  # Config.activations


def parse_size(value: str | int | float, field: str = "size") -> int:
    """Bytes from "60GiB" / "1.5GB" / "4096B" (a number without a unit is refused). Raises ValueError naming
    `field`."""
    return _parse_size(value, f"offload.Config.{field}")


_DURATION_UNITS = {"ms": 1e-3, "s": 1.0, "min": 60.0, "h": 3600.0}


def parse_duration(value: str | int | float, field: str) -> float:
    """Seconds from "30s" / "10min" / "1.5h" / "250ms" / a number of seconds. Raises ValueError naming `field`."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        seconds = float(value)
    else:
        text = str(value).strip()
        unit = next((u for u in sorted(_DURATION_UNITS, key=len, reverse=True) if text.endswith(u)), None)
        try:
            seconds = float(text[:-len(unit)] if unit else text) * (_DURATION_UNITS[unit] if unit else 1.0)
        except ValueError:
            raise ValueError(f"offload.Config.{field}: {value!r} is not a duration; give e.g. '30s', '10min' or "
                             "a number of seconds") from None
    if not seconds > 0:
        raise ValueError(f"offload.Config.{field}: {value!r} must be positive")
    return seconds


@dataclasses.dataclass
class Config:
    """Where every class of training state lives and how the model is cut into units.

    params / optimizer: home tier of the parameter shards (compute dtype) and of the optimizer states
      (fp32 master when compute is bf16, exp_avg, exp_avg_sq). "auto" params take the device only where the
      shards and two gathered units fit in the device budget, in half of it when that budget is "auto" (the
      other half left to the activations, unknown at wrap).
    grads: home tier of the fp32 gradient shards the step consumes. "auto" (default): with the optimizer
      states, except when those are on nvme and an explicitly given device_budget holds every gradient shard
      beside the gathered units: then the device tier (no nvme write in backward, no read in the step). With
      device_budget "auto" the runtime cannot know what the activations will need, so it does not take it.
    nvme_path: directory for swap files (required when a tier is "nvme"); must exist and be writable.
    device_budget / cpu_budget / nvme_budget: byte budgets per rank. "auto" (nvme_budget None is the same):
      90% of the GPU's free memory (without a GPU, a quarter of the available host memory: the device tier is
      then a region of host memory), half the available host memory (capped by the cgroup's limit), 90% of
      nvme_path's free space; host memory and the drive split among the node's ranks (LOCAL_WORLD_SIZE).
      store/budget.py has the rule. An "auto" device budget is fitted once after the first step, when the
      activations and communicators have been in device memory: the device tier may hold what it holds then
      plus 90% of what the device had free at that step's peak, if that is less (rt.stats()["memory"]
      ["device_budget_fit"]). `init` refuses budgets the machine cannot hold, and an nvme_budget larger
      than the free space.
    compute_dtype: "fp32" (default, like plain PyTorch, fast on every CPU and GPU), "bf16" (params gathered and
      computed in bf16; the master copy stays fp32), "fp16" (the same in float16; train it with
      offload.GradScaler, whose loss scaling keeps small gradients from flushing to zero and skips a step whose
      gradients overflowed) or "auto" (bf16 where the compute device multiplies it fast: a GPU with bf16, a CPU
      with AVX512_BF16 or AMX; else fp32; offload/compute_dtype.py says how it is decided; the runtime's
      config holds the choice, rt.stats()["compute_dtype"] says why). An explicit bf16/fp16 on a CPU that only
      emulates it (20-70x slower matmuls) is kept and warned about once, with the measured figure.
    reduce_dtype: the dtype gradients are summed over ranks in: "fp32" (default, exact as plain PyTorch's DDP
      in fp32) or "bf16" (half the reduce-scatter bytes, FSDP2's MixedPrecisionPolicy(reduce_dtype=bf16): each
      rank's gradient is rounded to bf16 before the sum, and each partial sum is rounded again, in the
      backend's order: once on 2 ranks, up to 7 times on 8; the shard is stored in fp32). With one rank
      nothing is summed and it has no effect.
    unit_classes: module classes (types or class names) whose instances become units. Empty (default): each
      element of a ModuleList of repeated, same-class blocks is a unit (HF decoder layers,
      nn.TransformerEncoderLayer stacks), everything else the root unit.
    unit_min_bytes: alternative policy: greedily make a unit of every submodule holding at least this many
      parameter bytes (compute dtype), children first. Exclusive with unit_classes.
    persist_threshold: units whose gathered size is at most this many bytes stay gathered (never resharded).
    seed: seeds the unit-by-unit materialization of models built inside `offload.init` (same on all ranks).
    pipeline: True (default): trace the first step, then read ahead, gather the next unit while one computes,
      reduce and update in the background, keep what fits resident in the cpu budget. False: every move
      waited where it is asked for (the synchronous reference; results are bitwise the same).
    chunk_size: fp32 bytes per chunk of a unit's shard, the piece that is paged and stepped at once
      (None: cpu_budget / 64, between 1MiB and 64MiB).
    collective_timeout: how long a rank waits in one collective before it stops with an error naming the
      collective, the unit, and which rank is behind and where (the watchdog, offload/zero/collectives/watchdog.py).
    agreement_timeout: how long a collective entry point called outside the training loop (model.state_dict(),
      rt.full_state_dict(), an export, opt.full_state_dict(), rt.save_checkpoint / load_checkpoint) waits for
      every rank to call it before it raises, naming the ranks that did not (offload/zero/collectives/agree.py):
      a call on rank 0 alone is refused in this time instead of hanging for collective_timeout. 2min by default:
      longer than the ranks' skew at a call they all make (one rank's host update on a large model can run tens of
      seconds behind another's), a fifth of the collective timeout.
    swap_checksums: an XXH3-64 hash of every swap slot written, checked when it is read back (a corrupt drive
      raises SwapCorruptError instead of training on wrong numbers; costs one hash pass over the nvme traffic).
    log_every: log one line of step telemetry (logger "offload") every this many optimizer steps (0: never).
    machine: an `offload bench --json` file of this machine (nvme read/write, pinned PCIe, CPU AdamW rate):
      "auto" params / optimizer take the pair of tiers that fits and whose data movement the plan's step model
      predicts fastest with these figures, as `offload plan --bench-json` does (None: the device's nominal
      figures).
    update_in_backward: opt-in, off by default. Each unit's AdamW update runs during the backward, as soon as
      its gradient is final, instead of after it, so the optimizer's nvme traffic overlaps the backward. Without
      gradient clipping the results are bitwise those of the default path. With rt.clip_grad_norm_ the update
      of step t is scaled by step t-1's clip coefficient (the global norm is only known once the backward is
      over): the stated bound, reported per step in rt.stats()["last_step"]["clip"]; the first step is exact.
      Contract: the backward passes before a step's last run inside rt.accumulating() or rt.no_sync(),
      hyperparameters are set before the backward (an LR scheduler stepped after opt.step()), checkpoints are
      taken after opt.step(); a breach raises.
      See offload/zero/update/backward_updates.py.
    speculative_updates: on by default; exact. At a step whose previous step did not clip, each unit's update
      (its chunks whose optimizer states are on nvme and not resident) runs during the backward as if the clip
      coefficient were 1.0, its new states written beside the old ones on nvme; opt.step() keeps them when the
      coefficient is exactly 1.0 and hyperparameters did not change, else takes them back and updates from the
      old states. Results are bitwise those of the exact path in every case; the optimizer's I/O moves under the
      backward when clipping does not fire. Costs a spare nvme slot per speculated state (the optimizer states'
      size again on nvme). rt.stats()["speculation"] counts commits and misses.
      See offload/zero/update/speculation.py.
    activations: where the tensors autograd saves in a wrapped model's forward wait for the backward: "none"
      (default: on the compute device, as in plain PyTorch), "cpu" (the cpu tier, pinned), "nvme" (a swap file
      under nvme_path, through the cpu tier) or "auto" (each tensor to the cpu tier while it has room, to the swap
      file after it; without nvme_path, the cpu tier alone). With activation checkpointing (a Hugging Face model's
      gradient_checkpointing_enable(), torch.utils.checkpoint non-reentrant) what moves is each checkpointed
      block's input. Only tensors of at least activations_min_size move, never parameters; they come back read
      ahead, bit for bit, and a tensor stays put when the budgets have no room for it (rt.stats()
      ["activations"]["kept_bytes"]). See offload/zero/activations.py.
    activations_min_size: the smallest saved tensor that moves ("1MiB"): smaller ones cost more in copies than
      they free.
    optimizer_states: the optimizer family the placement sizes the optimizer's states for: "adamw" (default,
      fp32 moments, 8 bytes per parameter besides the master), "adamw-bf16" (offload.AdamW with
      moments_dtype=torch.bfloat16, 4), "adamw8bit" (offload.AdamW8bit, about 2) or "lion" (offload.Lion, 4). An optimizer that stores less than this is accepted (the placement was
      generous); one that stores more is refused, naming this setting.
    compute_through_device_tier: a test mode for CPU-only machines, off by default (on a GPU it changes nothing).
      The gathers and the device-side gradient accumulation take working copies of their shards in the device
      tier (on a CPU, a region of host memory), as a GPU run's do, instead of reading the home copy in place:
      the GPU's data path (device working copies of cpu- and nvme-homed shards, their write-back) runs and is
      checked on a CPU. Slower, results bitwise the same (tests/test_zero_parity.py).
    collectives_at_world_size_1: a test mode, off by default (at world size > 1 it changes nothing). One rank
      issues every collective through a real one-rank process group (the default group, or one offload.init
      starts in memory and ends at close: gloo on the CPU, NCCL on a GPU) instead of copying locally, with every
      lane, ticket, stream and check as at world size 8: the multi-rank path runs on one GPU. Results are bitwise
      the same, except with reduce_dtype="bf16", which then rounds the gradients as several ranks do.
    """

    params: str = "auto"
    optimizer: str = "auto"
    grads: str = "auto"
    nvme_path: str | None = None
    device_budget: str | int = "auto"
    cpu_budget: str | int = "auto"
    nvme_budget: str | int | None = None
    compute_dtype: str = "fp32"
    reduce_dtype: str = "fp32"
    unit_classes: tuple = ()
    unit_min_bytes: str | int | None = None
    persist_threshold: str | int = 0
    seed: int = 0
    pipeline: bool = True
    chunk_size: str | int | None = None
    log_every: int = 0
    collective_timeout: str | int | float = "10min"
    agreement_timeout: str | int | float = "2min"
    swap_checksums: bool = True
    machine: str | None = None
    update_in_backward: bool = False
    speculative_updates: bool = True
    activations: str = "none"
    activations_min_size: str | int = "1MiB"
    optimizer_states: str = "adamw"
    compute_through_device_tier: bool = False
    collectives_at_world_size_1: bool = False
    # Keys of an imported DeepSpeed config that have no effect here (filled by from_deepspeed).
    deepspeed_ignored: tuple = dataclasses.field(default=(), compare=False, repr=False)
    # An imported DeepSpeed config's training sections (optimizer, scheduler, gradient_clipping, batch sizes), which
    # OffloadTrainer and `offload finetune --config` apply or refuse a mismatch with (integrations/deepspeed.py)
    deepspeed_training: dict | None = dataclasses.field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        for name in ("params", "optimizer", "grads"):
            tier = getattr(self, name)
            if tier not in TIERS:
                raise ValueError(f"offload.Config.{name}: unknown tier {tier!r}; choose one of {TIERS}")
        from .optim.schema import by_name

        by_name(self.optimizer_states, "offload.Config.optimizer_states")  # unknown: say so now, with the names
        if self.compute_dtype not in COMPUTE_DTYPES:
            raise ValueError(
                f"offload.Config.compute_dtype: {self.compute_dtype!r} is not supported; "
                f"choose one of {COMPUTE_DTYPES}"
            )
        if self.reduce_dtype not in REDUCE_DTYPES:
            raise ValueError(f"offload.Config.reduce_dtype: {self.reduce_dtype!r} is not supported; "
                             f"choose one of {REDUCE_DTYPES}")
        if "nvme" in (self.params, self.optimizer, self.grads) and not self.nvme_path:
            which = next(n for n in ("params", "optimizer", "grads") if getattr(self, n) == "nvme")
            raise ValueError(f"offload.Config.nvme_path: required because {which}='nvme'; give a directory")
        for name in ("device_budget", "cpu_budget"):
            value = getattr(self, name)
            if value != "auto":
                parse_size(value, name)
        if self.nvme_budget is not None and self.nvme_budget != "auto":
            parse_size(self.nvme_budget, "nvme_budget")
        if self.machine is not None:
            bench_figures(self.machine, "offload.Config.machine")  # unreadable: say so now, not at wrap
        if isinstance(self.persist_threshold, PersistElements):  # DeepSpeed's count, in bytes of this compute dtype
            self.persist_threshold = Bytes(int(self.persist_threshold) * self.torch_compute_dtype.itemsize)
        parse_size(self.persist_threshold, "persist_threshold")
        if isinstance(self.unit_classes, (str, type)):
            self.unit_classes = (self.unit_classes,)
        self.unit_classes = tuple(self.unit_classes)
        for cls in self.unit_classes:
            if not isinstance(cls, (str, type)):
                raise ValueError(f"offload.Config.unit_classes: {cls!r} is neither a class nor a class name")
        if self.unit_min_bytes is not None:
            parse_size(self.unit_min_bytes, "unit_min_bytes")
            if self.unit_classes:
                raise ValueError(
                    "offload.Config.unit_min_bytes: contradicts unit_classes; give one unit policy, not both"
                )
        if not isinstance(self.seed, int):
            raise ValueError(f"offload.Config.seed: expected an int, got {self.seed!r}")
        if not isinstance(self.swap_checksums, bool):
            raise ValueError(f"offload.Config.swap_checksums: expected True or False, got {self.swap_checksums!r}")
        if not isinstance(self.update_in_backward, bool):
            raise ValueError("offload.Config.update_in_backward: expected True or False, got "
                             f"{self.update_in_backward!r}")
        if not isinstance(self.speculative_updates, bool):
            raise ValueError("offload.Config.speculative_updates: expected True or False, got "
                             f"{self.speculative_updates!r}")
        if self.activations not in ACTIVATION_HOMES:
            raise ValueError(f"offload.Config.activations: {self.activations!r} is not one of {ACTIVATION_HOMES}")
        if self.activations == "nvme" and not self.nvme_path:
            raise ValueError("offload.Config.nvme_path: required because activations='nvme'; give a directory")
        parse_size(self.activations_min_size, "activations_min_size")
        if not isinstance(self.compute_through_device_tier, bool):
            raise ValueError("offload.Config.compute_through_device_tier: expected True or False, got "
                             f"{self.compute_through_device_tier!r}")
        if not isinstance(self.collectives_at_world_size_1, bool):
            raise ValueError("offload.Config.collectives_at_world_size_1: expected True or False, got "
                             f"{self.collectives_at_world_size_1!r}")
        if not isinstance(self.pipeline, bool):
            raise ValueError(f"offload.Config.pipeline: expected True or False, got {self.pipeline!r}")
        if self.chunk_size is not None and parse_size(self.chunk_size, "chunk_size") < 8192:
            # (a chunk is a multiple of placement.CHUNK_ALIGN elements: anything smaller was raised to it silently)
            raise ValueError(f"offload.Config.chunk_size: {self.chunk_size!r} is below 8 KiB, the smallest chunk (2048 "
                             "fp32 elements); give at least '8KiB' ('1MiB' or more for a real run), or None for the "
                             "default")
        parse_duration(self.collective_timeout, "collective_timeout")
        parse_duration(self.agreement_timeout, "agreement_timeout")
        if not isinstance(self.log_every, int) or self.log_every < 0:
            raise ValueError(f"offload.Config.log_every: expected an int >= 0, got {self.log_every!r}")

    # ---- resolved values -------------------------------------------------------------------
    def bytes_of(self, name: str) -> int | None:
        """A size field in bytes (None for unset / "auto")."""
        value = getattr(self, name)
        if value is None or value == "auto":
            return None
        return parse_size(value, name)

    @property
    def torch_compute_dtype(self):
        import torch

        name = self.compute_dtype
        if name == "auto":  # what a runtime opened here would choose (it agrees the choice across ranks)
            from .compute_dtype import fast_compute_dtype
            from .device import compute_device

            name = fast_compute_dtype(compute_device())[0]
        return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(name, torch.float32)

    @property
    def torch_reduce_dtype(self):
        import torch

        return torch.bfloat16 if self.reduce_dtype == "bf16" else torch.float32

    # ---- DeepSpeed import ------------------------------------------------------------------
    @classmethod
    def from_deepspeed(cls, config: Mapping[str, Any] | str | os.PathLike, **overrides: Any) -> "Config":
        """A Config from a DeepSpeed config (a dict, or a path to JSON) or its `zero_optimization` section.

        Mapped: stage (must be 3), offload_param.{device,nvme_path}, offload_optimizer.{device,nvme_path},
        stage3_param_persistence_threshold, top-level bf16.enabled / fp16.enabled (compute_dtype; fp16's loss
        scaling is offload.GradScaler's, in the loop, so the fp16 section's scaler keys are listed as ignored) and
        communication_data_type (reduce_dtype).
        Known DeepSpeed keys with no meaning here are listed in `cfg.deepspeed_ignored` and in one warning, each
        with why. The training sections (optimizer, scheduler, gradient_clipping, train_batch_size,
        train_micro_batch_size_per_gpu, gradient_accumulation_steps) are checked and kept in
        `cfg.deepspeed_training`: OffloadTrainer and `offload finetune --config` apply them as Hugging Face's Trainer
        does with DeepSpeed ("auto" filled from their settings, a differing value refused naming both; see
        offload/integrations/deepspeed.py); the warning says so. Unknown keys and contradictions raise ValueError
        naming the key. `overrides` are Config fields applied last (e.g. cpu_budget).
        """
        if not isinstance(config, Mapping):
            path = Path(config)
            try:
                config = json.loads(path.read_text())
            except (OSError, json.JSONDecodeError) as exc:
                raise ValueError(f"offload.Config.from_deepspeed: cannot read DeepSpeed config {path}: {exc}")
        return _from_deepspeed(cls, dict(config), overrides)


_DS_TIER = {"none": "device", None: "device", "cpu": "cpu", "nvme": "nvme"}
# zero_optimization keys that shape DeepSpeed's own bucketing/scheduling; the offload runtime plans these
# itself, so they are accepted and reported as ignored.
_DS_ZERO_IGNORED = {
    "contiguous_gradients", "overlap_comm", "reduce_scatter", "reduce_bucket_size", "allgather_partitions",
    "allgather_bucket_size", "sub_group_size", "stage3_max_live_parameters", "stage3_max_reuse_distance",
    "stage3_prefetch_bucket_size", "stage3_gather_16bit_weights_on_model_save",
    "stage3_gather_fp16_weights_on_model_save", "round_robin_gradients", "elastic_checkpoint",
    "load_from_fp32_weights", "ignore_unused_parameters", "legacy_stage1", "zero_hpz_partition_size",
    "zero_quantized_weights", "zero_quantized_gradients", "mics_shard_size", "memory_efficient_linear",
    "stage3_module_granularity_threshold", "cpu_offload", "cpu_offload_params", "cpu_offload_use_pin_memory",
    "use_multi_rank_bucket_allreduce", "log_trace_cache_warnings",
}
_DS_OFFLOAD_IGNORED = {"pin_memory", "buffer_count", "buffer_size", "max_in_cpu", "ratio", "fast_init", "pipeline",
                       "pipeline_read", "pipeline_write"}
# top-level keys of DeepSpeed's engine (its logging, its own features) with no counterpart here
_DS_TOP_IGNORED = {
    "steps_per_print", "wall_clock_breakdown", "aio", "zero_allow_untested_optimizer",
    "activation_checkpointing", "flops_profiler", "tensorboard", "wandb", "comms_logger", "prescale_gradients",
    "gradient_predivide_factor", "dump_state", "amp", "data_types",
    "checkpoint", "memory_breakdown", "zero_force_ds_cpu_optimizer",
}
# why each kind of ignored key has no effect, for the warning
_DS_WHY = (
    (lambda k: k.startswith("zero_optimization."), "offload plans buckets, prefetch and pinning itself"),
    (lambda k: k.startswith("fp16."), "fp16's loss scale is offload.GradScaler's, in the loop"),
    (lambda k: k.endswith("=auto"), "\"auto\": the trainer's setting, or offload's default"),
    (lambda k: True, "DeepSpeed engine settings with no counterpart here"),
)


def _from_deepspeed(cls, ds: dict, overrides: dict) -> Config:
    fields, ignored = deepspeed_fields(ds)
    fields.update(overrides)
    cfg = cls(**fields)
    cfg.deepspeed_ignored = tuple(ignored)
    groups: dict[str, list[str]] = {}
    for key in ignored:  # each key under the first reason that fits it
        groups.setdefault(next(why for test, why in _DS_WHY if test(key)), []).append(key)
    parts = [f"{', '.join(keys)} ({why})" for why, keys in groups.items()]
    if ignored:
        parts[0] = "these DeepSpeed keys have no effect in offload: " + parts[0]
    if cfg.deepspeed_training:
        parts.append(f"{', '.join(sorted(cfg.deepspeed_training))} are kept for OffloadTrainer and `offload finetune`, "
                     "which apply them (\"auto\": TrainingArguments' or the flags' value) or refuse a value that "
                     "differs from theirs; a loop of your own must set them itself (offload.AdamW, its scheduler, "
                     "rt.clip_grad_norm_)")
    if parts:
        warnings.warn("offload.Config.from_deepspeed: " + "; ".join(parts), UserWarning, stacklevel=3)
    return cfg


class PersistElements(int):
    """A persist threshold in elements (DeepSpeed's stage3_param_persistence_threshold): the Config it is given to
    turns it into bytes of its own compute dtype."""


def deepspeed_fields(ds: dict) -> tuple[dict[str, Any], list[str]]:
    """(the Config fields a DeepSpeed config, or its zero_optimization section, sets; the keys it ignores).
    Raises ValueError naming an unknown key or a contradiction."""
    ignored: list[str] = []
    if "zero_optimization" in ds:
        zero = dict(ds["zero_optimization"] or {})
        top = {k: v for k, v in ds.items() if k != "zero_optimization"}
    else:  # the section itself
        zero, top = ds, {}
    fields: dict[str, Any] = {}
    half: dict[str, Any] = {}  # "bf16" / "fp16" -> its section's `enabled`
    for key, value in top.items():
        # "auto" is Hugging Face's placeholder, filled from TrainingArguments: the trainer decides those
        if key in ("bf16", "fp16"):
            section = dict(value or {})
            half[key] = section.pop("enabled", False)
            if half[key] == "auto":
                ignored.append(f"{key}.enabled=auto")
            elif key == "fp16" and half[key]:  # DeepSpeed's engine scales the loss; offload.GradScaler does here,
                # in the loop (offload finetune and OffloadTrainer hold one), with torch's rule (no hysteresis)
                ignored += [f"fp16.{k}" for k in section]
        elif key == "communication_data_type":  # the dtype gradients are summed over ranks in
            dtype = {"bf16": "bf16", "bfloat16": "bf16", "fp32": "fp32", "float32": "fp32", None: None}.get(value, "?")
            if dtype == "?":
                raise ValueError(f"from_deepspeed: communication_data_type={value!r}; offload reduces in 'bf16' or "
                                 "'fp32' (Config.reduce_dtype)")
            if dtype is not None:
                fields["reduce_dtype"] = dtype
        elif key in _DS_TRAINING_KEYS:
            pass  # validated below and kept as deepspeed_training
        elif key in _DS_TOP_IGNORED:
            ignored.append(key)
        else:
            raise ValueError(f"from_deepspeed: unknown DeepSpeed config key {key!r}")
    stage = zero.pop("stage", 3)
    if stage != 3:
        raise ValueError(f"from_deepspeed: zero_optimization.stage={stage!r}; offload implements stage 3 only")
    nvme_paths: dict[str, str] = {}
    for section, field in (("offload_param", "params"), ("offload_optimizer", "optimizer")):
        sub = zero.pop(section, None)
        if sub is None:
            fields[field] = "device"
            continue
        sub = dict(sub)
        device = sub.pop("device", "none")
        if device not in _DS_TIER:
            raise ValueError(
                f"from_deepspeed: zero_optimization.{section}.device={device!r}; expected none, cpu or nvme"
            )
        fields[field] = _DS_TIER[device]
        if "nvme_path" in sub:
            path = sub.pop("nvme_path")
            if path is not None:
                nvme_paths[section] = str(path)
        for key in list(sub):
            if key in _DS_OFFLOAD_IGNORED:
                ignored.append(f"zero_optimization.{section}.{key}")
            else:
                raise ValueError(f"from_deepspeed: unknown key zero_optimization.{section}.{key}")
    on = [k for k, enabled in half.items() if enabled and enabled != "auto"]
    if len(on) == 2:
        raise ValueError("from_deepspeed: bf16.enabled and fp16.enabled are both true; choose one")
    if on:
        fields["compute_dtype"] = on[0]
    elif "bf16" in half and half["bf16"] != "auto":
        fields["compute_dtype"] = "fp32"
    if len(set(nvme_paths.values())) > 1:
        raise ValueError(
            "from_deepspeed: offload_param.nvme_path and offload_optimizer.nvme_path differ "
            f"({nvme_paths}); offload uses one nvme_path"
        )
    if nvme_paths:
        fields["nvme_path"] = next(iter(nvme_paths.values()))
    if zero.get("stage3_param_persistence_threshold") == "auto":
        ignored.append("zero_optimization.stage3_param_persistence_threshold=auto")
        zero.pop("stage3_param_persistence_threshold")
    if "stage3_param_persistence_threshold" in zero:
        # DeepSpeed counts elements; offload counts bytes of the gathered unit, in the compute dtype the Config ends
        # up with (an override's, or the fine-tune's flag, as well as the file's)
        fields["persist_threshold"] = PersistElements(zero.pop("stage3_param_persistence_threshold"))
    for key in list(zero):
        if key in _DS_ZERO_IGNORED:
            ignored.append(f"zero_optimization.{key}")
        else:
            raise ValueError(f"from_deepspeed: unknown key zero_optimization.{key}")
    training = validate_training(top)
    if training:
        fields["deepspeed_training"] = training
    return fields, ignored
