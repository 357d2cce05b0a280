"""Hugging Face Trainer in one line: `OffloadTrainer` is `transformers.Trainer` with the model's states in the
offload runtime (parameters, gradients and AdamW states sharded over ranks, paged to host memory or NVMe).

    from offload.integrations.transformers import OffloadTrainer
    trainer = OffloadTrainer(model=model, args=TrainingArguments(...), train_dataset=ds,
                             offload_config=offload.Config(params="nvme", optimizer="nvme", nvme_path="/mnt/nvme"))
    trainer.train()
    trainer.save_model("out")      # consolidated Hugging Face safetensors (the fp32 master weights)
    trainer.close()                # or `with OffloadTrainer(...) as trainer:`; the runtime's swap files go

Any Trainer subclass the same way: `offload_trainer(SFTTrainer)(model=..., args=SFTConfig(...), ...,
offload_config=...)` (OffloadTrainerMixin before the subclass, bound to its own signature; `model` may be a name).

What differs from Trainer, and why (as transformers' DeepSpeed integration replaces the same pieces):
  - the model is wrapped by an offload runtime: the trainer's own (opened from `offload_config`, closed by
    close()), or the one open around it (`with offload.init(cfg): model = ...; trainer = OffloadTrainer(...)`),
    or, for a second trainer on a model an earlier one sharded (a second stage), that trainer's (still its to close);
  - the optimizer is offload.AdamW over Trainer's two parameter groups (weight decay on the same names),
    with its learning rate, betas and epsilon; the scheduler is Trainer's own. An offload_config made by
    Config.from_deepspeed carries the JSON's training sections, applied as Trainer with DeepSpeed applies them
    (match_deepspeed, integrations/deepspeed.py): "auto" filled from TrainingArguments, every differing value
    refused at once naming both, an optimizer section making the optimizer DeepSpeed's (one group, decay on every
    parameter), a scheduler section DeepSpeed's schedule; one warning says what changed;
  - `max_grad_norm` clips with rt.clip_grad_norm_ (the global norm over every shard and rank);
  - the micro-batches before a step's last run inside rt.accumulating() (each reduces its gradient into the
    gradient shards, which hold the sum: memory one shard per unit, not a full gradient);
  - Accelerate prepares autocast only: the runtime owns placement and gradient reduction (no DDP wrap);
  - bf16=True computes in bf16 (Config.compute_dtype; the fp32 master stays with the optimizer); fp16=True in
    fp16, with offload.GradScaler as Accelerate's scaler (it unscales as the fused update's factor, checks
    overflow on every rank and skips the step; Trainer then leaves the learning rate where it was);
  - activation (gradient) checkpointing is the model's own, as Trainer turns it on (it runs over the runtime);
  - checkpoints (save_steps) hold the runtime's exact checkpoint (fp32 master, moments, scheduler) beside
    Trainer's state, and resume_from_checkpoint restores it: a resumed run's losses are the uninterrupted ones.
Trainer settings this cannot honour are refused at construction with the setting and the fix (REFUSED).
A model loaded with `from_pretrained` inside `offload.init` streams into the store (hf_loading.py).
"""
from __future__ import annotations

import atexit
import contextlib
import dataclasses
import inspect
import os
import threading
import weakref

import torch
from transformers import Trainer, TrainingArguments

from offload.config import Config
from offload.optim import AdamW
from offload.zero.grad_scaler import GradScaler
from offload.zero.runtime import init as init_runtime
from offload.zero.update.loss_scale import GradState
from offload.zero.update.optimizer import ShardedAdamW, ShardedOptimizer
from offload.zero.active import current as current_runtime
from offload.zero.torch_patches import route_compiled_zero_grad

from . import hf_loading  # noqa: F401 - from_pretrained inside a runtime streams into the store
from .deepspeed import build_scheduler, describe_optimizer, describe_scheduler, Matcher, optimizer_settings

OFFLOAD_STATE = "offload-state"  # the runtime's checkpoint inside Trainer's checkpoint-N directory

# TrainingArguments fields whose non-default values this integration cannot honour: (field, why and the fix)
REFUSED = (
    ("deepspeed", "offload replaces DeepSpeed ZeRO; map its JSON with offload.Config.from_deepspeed(path) and pass "
                  "that as offload_config"),
    ("fsdp", "offload shards the model itself; drop fsdp"),
    ("load_best_model_at_end", "the best checkpoint's weights are not reloaded into the runtime yet; export it "
                               "with `offload export CHECKPOINT/offload-state OUT` instead"),
    ("fp16_full_eval", "evaluation would cast the model's buffers for good while its parameters stay as they are"),
    ("bf16_full_eval", "evaluation would cast the model's buffers for good while its parameters stay as they are"),
    ("auto_find_batch_size", "a retry after an out-of-memory error re-enters a step the runtime is in the middle "
                             "of; size the batch with `offload plan` instead"),
    ("parallelism_config", "context/tensor parallel splits are not the runtime's data parallelism"),
    ("enable_jit_checkpoint", "a signal-driven save lands at different points on different ranks, and every save "
                              "is collective here; use save_steps"),
    ("save_on_each_node", "the runtime's checkpoint is written once, by every rank into one directory"),
)
OPTIMIZERS = ("adamw_torch", "adamw_torch_fused")  # what offload.AdamW replaces exactly


def _refuse_unsupported(args: TrainingArguments, offload_config: Config | None, trainer_kwargs: dict,
                        deepspeed_optimizer: bool = False) -> None:
    # the dataclass's defaults, not a second TrainingArguments: building one resets Accelerate's process state
    defaults = {f.name: f.default for f in dataclasses.fields(TrainingArguments)}
    for name, why in REFUSED:
        if not hasattr(args, name):
            continue
        value, default = getattr(args, name), defaults.get(name)
        if value and value != default:
            raise ValueError(f"OffloadTrainer: TrainingArguments.{name}={value!r} is not supported: {why}")
    if (getattr(args, "accelerator_config", None) is not None
            and getattr(args.accelerator_config, "even_batches", True) is False):
        raise ValueError("OffloadTrainer: TrainingArguments.accelerator_config.even_batches=False is not supported: "
                         "every gather is a collective, so every rank must run as many forwards (keep it True)")
    opt, _ = trainer_kwargs.get("optimizers", (None, None)) or (None, None)
    if opt is not None and not isinstance(opt, ShardedAdamW):  # a torch optimizer would step the placeholders
        raise ValueError("OffloadTrainer: optimizers=(optimizer, scheduler) takes an offload.AdamW over the model's "
                         "runtime or None (the trainer then makes one); a scheduler may be given either way")
    if trainer_kwargs.get("optimizer_cls_and_kwargs") is not None:
        raise ValueError("OffloadTrainer: optimizer_cls_and_kwargs is not supported; the optimizer is offload.AdamW")
    optim = str(getattr(args.optim, "value", args.optim))
    if optim not in OPTIMIZERS and not deepspeed_optimizer:  # (a DeepSpeed optimizer section replaces args.optim)
        raise ValueError(f"OffloadTrainer: TrainingArguments.optim={optim!r}; the optimizer is offload.AdamW (the "
                         f"fused CPU AdamW over the sharded states): give optim='adamw_torch' (same update)")
    # TrainingArguments.bf16 / fp16 set the compute dtype; a Config asking for a half dtype (not its fp32 default,
    # nor "auto", which leaves it to them) against them is a contradiction, not a choice to make silently. An
    # explicit bf16 on a CPU that emulates it is kept and warned about (offload/compute_dtype.py)
    if offload_config is not None and offload_config.compute_dtype not in ("fp32", "auto", compute_dtype(args)):
        flag = "bf16" if offload_config.compute_dtype == "bf16" else "fp16"
        raise ValueError(f"OffloadTrainer: TrainingArguments.{flag}=False but offload_config.compute_dtype="
                         f"{offload_config.compute_dtype!r}; set TrainingArguments.{flag}=True (it sets the compute "
                         "dtype)")
    if args.fp16 and offload_config is not None and offload_config.update_in_backward:
        raise ValueError("OffloadTrainer: fp16=True with offload_config.update_in_backward=True: its updates run "
                         "before the loss scaler's overflow check could skip them; drop one of the two")


def match_deepspeed(training: dict | None, args: TrainingArguments, num_training_steps: int | None = None) -> Matcher:
    """A DeepSpeed config's training sections against TrainingArguments, as transformers' HfTrainerDeepSpeedConfig
    (trainer_config_process / _finalize) matches them: "auto" filled, a differing value kept as a mismatch. The
    schedule's step counts are matched once `num_training_steps` is known."""
    m = Matcher(training)
    micro, accum = args.per_device_train_batch_size, args.gradient_accumulation_steps
    m.fill("train_micro_batch_size_per_gpu", micro, "per_device_train_batch_size")
    m.fill("gradient_accumulation_steps", accum, "gradient_accumulation_steps")
    m.fill("train_batch_size", args.world_size * micro * accum,
           "train_batch_size (world size x per_device_train_batch_size x gradient_accumulation_steps)")
    m.fill("gradient_clipping", args.max_grad_norm, "max_grad_norm")
    m.fill("optimizer.params.lr", args.learning_rate, "learning_rate")
    m.fill("optimizer.params.betas", [args.adam_beta1, args.adam_beta2], "[adam_beta1, adam_beta2]")
    m.fill("optimizer.params.eps", args.adam_epsilon, "adam_epsilon")
    m.fill("optimizer.params.weight_decay", args.weight_decay, "weight_decay")
    m.fill("scheduler.params.warmup_min_lr", 0, "", must_match=False)  # not a Trainer setting: the file's, or 0
    m.fill("scheduler.params.warmup_max_lr", args.learning_rate, "learning_rate")
    if num_training_steps is not None:
        m.fill("scheduler.params.total_num_steps", num_training_steps, "the run's steps (max_steps or the epochs')")
        m.fill("scheduler.params.warmup_num_steps", max(1, args.get_warmup_steps(num_training_steps)),
               "warmup_steps")
    return m


def _close_runtime(rt) -> None:
    """A collected (or, at exit, still open) trainer's runtime closed. On a thread other than the main one (a
    collection can run on any, a runtime worker's too, which the close would join) it waits for the exit."""
    if rt.closed:
        return
    if threading.current_thread() is not threading.main_thread():
        atexit.register(_close_runtime, rt)
        return
    rt.__exit__(None, None, None)


def _sharded_by(model):
    """The runtime whose units hold the model's parameters, or None (not sharded yet)."""
    return next((p._offload_runtime for p in model.parameters() if hasattr(p, "_offload_runtime")), None)


def _flat_arguments(sig: inspect.Signature, bound: inspect.BoundArguments) -> dict:
    """A bound call's arguments by name, the ones a **kwargs parameter took included."""
    out = {}
    for key, value in bound.arguments.items():
        if sig.parameters[key].kind is inspect.Parameter.VAR_KEYWORD:
            out.update(value)
        else:
            out[key] = value
    return out


def _set_argument(sig: inspect.Signature, bound: inspect.BoundArguments, name: str, value) -> None:
    if name in sig.parameters:
        bound.arguments[name] = value
    else:
        var_keyword = next(k for k, p in sig.parameters.items() if p.kind is inspect.Parameter.VAR_KEYWORD)
        bound.arguments[var_keyword][name] = value


_LORA_FIX = ("build the PEFT model before the trainer and pass it as the model: offload.integrations.lora."
             "load_peft_model(name_or_dir, peft_config, ...) (loads the base streaming into the runtime), or "
             "peft.get_peft_model(model, peft_config)")


def _refuse_peft_and_quantization(name: str, given: dict, args) -> None:
    """A trainer subclass's own model-building arguments (TRL's) that would act on a wrapped model, refused."""
    if given.get("peft_config") is not None:
        raise ValueError(f"{name}: peft_config is not supported (the trainer would add the adapters to a model "
                         f"the runtime has sharded already); {_LORA_FIX}")
    init_kwargs = getattr(args, "model_init_kwargs", None) or {}
    if given.get("quantization_config") is not None or init_kwargs.get("quantization_config") is not None:
        raise ValueError(f"{name}: quantization_config is not supported: the runtime keeps fp32 master weights "
                         "and pages them to host memory or NVMe instead of quantizing; drop it (bf16=True computes "
                         "in bf16)")
    if isinstance(given.get("model"), str) and init_kwargs.get("device_map") is not None:
        raise ValueError(f"{name}: model_init_kwargs['device_map'] is not supported: the runtime places the "
                         "model; drop it")


def _load_model(name_or_dir: str, args):
    """A model name or directory loaded inside the open runtime (streams into the store, hf_loading.py) with
    `args.model_init_kwargs` where the trainer's arguments have them (TRL's SFTConfig), fp32 unless they say."""
    from transformers import AutoModelForCausalLM

    kwargs = dict(getattr(args, "model_init_kwargs", None) or {})
    kwargs.setdefault("dtype", torch.float32)
    if isinstance(kwargs["dtype"], str) and kwargs["dtype"] != "auto":
        kwargs["dtype"] = getattr(torch, kwargs["dtype"])
    kwargs.setdefault("trust_remote_code", getattr(args, "trust_remote_code", False))
    return AutoModelForCausalLM.from_pretrained(name_or_dir, **kwargs)


def compute_dtype(args: TrainingArguments) -> str:
    """The runtime's Config.compute_dtype for Trainer's flags."""
    return "bf16" if args.bf16 else "fp16" if args.fp16 else "fp32"


class OffloadTrainerMixin:
    """The offload machinery of OffloadTrainer, before any Trainer subclass in the MRO (offload_trainer(cls)
    makes the class). Its __init__ binds the call to the next class's own signature, so `model` and `args` are
    found where that class takes them; the model (or a model name, loaded inside the runtime) is sharded before
    that class's __init__ runs, which then sees a wrapped model."""

    def __init__(self, *trainer_args, offload_config: Config | None = None, **trainer_kwargs):
        name = type(self).__name__
        base_init = super().__init__
        sig = inspect.signature(base_init)
        if "model" not in sig.parameters:  # a subclass passing *args, **kwargs through: Trainer's own
            sig = inspect.signature(Trainer.__init__.__get__(self))
        # the base's own arguments checked before the model is sharded: a refusal then leaves it as it was
        bound = sig.bind(*trainer_args, **trainer_kwargs)
        given = _flat_arguments(sig, bound)
        model, args = given.get("model"), given.get("args")
        if model is None:
            raise ValueError(f"{name}: give the model (model_init is not supported: the runtime shards the "
                             "model once, when the trainer is built)")
        _refuse_peft_and_quantization(name, given, args)
        if args is None:
            args = TrainingArguments(output_dir="trainer_output")
            if "args" in sig.parameters:
                bound.arguments["args"] = args
        outer = current_runtime()
        owner = None if isinstance(model, str) else _sharded_by(model)  # an earlier trainer (a second stage)
        if owner is not None and owner is not outer:
            if owner.closed:
                raise ValueError("OffloadTrainer: the model was sharded by an offload runtime that has closed (an "
                                 "earlier trainer's close() or `with` block, or its offload.init block), and its "
                                 "values went with it. Load the model again (from_pretrained of what that trainer "
                                 "saved), or keep the first trainer open until the second has trained")
            if offload_config is not None and dataclasses.replace(
                    offload_config, compute_dtype=owner.config.compute_dtype) != owner.config:
                raise ValueError("OffloadTrainer: the model is sharded already, by a runtime with another "
                                 "offload.Config (an earlier trainer's); pass that trainer's offload_config, or none")
            outer, offload_config = owner, None  # its runtime trains this stage too (not this trainer's to close)
        if outer is not None and offload_config is not None:
            raise ValueError("OffloadTrainer: an offload runtime is already open; build the trainer inside it without "
                             "offload_config, or outside it with offload_config")
        ds_training = getattr(offload_config if offload_config is not None else getattr(outer, "config", None),
                              "deepspeed_training", None) or {}
        _refuse_unsupported(args, offload_config, given, deepspeed_optimizer="optimizer" in ds_training)
        args.device  # Trainer's distributed set-up first (torchrun: Accelerate's process group), which the runtime joins
        if args.n_gpu > 1:
            raise ValueError("OffloadTrainer: one process driving several GPUs (nn.DataParallel) is not supported; "
                             "launch one process per GPU with torchrun")
        self._ds_training = self._check_deepspeed(ds_training, args, given)
        self._owns_runtime = outer is None
        if outer is None:
            cfg = offload_config or Config()
            cfg = dataclasses.replace(cfg, compute_dtype=compute_dtype(args))
            self.offload_runtime = init_runtime(cfg).__enter__()
            # a trainer never closed still closes its runtime (threads, arena, swap directory) when it is garbage
            # or the process exits: no swap left for the next run to remove as a dead run's
            self._finalizer = weakref.finalize(self, _close_runtime, self.offload_runtime)
        else:
            self.offload_runtime = outer
            if outer.config.compute_dtype != compute_dtype(args):  # its units are cast already
                raise ValueError(f"OffloadTrainer: TrainingArguments.bf16={args.bf16}, fp16={args.fp16} but the open "
                                 f"runtime computes in {outer.config.compute_dtype}; make them agree")
        try:
            if args.device.type != self.offload_runtime.device.type:
                raise ValueError(f"OffloadTrainer: the trainer computes on {args.device} (TrainingArguments.use_cpu="
                                 f"{args.use_cpu}) but the runtime on {self.offload_runtime.device}; make them agree "
                                 "(use_cpu=True only where there is no GPU, or CUDA_VISIBLE_DEVICES='')")
            if isinstance(model, str):  # a name or directory: loaded inside the runtime, streaming into the store
                model = _load_model(model, args)
                _set_argument(sig, bound, "model", model)
            if not any(hasattr(p, "_offload_unit") for p in model.parameters()):
                self.offload_runtime.wrap(model)  # built outside: sharded now (built inside: already its units)
            if self._owns_runtime:  # the trainer's alone: the rest of the process builds and loads as without it
                self.offload_runtime.stop_capturing()
            super().__init__(*bound.args, **bound.kwargs)
        except BaseException:
            self.close()
            raise
        # the runtime owns placement and gradient reduction, as a model sharded at load time does: Accelerate
        # prepares autocast only (no DDP wrap, which would all-reduce placeholders)
        self.is_distributed_loading_by_transformers = True
        if self.args.fp16:  # Accelerate's backward and its optimizer's step go through the scaler it holds
            self.accelerator.scaler = GradScaler(runtime=self.offload_runtime)

    def _check_deepspeed(self, training: dict, args: TrainingArguments, trainer_kwargs: dict) -> dict:
        """The offload Config's DeepSpeed training sections matched against TrainingArguments: every mismatch
        refused at once (the step counts too when max_steps gives them now, else at create_scheduler); what
        they change from Trainer's own optimizer and schedule said in one warning. The filled sections."""
        if not training:
            return {}
        m = match_deepspeed(training, args, args.max_steps if args.max_steps > 0 else None)
        opt, sched = trainer_kwargs.get("optimizers", (None, None)) or (None, None)
        for section, given in (("optimizer", opt), ("scheduler", sched)):
            if section in training and given is not None:
                m.mismatches.append(f"{section} section vs the {section} given in optimizers=(optimizer, scheduler) "
                                    "(drop one)")
        m.raise_mismatches("OffloadTrainer", "TrainingArguments")
        changes = []
        if "optimizer" in m.config:
            changes.append(f"the optimizer is {describe_optimizer(m.config)}, not Trainer's (which spares biases "
                           "and norms from weight decay)")
        if "scheduler" in m.config:
            changes.append(f"the schedule is DeepSpeed's {describe_scheduler(m.config)} (\"auto\" steps filled "
                           f"when training starts), not lr_scheduler_type={str(getattr(args.lr_scheduler_type, 'value', args.lr_scheduler_type))!r}")
        if changes:
            import warnings

            warnings.warn("OffloadTrainer: from the DeepSpeed config, as Hugging Face's Trainer with DeepSpeed: " +
                          "; ".join(changes), UserWarning, stacklevel=3)
        return m.config

    # ---- life ---------------------------------------------------------------------------------
    def close(self) -> None:
        """Close the runtime this trainer opened (its threads, arena and swap files go; the model is unusable
        after). A runtime open around the trainer is its owner's to close."""
        rt = getattr(self, "offload_runtime", None)
        if rt is not None and self._owns_runtime and not rt.closed:
            rt.__exit__(None, None, None)
        if getattr(self, "_finalizer", None) is not None:
            self._finalizer.detach()

    def __enter__(self) -> "OffloadTrainer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- the optimizer and the step -------------------------------------------------------------
    def create_optimizer(self, model=None) -> torch.optim.Optimizer:
        settings = optimizer_settings(self._ds_training)
        if self.optimizer is None and settings is not None:  # DeepSpeed's: one group, every trainable parameter
            opt_model = self.model if model is None else model
            self.optimizer = AdamW([p for p in opt_model.parameters() if p.requires_grad], **settings)
        if self.optimizer is None:
            opt_model = self.model if model is None else model
            decay = set(self.get_decay_parameter_names(opt_model))
            named = [(n, p) for n, p in opt_model.named_parameters() if p.requires_grad]
            groups = [{"params": [p for n, p in named if n in decay], "weight_decay": self.args.weight_decay},
                      {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0}]
            self.optimizer = AdamW([g for g in groups if g["params"]], lr=self.args.learning_rate,
                                           betas=(self.args.adam_beta1, self.args.adam_beta2),
                                           eps=self.args.adam_epsilon)
        return self.optimizer

    def create_scheduler(self, num_training_steps: int, optimizer=None):
        if self.lr_scheduler is None and "scheduler" in self._ds_training:  # DeepSpeed's schedule, its steps filled
            m = match_deepspeed(self._ds_training, self.args, num_training_steps)
            m.raise_mismatches("OffloadTrainer", "TrainingArguments")
            self.lr_scheduler = build_scheduler(optimizer if optimizer is not None else self.optimizer, m.config)
            self._created_lr_scheduler = True
            return self.lr_scheduler
        return super().create_scheduler(num_training_steps, optimizer)

    def _sync_replicated_trainable_parameters(self, model) -> None:
        pass  # every trainable parameter is the runtime's (sharded, reduced by it): nothing replicated to sync

    def training_step(self, model, inputs, num_items_in_batch=None):
        route_compiled_zero_grad(model)  # torch_compile: Trainer's model.zero_grad() is the compiled wrapper's
        last = self.accelerator.sync_gradients  # Trainer sets it per micro-batch: the step's last one
        with contextlib.nullcontext() if last else self.offload_runtime.accumulating():
            return super().training_step(model, inputs, num_items_in_batch)

    def _clip_grad_norm(self, model):
        self._unscale()
        return self.offload_runtime.clip_grad_norm_(self.args.max_grad_norm)

    def _get_grad_norm(self, model, grad_norm=None):
        if grad_norm is None:  # max_grad_norm 0: the norm for the log, nothing clipped
            self._unscale()
            grad_norm = self.offload_runtime.clip_grad_norm_(float("inf"))
        return grad_norm.item() if hasattr(grad_norm, "item") else grad_norm

    def _unscale(self) -> None:
        """fp16: the loss scale out of the gradients before their norm (Accelerate unscales only where torch's
        AMP runs, and not twice)."""
        if self.offload_runtime.loss_scale.state is GradState.SCALED:
            opt = self.optimizer
            while not isinstance(opt, ShardedOptimizer):  # (Accelerate's wrapper around it)
                opt = opt.optimizer
            self.accelerator.scaler.unscale_(opt)

    # ---- saving and resuming ---------------------------------------------------------------------
    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """The model as a Hugging Face directory (config, consolidated safetensors of the fp32 master weights,
        the tokenizer), or for a PEFT model its adapter directory, as Trainer writes it: collective, every rank
        gathers, rank 0 writes."""
        from offload.integrations.hf_model_dir import save_pretrained
        from offload.integrations.lora import is_peft_model, save_adapter

        output_dir = output_dir or self.args.output_dir
        tokenizer = self.processing_class if hasattr(self.processing_class, "save_pretrained") else None
        if is_peft_model(self.model):  # the adapters only, gathering nothing of the frozen base
            save_adapter(self.offload_runtime, self.model, output_dir)
            if tokenizer is not None and self.args.should_save:
                tokenizer.save_pretrained(output_dir)
        else:
            save_pretrained(self.offload_runtime, self.model, output_dir, tokenizer)
        if self.args.should_save:
            torch.save(self.args, os.path.join(output_dir, "training_args.bin"))
        if self.args.push_to_hub and not _internal_call:  # as Trainer.save_model: a user's call pushes the model
            self.push_to_hub(commit_message="Model save", revision=getattr(self.args, "hub_revision", None))

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        self.offload_runtime.save_checkpoint(output_dir, lr_scheduler=self.lr_scheduler, tag=OFFLOAD_STATE)

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        if not os.path.isdir(os.path.join(resume_from_checkpoint, OFFLOAD_STATE)):
            raise ValueError(f"OffloadTrainer: {resume_from_checkpoint} has no {OFFLOAD_STATE}/: not a checkpoint "
                             "of an OffloadTrainer run (the model's weights alone cannot resume its optimizer)")
        # the weights come back with the optimizer's states in _load_optimizer_and_scheduler (one checkpoint)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is not None:
            self.offload_runtime.load_checkpoint(os.path.join(checkpoint, OFFLOAD_STATE),
                                                 lr_scheduler=self.lr_scheduler)



class OffloadTrainer(OffloadTrainerMixin, Trainer):
    """transformers.Trainer over an offload runtime (module docstring). Takes Trainer's arguments plus
    `offload_config`, an offload.Config (None: the runtime open around the trainer, else Config's defaults).
    `model` may be a model name or directory: it is loaded inside the runtime (streaming)."""


_MADE: dict[type, type] = {OffloadTrainer: OffloadTrainer, Trainer: OffloadTrainer}


def offload_trainer(base: type) -> type:
    """OffloadTrainer's machinery over any Trainer subclass (TRL's SFTTrainer, your own): a subclass of `base`
    named Offload<base>, taking `base`'s own arguments plus `offload_config`, and a model name where `base` takes
    one (loaded inside the runtime). `base`'s compute_loss, logging and the rest are its own; the optimizer, the
    clipping, accumulation, saving and resuming are OffloadTrainer's. Made once per class.

        from trl import SFTTrainer
        from offload.integrations.transformers import offload_trainer
        trainer = offload_trainer(SFTTrainer)(model="Qwen/Qwen2.5-0.5B", args=SFTConfig(...), train_dataset=ds,
                                              offload_config=offload.Config(params="cpu", optimizer="cpu"))
    """
    if not (isinstance(base, type) and issubclass(base, Trainer)):
        raise TypeError(f"offload_trainer: {base!r} is not a transformers.Trainer subclass")
    made = _MADE.get(base)
    if made is not None:
        return made
    if issubclass(base, OffloadTrainerMixin):
        return base
    base_sig = inspect.signature(base.__init__)
    params = list(base_sig.parameters.values())
    extra = inspect.Parameter("offload_config", inspect.Parameter.KEYWORD_ONLY, default=None, annotation=Config)
    at = next((i for i, p in enumerate(params) if p.kind is inspect.Parameter.VAR_KEYWORD), len(params))
    if "offload_config" not in base_sig.parameters:
        params.insert(at, extra)

    def __init__(self, *trainer_args, offload_config: Config | None = None, **trainer_kwargs):
        OffloadTrainerMixin.__init__(self, *trainer_args, offload_config=offload_config, **trainer_kwargs)

    __init__.__signature__ = base_sig.replace(parameters=params)
    __init__.__qualname__ = f"Offload{base.__name__}.__init__"
    made = type(f"Offload{base.__name__}", (OffloadTrainerMixin, base), {
        "__init__": __init__, "__module__": __name__, "__qualname__": f"Offload{base.__name__}",
        "__doc__": f"{base.__module__}.{base.__qualname__} over an offload runtime: offload_trainer({base.__name__}) "
                   "(offload.integrations.transformers); its arguments plus offload_config."})
    _MADE[base] = made
    return made
