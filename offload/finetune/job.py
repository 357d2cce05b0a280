"""The fine-tune job behind `offload finetune`, as a function a script or notebook can call:

    from offload.finetune import FinetuneConfig, finetune
    result = finetune(FinetuneConfig(model="path/to/hf-model", data="train.jsonl", steps=500,
                                     output="out", nvme_path="/mnt/nvme/swap"))
    result.eval_loss_after, result.output   # then AutoModelForCausalLM.from_pretrained(result.output)

With no model it builds a small Llama (tens of millions of parameters) from a config and, with no data,
trains it on the Python standard library's sources with a byte-level BPE trained on the spot (corpus.py,
tokenizer.py). The model is built inside `offload.init` (parameters are meta placeholders), so a real
model streams from its safetensors into the store unit by unit (offload/integrations/hf_model_dir.py). The loop is plain
PyTorch: forward, loss, backward per micro-batch, then clip, step, schedule. Launch it with torchrun for
ZeRO-3 over ranks: each rank trains on its slice of every global batch (batches.py).
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from ..config import Config, deepspeed_fields, parse_size
from ..device import is_out_of_memory
from .batches import IGNORE, Sampler, TokenBlocks, build_blocks, split_heldout
from ..integrations.hf_model_dir import HFModelDir, save_pretrained
from ..integrations.lora import base_name, base_weights, merged_params, save_adapter
from . import preflight
from .corpus import STDLIB_CHARS, DataError, read_data_file, stdlib_corpus, stdlib_root
from .config import BUILTIN_VOCAB, DEFAULT_STEPS, OPTIMIZERS, FinetuneConfig
from ..errors import InputError
from .preflight import RUNTIME_FIELDS, as_flags
from ..store.sizes import format_bytes
from ..zero.units.materialize import values_from_weights
from .tokenizer import load_tokenizer, train_bpe

# The built-in model: a Llama of 25.8M parameters, small enough to train for a few hundred steps on 2 cores.
BUILTIN_LLAMA = dict(hidden_size=512, intermediate_size=1376, num_hidden_layers=6, num_attention_heads=8,
                     num_key_value_heads=4, tie_word_embeddings=False)
@dataclasses.dataclass
class FinetuneResult:
    losses: list[float]  # training loss per step run here (mean over the global batch's tokens)
    first_step: int  # the index of losses[0]: 0, or the step a resumed run went on from
    eval_loss_before: float
    eval_loss_after: float
    output: Path
    n_params: int
    tokens_per_step: int
    step_seconds: list[float]
    step_split: dict[str, float]  # mean seconds per step: compute, and the wait on each queue
    load_seconds: float
    peak_rss_bytes: int
    bytes_moved: dict[str, int]  # per link, rank 0
    params_tier: str
    optimizer_tier: str
    world_size: int
    ignored_weights: list[str] = dataclasses.field(default_factory=list)
    trainable_params: int = 0  # all of n_params in a full fine-tune; the adapters' with --lora-r
    merged: Path | None = None  # --lora-merge: the base with the adapters merged
    checkpoints: list[dict] = dataclasses.field(default_factory=list)  # {"path", "bytes", "seconds"} per save
    skipped_steps: int = 0  # --compute-dtype fp16: steps skipped because their gradients overflowed
    compute_dtype: str = "fp32"  # what the run computed in ("auto" resolved)
    compute_dtype_why: str = ""  # why: "as set", or what "auto" measured
    # per rank, medians over the timed steps (rt.stats()["last_step"]["throughput"]; None where not measured)
    model_tflops: float | None = None  # 6 x params x tokens / s (attention not counted)
    mfu: float | None = None  # of the device's peak dense bf16 (None: a CPU or a GPU the table does not know)
    peak_tflops: float | None = None
    device_peak_bytes: int | None = None  # the device allocator's peak (None on a CPU)


def runtime_config(cfg: FinetuneConfig, default_nvme_path: str) -> Config:
    """The runtime's Config: each field from the flag if given, else the --config file if it sets it, else
    the fine-tune's default."""
    defaults = dict(params="nvme", optimizer="nvme", nvme_path=default_nvme_path, device_budget="auto",
                    compute_dtype="auto", cpu_budget="256MiB" if cfg.model is None else "auto",
                    update_in_backward=False, activations="none")  # nvme_budget: the file's, else Config's (auto)
    from_file: dict = {}
    if cfg.offload_config is not None:
        import json

        path = Path(cfg.offload_config)
        try:
            loaded = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise InputError(f"--config {path}: cannot read it as JSON ({exc})") from None
        if not isinstance(loaded, dict):
            raise InputError(f"--config {path}: expected a JSON object (an offload Config or a DeepSpeed config)")
        if "zero_optimization" in loaded:
            try:
                from_file, _ = deepspeed_fields(loaded)
            except ValueError as exc:
                raise InputError(f"--config {path}: {exc}") from None
            world = int(os.environ.get("WORLD_SIZE", "1"))
            steps = cfg.steps
            warmup = cfg.warmup_steps if cfg.warmup_steps is not None else (
                max(1, steps // 20) if steps is not None else None)
            matched = _match_deepspeed(from_file.get("deepspeed_training"), cfg, world, steps, warmup)
            _raise_deepspeed_mismatches(matched, path)
            if matched.config:
                from_file["deepspeed_training"] = matched.config
        else:
            unknown = set(loaded) - {f.name for f in dataclasses.fields(Config)}
            if unknown:
                raise InputError(f"--config {path}: unknown offload.Config fields {sorted(unknown)}; see "
                                 "offload.Config (or give a DeepSpeed JSON with a zero_optimization section)")
            from_file = loaded
    chosen = {name: getattr(cfg, name) if getattr(cfg, name) is not None else from_file.get(name, defaults[name])
              for name in RUNTIME_FIELDS if name in defaults}
    if cfg.nvme_budget is not None:
        chosen["nvme_budget"] = cfg.nvme_budget
    try:
        config = Config(**{"seed": cfg.seed, **from_file, **chosen, "optimizer_states": cfg.optim})
    except (TypeError, ValueError) as exc:
        raise InputError(f"the runtime settings: {as_flags(str(exc))}") from None
    if config.compute_dtype == "fp16" and config.update_in_backward:
        raise InputError("--update-in-backward with --compute-dtype fp16: its updates run before the loss scaler's "
                         "overflow check could skip them; drop one of the two (the default speculative updates are "
                         "taken back when a step overflows)")
    return config


def _match_deepspeed(training: dict | None, cfg: FinetuneConfig, world: int, steps: int | None = None,
                     warmup: int | None = None):
    """A DeepSpeed config's training sections against this run's flags (or their defaults), as Hugging Face's
    Trainer matches them against TrainingArguments (integrations/deepspeed.py): "auto" takes the run's value, an
    explicit one must equal it; every pair that differs is kept. The schedule's step counts once known."""
    import inspect

    from ..integrations.deepspeed import Matcher

    m = Matcher(training)
    m.fill("train_micro_batch_size_per_gpu", cfg.micro_batch, "--micro-batch")
    m.fill("gradient_accumulation_steps", cfg.grad_accum, "--grad-accum")
    m.fill("train_batch_size", cfg.micro_batch * world * cfg.grad_accum, "--micro-batch x ranks x --grad-accum")
    m.fill("gradient_clipping", cfg.max_grad_norm, "--max-grad-norm")
    if "optimizer" in m.config and cfg.optim not in ("adamw", "adamw8bit"):
        m.mismatches.append(f"optimizer.type={m.config['optimizer'].get('type')!r} vs --optim={cfg.optim!r}")
    m.fill("optimizer.params.lr", cfg.lr, "--lr")
    defaults = inspect.signature(getattr(__import__("offload"), OPTIMIZERS[cfg.optim])).parameters
    m.fill("optimizer.params.betas", list(defaults["betas"].default), f"--optim {cfg.optim}'s betas")
    if "eps" in defaults:
        m.fill("optimizer.params.eps", defaults["eps"].default, f"--optim {cfg.optim}'s eps")
    m.fill("optimizer.params.weight_decay", cfg.weight_decay, "--weight-decay")
    m.fill("scheduler.params.warmup_min_lr", 0, "", must_match=False)
    m.fill("scheduler.params.warmup_max_lr", cfg.lr, "--lr")
    if steps is not None:
        m.fill("scheduler.params.total_num_steps", steps, "--steps")
    if warmup is not None:
        m.fill("scheduler.params.warmup_num_steps", warmup, "--warmup-steps")
    return m


def _raise_deepspeed_mismatches(m, path) -> None:
    if m.mismatches:
        raise InputError(f"--config {path}: the DeepSpeed config differs from this run's settings (the flags, or their "
                         "defaults): " + "; ".join(m.mismatches) + ". Give each flag the file's value, or set the "
                         "file's value to \"auto\" (it then takes the flag's)")


def _lora_alpha(cfg: FinetuneConfig) -> float:
    return float(cfg.lora_alpha) if cfg.lora_alpha is not None else 2.0 * cfg.lora_r


def _with_lora(model, cfg: FinetuneConfig):
    """PEFT's LoRA adapters over `model` (placeholders inside the runtime's block), from the --lora-* flags."""
    from peft import LoraConfig, get_peft_model

    targets = [t.strip() for t in cfg.lora_targets.split(",") if t.strip()]
    config = LoraConfig(r=cfg.lora_r, lora_alpha=_lora_alpha(cfg), lora_dropout=cfg.lora_dropout,
                        target_modules=targets, task_type="CAUSAL_LM")
    try:
        return get_peft_model(model, config)
    except ValueError as exc:  # PEFT: "Target modules {...} not found in the base model"
        raise InputError(f"--lora-targets {cfg.lora_targets}: {exc}; the layers of this model LoRA can wrap are "
                         f"{lora_targetable(model)}") from None


def lora_targetable(model) -> list[str]:
    """Each name of a layer kind PEFT's LoRA can wrap, with its kind: Linear, Embedding, Conv1d/2d/3d,
    MultiheadAttention and transformers' Conv1D (GPT-2's c_attn, c_fc, c_proj), e.g. ['c_attn (Conv1D)', ...]."""
    kinds = [torch.nn.Linear, torch.nn.Embedding, torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d,
             torch.nn.MultiheadAttention]
    try:
        from transformers.pytorch_utils import Conv1D

        kinds.append(Conv1D)
    except ImportError:
        pass
    found = {}
    for name, module in model.named_modules():
        if name and isinstance(module, tuple(kinds)):
            found.setdefault(name.rsplit(".", 1)[-1], type(module).__name__)
    return [f"{n} ({k})" for n, k in sorted(found.items())]


def checkpointing_on(model) -> None:
    """A Hugging Face model's activation checkpointing, non-reentrant (the kind the runtime's hooks follow)."""
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    model.config.use_cache = False


def _save(rt, model, cfg: FinetuneConfig, out: Path, tokenizer) -> Path:
    """The fine-tuned model (a full fine-tune) or its adapters (--lora-r), with the tokenizer, into `out`."""
    if not cfg.lora_r:
        return save_pretrained(rt, model, out, tokenizer, parse_size(cfg.max_shard_size, "--max-shard-size"))
    save_adapter(rt, model, out)
    if rt.rank == 0 and tokenizer is not None:
        tokenizer.save_pretrained(str(out))
    return out


BPE_BARS_CHARS = 16_000_000  # the tokenizer's training draws its bars from this much text (tens of seconds)


def _chars(n: int) -> str:
    return f"{n / 1e6:.1f}M characters" if n >= 100_000 else f"{n:,} characters"


def _say(phase, text: str) -> None:
    if phase is not None:
        phase(text)


def _load_examples(cfg: FinetuneConfig, phase=None):
    if cfg.data is None:
        _say(phase, f"reading the Python standard library's sources under {stdlib_root()} (the first "
                    f"{_chars(STDLIB_CHARS)})")
        return stdlib_corpus(show_progress=phase is not None)
    size = Path(cfg.data).stat().st_size if Path(cfg.data).is_file() else 0
    _say(phase, f"reading {cfg.data} ({format_bytes(size)})")
    return read_data_file(cfg.data)


def _count_of(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")


def _files_size(directory: Path, files) -> str:
    return format_bytes(sum((Path(directory) / f).stat().st_size for f in files))


def _loss_sum(model, batch: TokenBlocks, device, router_loss: list | None = None) -> torch.Tensor:
    out = model(input_ids=batch.inputs.to(device))
    if router_loss is not None and getattr(out, "aux_loss", None) is not None:  # an MoE whose config asks for it
        router_loss.append(out.aux_loss * model.config.router_aux_loss_coef)  # (as the model adds it to its loss)
    return F.cross_entropy(out.logits.float().flatten(0, 1), batch.labels.to(device).flatten(), ignore_index=IGNORE,
                           reduction="sum")


def _all_sum(rt, value: torch.Tensor) -> torch.Tensor:
    from ..zero.collectives import comm

    return comm.all_reduce_host_(rt.group, value.detach().float().cpu().clone(), "sum", what="loss sum") \
        if rt.world_size > 1 \
        else value.detach().float().cpu()


# the run's optimization settings, compared at a resume since they were recorded (older checkpoints lack them)
_OPTIMIZATION_KEYS = frozenset({"lr", "weight_decay", "warmup_steps", "min_lr_ratio", "max_grad_norm"})


def _resume(rt, cfg: FinetuneConfig, sched, scaler, run_key: dict) -> int:
    """Load --resume into the run (the loss scaler's state too); the step to go on from. The data order and
    schedule must be the same."""
    from ..checkpoint import CheckpointError

    try:
        extra = rt.load_checkpoint(cfg.resume, lr_scheduler=sched)
    except CheckpointError as exc:
        raise InputError(f"--resume {cfg.resume}: {exc}") from None
    saved = extra.get("run", {})
    differ = [f"{k} {saved.get(k)} -> {v}" for k, v in run_key.items()
              if saved.get(k) != v and (k in saved or k not in _OPTIMIZATION_KEYS)]
    if differ == [f"steps {saved.get('steps')} -> {run_key['steps']}"]:
        train_on = ("resume it to its end and start a new run over the base with the adapters it saved"
                    if cfg.lora_r else f"`offload export {cfg.resume} DIR` and start a new run with --model DIR")
        raise InputError(f"--resume {cfg.resume}: the checkpoint is of a {saved.get('steps')}-step run and this one "
                         f"asks for {run_key['steps']}; a resumed run keeps its length, because the learning rate's "
                         "warmup and cosine decay are laid over --steps (a longer run is another run, whose earlier "
                         f"steps had other rates). To train on: {train_on} (the optimizer's moments start afresh), or "
                         f"resume with --steps {saved.get('steps')}")
    if differ:
        raise InputError(f"--resume {cfg.resume}: the run differs from the checkpoint's ({', '.join(differ)}); resume "
                         "with the same data, --seq-len, --micro-batch x ranks, --grad-accum, --seed, --steps, "
                         "--lr, --weight-decay, --warmup-steps, --min-lr-ratio, --max-grad-norm and --lora-* settings "
                         "(the checkpoint's optimizer and schedule carry the old ones: a change would mix the two)")
    if scaler.is_enabled() and extra.get("scaler"):
        scaler.load_state_dict(extra["scaler"])
    return int(extra["next_step"])


def _hf_files(model, tokenizer, directory: Path) -> None:
    """config.json and the tokenizer beside a checkpoint, so `offload export` gives a loadable directory."""
    model.config.save_pretrained(str(directory))
    tokenizer.save_pretrained(str(directory))


def evaluate(rt, model, blocks: TokenBlocks, micro_batch: int) -> float:
    """Mean loss per label token over `blocks` (each rank takes every world_size-th micro-batch)."""
    total = torch.zeros(())
    was_training = model.training
    model.eval()  # no dropout in the held-out loss
    # the user's RNG stream is untouched: a resumed run draws what an uninterrupted one would
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        starts = list(range(0, len(blocks), micro_batch))
        for k, lo in enumerate(starts):
            if k % rt.world_size != rt.rank:
                continue
            total += _loss_sum(model, blocks.take(torch.arange(lo, min(lo + micro_batch, len(blocks)))),
                               rt.device).cpu()
        # a rank without a batch still joins every gather: the same number of forwards on every rank
        for _ in range(math.ceil(len(starts) / rt.world_size) - len(starts[rt.rank::rt.world_size])):
            model(input_ids=blocks.inputs[:1].to(rt.device))
    model.train(was_training)
    tokens = int((blocks.labels != IGNORE).sum())
    return float(_all_sum(rt, total)) / max(1, tokens)


@dataclasses.dataclass
class _Inputs:
    """Everything a run needs that can be wrong, found before training starts."""

    model_dir: HFModelDir | None
    tokenizer: object
    hf_config: object
    train: TokenBlocks
    heldout: TokenBlocks
    n_params: int
    n_tensors: int
    ignored: list[str]
    trained_params: int  # n_params in a full fine-tune; the adapters' with --lora-r (the rest has no states)


def _inputs(cfg: FinetuneConfig, phase=None) -> _Inputs:
    """The model directory, tokenizer, config and token blocks, each checked (InputError otherwise). phase: told
    what each step does before it starts (with bars where one takes more than a few seconds)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    model_dir = HFModelDir(cfg.model) if cfg.model is not None else None
    examples = _load_examples(cfg, phase)
    chars = sum(len(e.text) + len(e.response or "") for e in examples)
    if cfg.tokenizer is not None:
        tokenizer = load_tokenizer(cfg.tokenizer, "--tokenizer")
    elif model_dir is not None:
        tokenizer = load_tokenizer(model_dir.path, "--model")
    else:
        _say(phase, f"training a byte-level BPE tokenizer (vocabulary {cfg.vocab_size}) on "
                    f"{_count_of(len(examples), 'document')}, {_chars(chars)}" + (": its bars follow" if chars >= BPE_BARS_CHARS else ""))
        tokenizer = train_bpe(examples, cfg.vocab_size, show_progress=phase is not None and chars >= BPE_BARS_CHARS)
    if model_dir is not None:
        hf_config = model_dir.config()
    else:
        hf_config = LlamaConfig(vocab_size=len(tokenizer), max_position_embeddings=max(1024, cfg.seq_len),
                                bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                                pad_token_id=tokenizer.pad_token_id, **BUILTIN_LLAMA)
    limit = getattr(hf_config, "max_position_embeddings", None)
    if limit is not None and cfg.seq_len > limit:
        raise InputError(f"--seq-len {cfg.seq_len} is above the model's maximum ({limit}, max_position_embeddings "
                         f"in {cfg.model}/config.json); give --seq-len {limit} or less")
    if len(tokenizer) > hf_config.vocab_size:
        raise InputError(f"the tokenizer has {len(tokenizer)} tokens but the model's vocab_size is "
                         f"{hf_config.vocab_size}; use the tokenizer the model was trained with")
    _say(phase, f"tokenizing {_count_of(len(examples), 'document')}, {_chars(chars)}, into blocks of "
                f"{cfg.seq_len} tokens")
    blocks = build_blocks(examples, tokenizer, cfg.seq_len, show_progress=phase is not None)
    if len(blocks) < cfg.eval_blocks + 1:
        raise DataError(f"--data {cfg.data or '(stdlib)'}: {len(blocks)} blocks of --seq-len {cfg.seq_len} tokens, "
                        f"too few to hold out --eval-blocks {cfg.eval_blocks} and train on the rest; give more "
                        "text, a shorter --seq-len or fewer --eval-blocks")
    train, heldout = split_heldout(blocks, cfg.eval_blocks)
    with torch.device("meta"):  # the shapes alone: to check the weights and the swap space before any byte moves
        shapes_only = AutoModelForCausalLM.from_config(hf_config)
    ignored = model_dir.check(shapes_only) if model_dir is not None else []
    if cfg.lora_r:  # (the same adapters the run adds, on the shapes: the swap is sized for them)
        shapes_only = _with_lora(shapes_only, cfg)
    n_params = sum(p.numel() for p in shapes_only.parameters())
    n_tensors = sum(1 for _ in shapes_only.parameters())
    trained = sum(p.numel() for p in shapes_only.parameters() if p.requires_grad)
    return _Inputs(model_dir, tokenizer, hf_config, train, heldout, n_params, n_tensors, ignored, trained)


def finetune(cfg: FinetuneConfig, progress=None, on_trained=None, phase=None) -> FinetuneResult:
    """Run the fine-tune (module docstring). `progress(step, total, loss, stats)` is called after each step
    (the CLI draws its progress bar with it); `on_trained(rt, model)` once training ends, while the runtime
    is still open (to inspect or evaluate the model before it is saved and the runtime closes); `phase(text)`
    before each phase of the set-up with one line saying what it does (reading the data, training the tokenizer,
    tokenizing, loading and sharding the weights, the first step's tracing), and with it tqdm bars on stderr
    where a phase takes more than a few seconds (the CLI passes it on rank 0)."""
    with contextlib.ExitStack() as held:  # this run's directories and locks, released last
        return _finetune(cfg, held, progress, on_trained, phase)


@contextlib.contextmanager
def _batch_fits(cfg: FinetuneConfig):
    """Around a micro-batch's forward and backward: running out of memory there is the batch's size, said so."""
    try:
        yield
    except RuntimeError as exc:  # torch.OutOfMemoryError is one; the CPU allocator says "can't allocate memory"
        if not is_out_of_memory(exc):
            raise
        raise InputError(f"--micro-batch {cfg.micro_batch} x --seq-len {cfg.seq_len}: the forward and backward ran out "
                         f"of memory ({str(exc).splitlines()[0]}); lower --micro-batch (a larger --grad-accum keeps "
                         "the batch), add --grad-checkpointing, or lower --seq-len") from None


def _counted(weights, total: int, show: bool):
    """rt.wrap's `weights`, moving a bar of the parameters read (shown after a couple of seconds)."""
    from tqdm import tqdm

    bar = tqdm(total=total, desc="loading", unit="param", unit_scale=True, delay=2, disable=not show,
               dynamic_ncols=True)

    def read(name, meta):
        value = weights(name, meta)
        bar.update(meta.numel())
        if bar.n >= total:
            bar.close()
        return value

    return read, bar


def _finetune(cfg: FinetuneConfig, held: contextlib.ExitStack, progress, on_trained, phase=None) -> FinetuneResult:
    import offload
    from transformers import AutoModelForCausalLM, get_cosine_with_min_lr_schedule_with_warmup

    t_load = time.perf_counter()
    # every location and setting that can be wrong is found before the model loads, let alone trains
    preflight.claim_outputs(cfg, held)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rcfg = runtime_config(cfg, preflight.own_swap_dir(held))
    preflight.check_budgets(rcfg, world)
    inputs = _inputs(cfg, phase)
    model_dir, tokenizer, train, heldout = inputs.model_dir, inputs.tokenizer, inputs.train, inputs.heldout
    n_params = inputs.n_params
    budget_setting = (f"--nvme-budget {cfg.nvme_budget}" if cfg.nvme_budget is not None
                      else f"nvme_budget {rcfg.nvme_budget} (in --config)")
    preflight.check_swap_room(rcfg, n_params, inputs.n_tensors, world, budget_setting,
                              trained_params=inputs.trained_params)
    try:
        with offload.init(rcfg) as rt:
            with values_from_weights() if model_dir is not None else contextlib.nullcontext():  # (nothing kept)
                model = AutoModelForCausalLM.from_config(inputs.hf_config)  # meta placeholders: nothing allocated yet
            if cfg.lora_r:  # on the placeholders, so the adapters are units of their own when the model shards
                model = _with_lora(model, cfg)
            where = f"{_count_of(rt.world_size, 'rank')} (params {rcfg.params}, optimizer {rcfg.optimizer})"
            if model_dir is not None:
                files = sorted({f for f, _ in model_dir.entries.values()})
                _say(phase, f"loading the weights from {model_dir.path} ({_files_size(model_dir.path, files)} in "
                            f"{_count_of(len(files), 'safetensors file')}) and sharding them over {where}")
                weights = base_weights(model_dir, model) if cfg.lora_r else model_dir.weights(model)
                weights, bar = _counted(weights, n_params, phase is not None)
                rt.wrap(model, weights=weights)
                bar.close()
                model_dir.load_buffers(model, rename=base_name if cfg.lora_r else None)
                model_dir.adopt_generation_config(model)  # written out with the model, as the input had it
            else:
                _say(phase, f"initializing the built-in Llama's {n_params / 1e6:.1f}M parameters (random, seed "
                            f"{cfg.seed}) and sharding them over {where}")
                rt.wrap(model)
            if cfg.grad_checkpointing:
                checkpointing_on(model)
            trained = [p for p in model.parameters() if p.requires_grad]
            opt = getattr(offload, OPTIMIZERS[cfg.optim])(trained, lr=cfg.lr, weight_decay=cfg.weight_decay)
            sampler = Sampler(len(train), cfg.micro_batch, cfg.grad_accum, rt.world_size, cfg.seed)
            steps = cfg.steps or (math.ceil(cfg.epochs * len(train) / sampler.global_batch) if cfg.epochs else DEFAULT_STEPS)
            warmup = cfg.warmup_steps if cfg.warmup_steps is not None else max(1, steps // 20)
            ds_training = rcfg.deepspeed_training or {}
            if "scheduler" in ds_training:  # the --config DeepSpeed JSON's schedule, its "auto" steps filled
                from ..integrations.deepspeed import build_scheduler, describe_scheduler

                matched = _match_deepspeed(ds_training, cfg, rt.world_size, steps, warmup)
                _raise_deepspeed_mismatches(matched, cfg.offload_config)
                sched = build_scheduler(opt, matched.config)
            else:
                sched = get_cosine_with_min_lr_schedule_with_warmup(opt, warmup, steps, min_lr_rate=cfg.min_lr_ratio)
            run_key = {"seq_len": cfg.seq_len, "global_micro_batch": cfg.micro_batch * rt.world_size, "optim": cfg.optim,
                       "grad_accum": cfg.grad_accum, "seed": cfg.seed, "steps": steps, "train_blocks": len(train),
                       "lr": cfg.lr, "weight_decay": cfg.weight_decay, "warmup_steps": warmup,
                       "min_lr_ratio": cfg.min_lr_ratio, "max_grad_norm": cfg.max_grad_norm}
            if "scheduler" in ds_training:  # the file's schedule, not the flags' warmup + cosine
                run_key["schedule"] = describe_scheduler(matched.config)
            if cfg.lora_r:  # another adapter is another run (its states would not fit)
                run_key["lora"] = [cfg.lora_r, _lora_alpha(cfg), cfg.lora_targets, cfg.lora_dropout]
            # fp16: loss scaling (a disabled scaler passes every call through to the optimizer)
            scaler = offload.GradScaler(enabled=rt.config.compute_dtype == "fp16")
            start = _resume(rt, cfg, sched, scaler, run_key) if cfg.resume is not None else 0
            ckpt_dir = Path(cfg.checkpoint_dir or Path(cfg.output) / "checkpoints")
            load_s = time.perf_counter() - t_load
            model.train()
            _say(phase, f"the held-out loss before training ({_count_of(len(heldout), 'block')})")
            with _batch_fits(cfg):
                eval_before = evaluate(rt, model, heldout, cfg.micro_batch)
            if start < steps:
                _say(phase, f"step {start + 1} traces the order the units are used in (the plan the prefetch "
                            f"follows) and makes the optimizer states: slower than the steps after it")
            losses, step_s, checkpoints = [], [], []
            split: dict[str, float] = {}
            rates: list[dict] = []  # each timed step's throughput (rt.stats()["last_step"]["throughput"])
            for step in range(start, steps):
                t0 = time.perf_counter()
                tokens = int((train.labels[sampler.step_indices(step)] != IGNORE).sum())
                local = torch.zeros(())
                for micro in range(cfg.grad_accum):
                    batch = train.take(sampler.indices(step, micro, rt.rank))
                    # the reduce averages over ranks: world_size / tokens makes the gradient the global token mean;
                    # every backward but the step's last says so (Config.update_in_backward waits for the last)
                    with _batch_fits(cfg), (rt.accumulating() if micro < cfg.grad_accum - 1 else contextlib.nullcontext()):
                        router = []  # the load-balancing loss, averaged over micro-batches and (by the reduce) ranks
                        loss_sum = _loss_sum(model, batch, rt.device, router)
                        scaler.scale(loss_sum * (rt.world_size / max(1, tokens)) + sum(router) / cfg.grad_accum
                                     ).backward()
                    local += loss_sum.detach().cpu()
                scaler.unscale_(opt)
                if cfg.max_grad_norm > 0:  # 0: no clipping (HF Trainer's and DeepSpeed's meaning)
                    rt.clip_grad_norm_(cfg.max_grad_norm)
                scaler.step(opt)  # (opt.step(), unless fp16 gradients overflowed)
                scaler.update()
                sched.step()
                opt.zero_grad()
                loss = float(_all_sum(rt, local)) / max(1, tokens)
                losses.append(loss)
                step_s.append(time.perf_counter() - t0)
                last = rt.stats()["last_step"] or {}
                if step > start:  # the first step traces and materializes: not representative
                    split["compute"] = split.get("compute", 0.0) + last.get("compute_s", 0.0)
                    for queue, s in last.get("wait_s", {}).items():
                        split[f"wait {queue}"] = split.get(f"wait {queue}", 0.0) + s
                    if (last.get("throughput") or {}).get("model_tflops"):
                        rates.append(last["throughput"])
                if progress is not None:
                    progress(step + 1, steps, loss, last)
                if cfg.save_every and (step + 1) % cfg.save_every == 0 and step + 1 < steps:
                    _save(rt, model, cfg, Path(cfg.output) / f"checkpoint-{step + 1}", tokenizer)
                if cfg.checkpoint_every and (step + 1) % cfg.checkpoint_every == 0:
                    saved = rt.save_checkpoint(ckpt_dir, extra={"next_step": step + 1, "run": run_key,
                                                                "scaler": scaler.state_dict()},
                                               lr_scheduler=sched, keep_last=cfg.keep_checkpoints,
                                               add_files=lambda d: _hf_files(model, tokenizer, d))
                    checkpoints.append({"path": str(saved), "seconds": round(rt.last_checkpoint_seconds, 3),
                                        "bytes": sum(f.stat().st_size for f in saved.iterdir())})
            with _batch_fits(cfg):
                eval_after = evaluate(rt, model, heldout, cfg.micro_batch)
            if on_trained is not None:
                on_trained(rt, model)
            out = _save(rt, model, cfg, Path(cfg.output), tokenizer)
            merged = None
            if cfg.lora_merge:
                merged = save_pretrained(rt, model.get_base_model(), out / "merged", tokenizer,
                                         parse_size(cfg.max_shard_size, "--max-shard-size"),
                                         params=merged_params(rt, model))
            stats = rt.stats()
            world = rt.world_size
    except (MemoryError, OSError, ValueError) as exc:
        if str(exc).startswith("offload.Config."):  # a setting the runtime refused (placement, budgets, nvme_path)
            raise InputError(as_flags(str(exc))) from None
        raise
    n_timed = max(1, len(losses) - 1)
    return FinetuneResult(
        losses=losses, first_step=steps - len(losses), eval_loss_before=eval_before, eval_loss_after=eval_after, output=out, n_params=n_params,
        tokens_per_step=sampler.global_batch * cfg.seq_len, step_seconds=step_s,
        step_split={k: v / n_timed for k, v in split.items()}, load_seconds=load_s,
        peak_rss_bytes=stats["peak_rss_bytes"],
        bytes_moved={"nvme read": stats["nvme_read_bytes"], "nvme written": stats["nvme_written_bytes"],
                     "host->device": stats["host_to_device_bytes"], "device->host": stats["device_to_host_bytes"],
                     "all-gather": stats["allgather_bytes"], "reduce-scatter": stats["reduce_scatter_bytes"]},
        params_tier=stats["params_tier"], optimizer_tier=stats["optimizer_tier"], world_size=world,
        ignored_weights=inputs.ignored, checkpoints=checkpoints, trainable_params=sum(p.numel() for p in trained),
        merged=merged, skipped_steps=stats["loss_scale"]["skipped_steps"],
        compute_dtype=stats["compute_dtype"]["dtype"], compute_dtype_why=stats["compute_dtype"]["why"],
        model_tflops=_median([r["model_tflops"] for r in rates]),
        mfu=_median([r["mfu"] for r in rates if r["mfu"] is not None]),
        peak_tflops=rates[-1]["peak_tflops"] if rates else None,
        device_peak_bytes=(stats["last_step"] or {}).get("device_peak_bytes"))


def _median(values: list) -> float | None:
    return statistics.median(values) if values else None
