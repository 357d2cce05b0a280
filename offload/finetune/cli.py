"""`offload finetune`: the command-line face of offload.finetune.finetune (job.py), with a progress bar
and a summary. With no arguments it fine-tunes the built-in small Llama on the Python standard library's
sources, params and optimizer states paged through a temporary swap directory, in a few minutes on a laptop.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import statistics
import sys
from pathlib import Path

from .. import env
from ..store.links import Link
from ..store.sizes import format_bytes
from ..errors import InputError
from .config import FinetuneConfig
from .job import FinetuneResult


def result_json(r: FinetuneResult) -> dict:
    out = dataclasses.asdict(r)
    out["output"] = str(r.output)
    out["merged"] = None if r.merged is None else str(r.merged)
    return out


def _progress_bar(enabled: bool, tokens_per_step: int):
    from tqdm import tqdm

    bar = None

    def update(step, total, loss, last):
        nonlocal bar
        if not enabled:
            return
        if bar is None:  # a resumed run starts part-way
            bar = tqdm(total=total, initial=step - 1, desc="finetune", unit="step", dynamic_ncols=True)
        links = last.get("links", {})
        wall = last.get("wall_s") or 0.0
        rates = {"R": links.get(Link.NVME_TO_CPU.value, {}).get("bytes", 0), "W": links.get(Link.CPU_TO_NVME.value, {}).get("bytes", 0)}
        post = {"loss": f"{loss:.3f}"}
        if wall > 0:
            post["tok/s"] = f"{tokens_per_step / wall:.0f}"
            # MB/s: a slow step's paging (hundreds of MB over tens of seconds) showed as "GB/s=R 0.00 W 0.00"
            post["nvme MB/s"] = f"R {rates['R'] / wall / 1e6:.0f} W {rates['W'] / wall / 1e6:.0f}"
        t = last.get("throughput") or {}
        if t.get("model_tflops"):  # per GPU: 6 x params x tokens / s (rt.stats()); MFU where the peak is known
            post["TFLOPS"] = f"{t['model_tflops']:.3g}" + (f" (MFU {100 * t['mfu']:.0f}%)" if t.get("mfu") is not None
                                                           else "")
        bar.set_postfix(post, refresh=False)
        bar.update(1)
        if step == total:
            bar.close()

    return update


def _phase(text: str) -> None:
    """One line before each phase of the set-up (job.finetune's `phase`), on rank 0."""
    print(f"offload finetune: {text}", flush=True)


class Terminated(KeyboardInterrupt):
    """SIGINT or SIGTERM, raised in the main thread as a KeyboardInterrupt: the same unwinding for both (the
    runtime's block closes, swap files and the run's temporary directory are removed)."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def _stop_on_signals(pending: list):
    """Turn SIGINT and SIGTERM into Terminated for this run (SIGTERM's default action kills at once, leaving the
    swap behind). SIGINT too, even where it was ignored at start: a background job of a non-interactive shell
    (`cmd &`, nohup) starts with SIGINT ignored, Python then leaves it so, and a `kill -INT` did nothing (the
    run trained to its end). The signal is also kept in `pending`: an exception raised where Python swallows it
    (a finalizer or __del__ running at that moment prints "Exception ignored" and goes on) must not let the run
    train to its end either, so the step callback raises it again; and Python's "Exception ignored ... Traceback"
    report of it is not printed (sys.unraisablehook, for this run: the user saw a traceback for a clean stop). The
    previous handlers (with the previous unraisable hook under None), or None off the main thread (where Python
    cannot install one)."""
    def raise_terminated(signum, frame):
        pending[0] = signum
        raise Terminated(signum)

    def quiet_terminated(unraisable):  # raised again at the next step (pending): nothing to report
        if not isinstance(unraisable.exc_value, Terminated):
            previous_hook(unraisable)

    try:
        handlers = {sig: signal.signal(sig, raise_terminated) for sig in _STOP_SIGNALS}
    except ValueError:  # not the main thread
        return None
    previous_hook, sys.unraisablehook = sys.unraisablehook, quiet_terminated
    return {**handlers, None: previous_hook}


def _restore_signals(previous: dict | None) -> None:
    """Undo _stop_on_signals: the handlers and the unraisable hook it replaced."""
    for sig, handler in (previous or {}).items():
        if sig is None:
            sys.unraisablehook = handler
        else:
            signal.signal(sig, handler)


def run_finetune(args: argparse.Namespace) -> int:
    from .job import finetune

    fields = {f.name for f in dataclasses.fields(FinetuneConfig)}
    try:
        cfg = FinetuneConfig(**{k: v for k, v in vars(args).items() if k in fields})
    except ValueError as exc:  # a setting out of range: one line naming it (FinetuneConfig's checks), no traceback
        if env.DEBUG.on():  # OFFLOAD_DEBUG=1: the traceback, as offload/cli.py does
            raise
        print(f"offload finetune: error: {exc}", file=sys.stderr)
        return 2
    rank0 = int(os.environ.get("RANK", "0")) == 0
    if rank0:
        print(f"offload finetune: model {cfg.model or 'built-in Llama (random init)'}, data "
              f"{cfg.data or 'the Python standard library sources'}, output {cfg.output}", flush=True)
    tokens = cfg.micro_batch * cfg.grad_accum * int(os.environ.get("WORLD_SIZE", "1")) * cfg.seq_len
    bar = _progress_bar(rank0, tokens)
    done = [0]  # optimizer steps finished (for the interruption's line)
    pending = [0]  # a stop signal received (its number), raised again at the next step if it was swallowed

    def progress(step, total, loss, last):
        done[0] = step
        bar(step, total, loss, last)
        if pending[0]:
            raise Terminated(pending[0])

    previous = _stop_on_signals(pending)
    try:
        r = finetune(cfg, progress=progress, phase=_phase if rank0 else None)
    except InputError as exc:
        if env.DEBUG.on():  # OFFLOAD_DEBUG=1: the traceback, as offload/cli.py does
            raise
        print(f"offload finetune: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as stop:  # SIGINT, or SIGTERM (timeout, Slurm preemption, docker stop, kill)
        # the runtime's block and the run's temporary directory were left by the exception: swap files are gone
        signum = getattr(stop, "signum", signal.SIGINT)
        ckpts = Path(cfg.checkpoint_dir or Path(cfg.output) / "checkpoints")
        how = (f"resume with --resume {ckpts}" if (ckpts / "latest").exists() else
               "no checkpoint was saved (--checkpoint-every N keeps resumable ones)")
        if rank0:
            print(f"\noffload finetune: interrupted ({signal.Signals(signum).name}) after step {done[0]}; {how}",
                  file=sys.stderr)
        return 128 + signum
    finally:
        _restore_signals(previous)
    if not rank0:
        return 0
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result_json(r), f, indent=2)
    if not r.losses:
        print(f"\nnothing to train: the run was already at step {r.first_step} of {r.first_step}; saved to {r.output}")
        return 0
    timed = r.step_seconds[1:] or r.step_seconds
    step_s = statistics.median(timed)
    trains = (f" ({r.trainable_params / 1e6:.2f}M in LoRA adapters, the rest frozen)"
              if r.trainable_params < r.n_params else "")
    print(f"\n{r.n_params / 1e6:.1f}M parameters{trains}, params on {r.params_tier}, optimizer on {r.optimizer_tier}, "
          f"{r.world_size} rank(s); {len(r.losses)} steps of {r.tokens_per_step} tokens")
    print(f"compute dtype   {r.compute_dtype} ({r.compute_dtype_why})")
    print(f"train loss      {r.losses[0]:.4f} (step {r.first_step + 1}) -> {r.losses[-1]:.4f} "
          f"(step {r.first_step + len(r.losses)})")
    print(f"held-out loss   {r.eval_loss_before:.4f} before -> {r.eval_loss_after:.4f} after")
    print(f"step time       {step_s:.3f} s median ({r.tokens_per_step / step_s:.0f} tokens/s); first step "
          f"{r.step_seconds[0]:.2f} s; set-up {r.load_seconds:.1f} s")
    if r.step_split:
        parts = [f"{k} {v:.3f} s" for k, v in sorted(r.step_split.items(), key=lambda kv: -kv[1]) if v >= 5e-4]
        print("  per step      " + ", ".join(parts))
    if r.model_tflops is not None:
        mfu = (f", MFU {100 * r.mfu:.1f}% of the device's {r.peak_tflops:g} TFLOPS peak bf16" if r.mfu is not None
               else " (MFU: the device's peak is not known)")
        print(f"throughput      {r.model_tflops:.3g} model TFLOPS per rank (6 x params x tokens / s, attention not "
              f"counted){mfu}")
    print(f"peak host RSS   {format_bytes(r.peak_rss_bytes)}"
          + (f"; peak device memory {format_bytes(r.device_peak_bytes)}" if r.device_peak_bytes is not None else ""))
    moved = {k: v for k, v in r.bytes_moved.items() if v and (r.world_size > 1 or k not in ("all-gather", "reduce-scatter"))}
    print("bytes moved" + (" (rank 0)" if r.world_size > 1 else "") + ":  " +
          ", ".join(f"{k} {format_bytes(v)}" for k, v in moved.items()))
    if r.skipped_steps:
        print(f"skipped steps   {r.skipped_steps} (fp16 gradients overflowed; the loss scale was halved each time)")
    if r.ignored_weights:
        print(f"ignored {len(r.ignored_weights)} tensor(s) in the weights that the model does not use: "
              f"{r.ignored_weights[:5]}")
    for c in r.checkpoints[-1:]:
        print(f"checkpoint      {c['path']} ({format_bytes(c['bytes'])} in {c['seconds']:.2f} s; "
              f"{len(r.checkpoints)} saved, resume with --resume)")
    if args.lora_r:
        print(f"saved to        {r.output}  (the adapter: PeftModel.from_pretrained(base, {str(r.output)!r}))")
        if r.merged is not None:
            print(f"merged into     {r.merged}  (AutoModelForCausalLM.from_pretrained / AutoTokenizer.from_pretrained)")
    else:
        print(f"saved to        {r.output}  (AutoModelForCausalLM.from_pretrained / AutoTokenizer.from_pretrained)")
    return 0


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Each flag's default after its help, unless the help says it already or there is none to show
    (None: the help says what is taken instead)."""

    def _get_help_string(self, action):
        text = action.help or ""
        if "default" in text or action.default in (None, False, argparse.SUPPRESS):
            return text
        return super()._get_help_string(action)


def add_finetune_parser(sub, help_line: str) -> None:
    p = sub.add_parser("finetune", help=help_line,
                       description=__doc__, formatter_class=HelpFormatter)
    d = FinetuneConfig()
    p.add_argument("--model", help="Hugging Face model directory (config.json + safetensors); default: the built-in "
                                   "26M-parameter Llama, randomly initialized")
    p.add_argument("--tokenizer", help="tokenizer directory (default: the model's; built-in: a BPE trained on the data)")
    p.add_argument("--data", help="plain text, or JSONL with a \"text\" field or \"prompt\"/\"response\" fields "
                                  "(loss on the response); default: the Python standard library's sources")
    p.add_argument("--output", default=d.output, help="where the fine-tuned model is written (safetensors); held "
                                                      "by this run alone while it lives")
    length = p.add_mutually_exclusive_group()
    length.add_argument("--steps", type=int, help="optimizer steps (default 100, or what --epochs gives)")
    length.add_argument("--epochs", type=float, help="passes over the training data (default: --steps)")
    p.add_argument("--seq-len", type=int, default=d.seq_len, help="tokens per training sequence")
    p.add_argument("--micro-batch", type=int, default=d.micro_batch, help="sequences per forward, per rank")
    p.add_argument("--grad-accum", type=int, default=d.grad_accum,
                   help="micro-batches per optimizer step (the global batch: micro-batch x ranks x this)")
    p.add_argument("--lr", type=float, default=d.lr, help="peak learning rate (linear warmup, then cosine)")
    p.add_argument("--warmup-steps", type=int, help="steps of linear warmup (default: 5%% of the steps)")
    p.add_argument("--min-lr-ratio", type=float, default=d.min_lr_ratio,
                   help="the cosine ends at the peak learning rate times this")
    p.add_argument("--weight-decay", type=float, default=d.weight_decay, help="AdamW's decoupled weight decay")
    p.add_argument("--optim", choices=("adamw", "adamw8bit", "lion"), default=d.optim,
                   help="the optimizer: adamw (fp32 moments, the default), adamw8bit (8-bit block-quantized moments: "
                        "half the optimizer's bytes, lossy) or lion (one fp32 moment; wants a 3-10x smaller --lr)")
    p.add_argument("--max-grad-norm", type=float, default=d.max_grad_norm,
                   help="gradients clipped to this global L2 norm each step (0: no clipping)")
    p.add_argument("--params", choices=("device", "cpu", "nvme", "auto"), help="parameter tier (default nvme)")
    p.add_argument("--optimizer", choices=("device", "cpu", "nvme", "auto"),
                   help="tier of the fp32 master and AdamW moments (default nvme)")
    p.add_argument("--nvme-path", help="swap directory on the drive to page to (default: a temporary directory, "
                                       "removed at the end, as are those of dead runs)")
    p.add_argument("--nvme-budget", help="swap bytes per rank, e.g. 400GiB (default auto: 90%% of the drive's free "
                                         "space, split among this node's ranks)")
    p.add_argument("--cpu-budget", help="host bytes for states per rank, e.g. 8GiB (default: 256MiB for the built-in "
                                        "model, else auto: half the available host memory, split among ranks)")
    p.add_argument("--device-budget", help="accelerator bytes for states, e.g. 60GiB (default auto: 90%% of the "
                                           "GPU's free memory; without a GPU a quarter of the host's, split among "
                                           "ranks)")
    p.add_argument("--compute-dtype", choices=("auto", "fp32", "bf16", "fp16"),
                   help="forward and backward dtype (default auto: bf16 where the device multiplies it fast, a GPU "
                        "with bf16 or a CPU with AVX512_BF16/AMX, else fp32; bf16 on a CPU without those instructions "
                        "is 20-70x slower. fp16, for GPUs without bf16, scales the loss with offload.GradScaler and "
                        "skips a step whose gradients overflow)")
    p.add_argument("--grad-checkpointing", action="store_true", help="the model's own activation checkpointing")
    p.add_argument("--update-in-backward", action="store_true", default=None,
                   help="opt-in: each unit's update under the backward, clipped by the previous step's norm "
                        "coefficient (offload.Config.update_in_backward)")
    p.add_argument("--activations", choices=("none", "cpu", "nvme", "auto"),
                   help="where the tensors the forward saves for the backward wait (with --grad-checkpointing: each "
                        "block's input): on the compute device (none, the default), the cpu tier, the swap "
                        "directory, or the cpu tier while it has room and the swap directory after it (auto; "
                        "offload.Config.activations)")
    p.add_argument("--lora-r", type=int, default=d.lora_r,
                   help="train LoRA adapters of this rank over the frozen base (PEFT), instead of every weight; "
                        "OUTPUT then holds the adapter (PeftModel.from_pretrained(base, OUTPUT) loads it)")
    p.add_argument("--lora-alpha", type=float,
                   help="LoRA's scale numerator, scaling = alpha / r (default 2 x --lora-r)")
    p.add_argument("--lora-targets", default=d.lora_targets,
                   help="comma-separated names of the layers the adapters wrap (Linear, Embedding, Conv1d/2d, transformers' Conv1D: GPT-2's c_attn)")
    p.add_argument("--lora-dropout", type=float, default=d.lora_dropout, help="dropout on the adapters' input")
    p.add_argument("--lora-merge", action="store_true",
                   help="also write the base with the adapters merged into its weights, to OUTPUT/merged")
    p.add_argument("--config", dest="offload_config",
                   help="an offload Config JSON or a DeepSpeed JSON (zero_optimization); flags override it")
    p.add_argument("--save-every", type=int, default=d.save_every,
                   help="also save the model to OUTPUT/checkpoint-STEP every this many steps (0: at the end only)")
    p.add_argument("--max-shard-size", default=d.max_shard_size, help="largest safetensors file written")
    p.add_argument("--checkpoint-every", type=int, default=d.checkpoint_every,
                   help="a resumable checkpoint every this many steps (0: none)")
    p.add_argument("--checkpoint-dir", help="where checkpoints go (default OUTPUT/checkpoints)")
    p.add_argument("--keep-checkpoints", type=int, default=d.keep_checkpoints,
                   help="the newest this many checkpoints are kept, older ones removed (at least 1)")
    p.add_argument("--resume", help="go on from this checkpoint (or the newest in this directory of checkpoints), "
                                    "with the same data and settings; a run keeps its --steps (its learning-rate "
                                    "schedule spans them)")
    p.add_argument("--eval-blocks", type=int, default=d.eval_blocks, help="held-out blocks for the eval loss")
    p.add_argument("--vocab-size", type=int, default=d.vocab_size, help="the built-in tokenizer's vocabulary")
    p.add_argument("--seed", type=int, default=d.seed,
                   help="data order, dropout, and the built-in model's initial weights")
    p.add_argument("--json", help="also write the result (losses, times, bytes) to this JSON file")
    p.set_defaults(func=run_finetune)
