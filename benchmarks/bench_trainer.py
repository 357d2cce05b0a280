"""The same Hugging Face Trainer job three ways, side by side (issue 24, "HF Trainer in one line"):

  trainer    transformers.Trainer, the model in memory (use_cpu where there is no GPU).
  deepspeed  transformers.Trainer + DeepSpeed ZeRO-3, offload_param and offload_optimizer on nvme, given as
             TrainingArguments(deepspeed=<dict>): bench_offload_step's nvme config (aio block 1 MiB, queue depth
             32, buffer_count 32, buffer_size = the largest parameter) with fp32 (bf16 off unless --bf16), and
             Hugging Face's "auto" values for the batch, the clipping and DeepSpeed's AdamW (DeepSpeedCPUAdam);
             no "scheduler" section, so Trainer's own linear warmup schedule drives it. TrainingArguments is
             built before from_pretrained, so the weights load inside zero.Init (partitioned, swapped to nvme
             as they load), the way a Trainer user's script does it. --ds-offload cpu: both offloads to cpu.
  offload    offload.integrations.transformers.OffloadTrainer, the model streamed from its safetensors into the
             store: `with offload.init(cfg): model = AutoModelForCausalLM.from_pretrained(DIR)`, the trainer
             built inside that block (no offload_config: the open runtime is the trainer's), with
             cfg = offload.Config(params="nvme", optimizer="nvme", cpu_budget=--cpu-budget,
             device_budget=--device-budget).
  offload-wrap (opt-in, --contenders ...,offload-wrap) OffloadTrainer(model, offload_config=cfg) over the model
             loaded in memory by a plain from_pretrained (the trainer opens, wraps and closes its runtime).
  deepspeed-maxcpu0 (opt-in) deepspeed with offload_param.max_in_cpu 0. DeepSpeed's default (1e9 elements) keeps
             the trainable parameters' partitions "permanently" in host memory under offload_param nvme
             (stage3.py, _create_param_groups_fp16_flat_cpu_memory / _move_to_flat_buffer), so below 1e9
             trainable parameters the default contender's params are not on nvme at all; this one's are. It also
             sets stage3_max_reuse_distance 0 and stage3_max_live_parameters 0: with max_in_cpu 0 alone its first
             step fails in the forward, "AssertionError: Not enough buffers 0 for swapping 1" (32 swap buffers).

Model: a transformers LlamaForCausalLM from a config (nothing downloaded): default vocab 32000, hidden 768,
8 layers, 12 heads (12 kv heads), intermediate 2048, untied head (105.8M parameters), built once from
torch.manual_seed(seed) in a child and saved with save_pretrained (safetensors) to a temporary directory;
every contender loads that directory, so all start from the same weights.
Data: --steps x --batch blocks of --seq random tokens from a seeded generator (labels = inputs), identical for
every contender; Trainer's sampler shuffles them with args.seed (the same order everywhere).
Training: fp32 (--bf16: bf16 for all; on a CPU-only machine the deepspeed contender then stops in TrainingArguments,
"ValueError: Your setup doesn't support bf16/gpu. You need to assign use_cpu if you want to train the model on CPU":
it needs use_cpu=False to take Trainer's DeepSpeed path, and use_cpu=True skips that path), lr 1e-4, linear schedule with --lr-warmup warmup steps,
max_grad_norm 1.0, weight_decay 0 (DeepSpeed's optimizer from the config sees no weight-decay groups, so decay
would not be the same job), gradient_accumulation_steps 1, dataloader_num_workers 0, 2 threads.

Measured in each child (its own process, bench_offload_step's spawn; contenders in interleaved rounds):
  losses      every step's loss as training_step returns it (before clipping/the update), full precision;
              the parent reports the first, the last and max |loss - trainer's loss| over all steps;
  s/step      the wall time between consecutive on_step_end callbacks (data, forward, backward, clip,
              optimizer, scheduler, logging: the whole step), median over the steps after the first --warmup;
              also train() wall / steps;
  peak RSS    VmHWM of the loading phase (process start through from_pretrained and the trainer's
              construction; for offload-wrap that includes the wrap), then VmHWM is reset (/proc/self/clear_refs
              5) and read again after train(): the training phase's peak (DeepSpeed's deepspeed.initialize runs
              inside train(), so it is in the training phase);
  nvme bytes  offload: rt.stats() nvme read/written over the steps after --warmup (stats at that step's end,
              and after train() + rt.quiesce()), per step; every contender: /proc/self/io read_bytes /
              write_bytes per step over the same steps (DeepSpeed's swap traffic; an independent check).

Reproduce (from the repository root; DeepSpeed's cpu_adam and async_io ops JIT-build on first use, minutes, in
the first deepspeed child: outside the timed steps, inside that child's train phase wall):
    python benchmarks/bench_trainer.py --steps 200 --json bench_trainer.json
    # smoke: a tiny model, a few steps
    python benchmarks/bench_trainer.py --layers 2 --hidden 128 --ff 256 --heads 4 --vocab 1000 --steps 6 --warmup 2
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_offload_step as bso  # noqa: E402  (spawn, interleaved rounds, peak RSS, DeepSpeed's nvme config)

CONTENDERS = ("trainer", "deepspeed", "offload")
OPT_IN = ("offload-wrap", "deepspeed-maxcpu0")
SCRIPT = os.path.abspath(__file__)
DIST_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@dataclasses.dataclass
class TrainerSettings(bso.Settings):
    vocab: int = 32000
    dim: int = 768
    layers: int = 8
    heads: int = 12
    kv_heads: int = 12
    ff: int = 2048
    seq: int = 256
    batch: int = 1
    steps: int = 200
    warmup: int = 5           # steps left out of the median s/step and the per-step bytes
    lr: float = 1e-4
    weight_decay: float = 0.0
    lr_warmup: int = 20       # Trainer's warmup_steps (linear schedule)
    bf16: bool = False
    model_dir: str = ""
    cpu_budget: str = "256MiB"
    device_budget: str = "512MiB"
    ds_offload: str = "nvme"  # "nvme" or "cpu" (DeepSpeed's fallback)
    ds_buffer_count: int = 32
    ds_zero_extra: str = ""   # JSON merged into every deepspeed contender's zero_optimization


# ---- helpers (children) ------------------------------------------------------------------------------

def llama_config(s: TrainerSettings):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=s.vocab, hidden_size=s.dim, intermediate_size=s.ff, num_hidden_layers=s.layers,
                       num_attention_heads=s.heads, num_key_value_heads=s.kv_heads,
                       max_position_embeddings=max(512, s.seq), tie_word_embeddings=False)


def build(s: TrainerSettings) -> dict:
    """Builds the model from its config (seeded) and saves it as safetensors in s.model_dir."""
    import torch
    from transformers import LlamaForCausalLM

    torch.manual_seed(s.seed)
    t0 = time.perf_counter()
    model = LlamaForCausalLM(llama_config(s))
    n_params = sum(p.numel() for p in model.parameters())
    model.save_pretrained(s.model_dir, safe_serialization=True)
    files = sorted(os.listdir(s.model_dir))
    size = sum(os.path.getsize(os.path.join(s.model_dir, f)) for f in files)
    return {"n_params": n_params, "files": files, "bytes": size, "build_s": time.perf_counter() - t0,
            "peak_rss_bytes": bso.peak_rss_bytes()}


def dataset(s: TrainerSettings):
    import torch

    class Blocks(torch.utils.data.Dataset):
        """steps x batch blocks of seq tokens from a seeded generator; labels = inputs (the model shifts them)."""

        def __init__(self):
            g = torch.Generator().manual_seed(s.seed + 1)
            self.ids = torch.randint(0, s.vocab, (s.steps * s.batch, s.seq), generator=g)

        def __len__(self):
            return len(self.ids)

        def __getitem__(self, i):
            return {"input_ids": self.ids[i], "labels": self.ids[i]}

    return Blocks()


def training_args(s: TrainerSettings, out: str, **extra):
    import torch
    from transformers import TrainingArguments

    return TrainingArguments(output_dir=out, max_steps=s.steps, per_device_train_batch_size=s.batch,
                             gradient_accumulation_steps=1, learning_rate=s.lr, weight_decay=s.weight_decay,
                             max_grad_norm=s.clip, lr_scheduler_type="linear", warmup_steps=s.lr_warmup,
                             bf16=s.bf16, logging_steps=max(1, s.steps // 10), save_strategy="no", report_to=[],
                             seed=s.seed, dataloader_num_workers=0, disable_tqdm=True,
                             **({"use_cpu": not torch.cuda.is_available()} | extra))


def recording(base):
    """`base` (a Trainer class) recording every step's loss as training_step returns it."""

    class Recording(base):
        bench_losses: list

        def training_step(self, model, inputs, num_items_in_batch=None):
            loss = super().training_step(model, inputs, num_items_in_batch)
            self.bench_losses.append(float(loss))
            return loss

    Recording.__name__ = f"Recording{base.__name__}"
    return Recording


def step_clock(warmup: int, at_warmup=None):
    """A TrainerCallback: the time of train begin and of every step's end; at_warmup() at the end of step
    `warmup` (the start of the measured window)."""
    from transformers import TrainerCallback

    class StepClock(TrainerCallback):
        def __init__(self):
            self.marks, self.at_window = [], None

        def on_train_begin(self, args, state, control, **kw):
            self.marks = [time.perf_counter()]

        def on_step_end(self, args, state, control, **kw):
            self.marks.append(time.perf_counter())
            if state.global_step == warmup:
                self.at_window = {"io": bso.proc_io(), "offload": at_warmup() if at_warmup else None}

    return StepClock()


def run_contender(name: str, s: TrainerSettings) -> dict:
    if not name.startswith("deepspeed"):  # spawn sets a one-rank torchrun environment for DeepSpeed: plain Trainer needs none
        for key in DIST_ENV:
            os.environ.pop(key, None)
    import torch

    torch.set_num_threads(s.threads)
    from transformers import AutoModelForCausalLM, Trainer

    out = os.path.join(s.nvme_dir, "trainer-out")
    ds = dataset(s)
    result: dict = {"load_average_start": os.getloadavg()}
    t_load = time.perf_counter()
    rt = None
    ctx = None
    if name == "trainer":
        args = training_args(s, out)
        model = AutoModelForCausalLM.from_pretrained(s.model_dir)
        cls = recording(Trainer)
    elif name.startswith("deepspeed"):
        ds_cfg = ds_trainer_config(s)
        if name == "deepspeed-maxcpu0" and s.ds_offload == "nvme":
            ds_cfg["zero_optimization"]["offload_param"]["max_in_cpu"] = 0
            # without these its first step runs out of swap buffers ("Not enough buffers 0 for swapping 1")
            ds_cfg["zero_optimization"].update(stage3_max_reuse_distance=0, stage3_max_live_parameters=0)
        if s.ds_zero_extra:
            ds_cfg["zero_optimization"].update(json.loads(s.ds_zero_extra))
        args = training_args(s, out, use_cpu=False, ddp_backend="gloo", deepspeed=ds_cfg)
        model = AutoModelForCausalLM.from_pretrained(s.model_dir)  # inside zero.Init: TrainingArguments set it up
        cls = recording(Trainer)
    else:
        import offload
        from offload.integrations.transformers import OffloadTrainer

        cfg = offload.Config(params="nvme", optimizer="nvme", nvme_path=s.nvme_dir,
                             cpu_budget=s.cpu_budget, device_budget=s.device_budget, seed=s.seed,
                             compute_dtype="bf16" if s.bf16 else "fp32")
        result["offload_config"] = {k: str(v) for k, v in dataclasses.asdict(cfg).items()}
        args = training_args(s, out)
        cls = recording(OffloadTrainer)
        if name == "offload":
            ctx = offload.init(cfg)
            rt = ctx.__enter__()
            model = AutoModelForCausalLM.from_pretrained(s.model_dir)  # streamed into the store unit by unit
        else:  # offload-wrap: in memory first, the trainer wraps it
            model = AutoModelForCausalLM.from_pretrained(s.model_dir)
    n_params = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())
    at_warmup = (lambda: dict(trainer.offload_runtime.stats())) if name.startswith("offload") else None
    clock = step_clock(s.warmup, at_warmup)
    kwargs = {} if name != "offload-wrap" else {"offload_config": cfg}
    trainer = cls(model=model, args=args, train_dataset=ds, callbacks=[clock], **kwargs)
    trainer.bench_losses = []
    if name.startswith("offload"):
        rt = trainer.offload_runtime
    load_s = time.perf_counter() - t_load
    result.update(load_s=load_s, peak_rss_load_bytes=bso.peak_rss_bytes(), rss_after_load_bytes=bso.rss_bytes())
    result["peak_rss_reset"] = bso.reset_peak_rss()
    try:
        t0 = time.perf_counter()
        metrics = trainer.train().metrics
        train_s = time.perf_counter() - t0
        io_end = bso.proc_io()
        stats = None
        if rt is not None:
            rt.quiesce()
            stats = dict(rt.stats())
        result.update(peak_rss_train_bytes=bso.peak_rss_bytes(), train_s=train_s,
                      train_runtime=metrics.get("train_runtime"))
    finally:
        if name == "offload-wrap":
            trainer.close()
        elif ctx is not None:
            ctx.__exit__(None, None, None)
    step_s = [b - a for a, b in zip(clock.marks, clock.marks[1:])]
    window = max(1, len(step_s) - s.warmup)
    result.update(contender=name, n_params=n_params, losses=trainer.bench_losses, step_s=step_s,
                  median_step_s=statistics.median(step_s[s.warmup:] or step_s), s_per_step=train_s / s.steps,
                  load_average_end=os.getloadavg(), trainer_class=type(trainer).__mro__[1].__name__)
    if clock.at_window is not None:
        io0 = clock.at_window["io"]
        result["proc_io_per_step"] = {k: (io_end[k] - io0[k]) / window for k in io0}
        if stats is not None and clock.at_window["offload"] is not None:
            s0 = clock.at_window["offload"]
            result["nvme_read_bytes_per_step"] = (stats["nvme_read_bytes"] - s0["nvme_read_bytes"]) / window
            result["nvme_written_bytes_per_step"] = (stats["nvme_written_bytes"] - s0["nvme_written_bytes"]) / window
    if stats is not None:
        result["nvme_read_bytes_total"] = stats["nvme_read_bytes"]
        result["nvme_written_bytes_total"] = stats["nvme_written_bytes"]
        result["rt_units"] = len(rt.units)
        result["rt_stats"] = stats  # cumulative counters, the last step's split, memory outside the budgets
    if name.startswith("deepspeed"):
        result["ds_config"] = args.deepspeed if isinstance(args.deepspeed, dict) else None
    return result


def ds_trainer_config(s: TrainerSettings) -> dict:
    """bench_offload_step's ZeRO-3 nvme config with Hugging Face's "auto" values for what Trainer sets, fp32 (or
    bf16), no scheduler section (Trainer's schedule), DeepSpeed's AdamW (the CPU Adam under offload)."""
    cfg = bso.deepspeed_config(s, largest=s.vocab * s.dim)
    cfg["zero_optimization"]["offload_param"]["buffer_count"] = s.ds_buffer_count
    cfg.update({"train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto",
                "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
                "bf16": {"enabled": "auto"},
                "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                                          "weight_decay": "auto"}}})
    if s.ds_offload == "cpu":
        zo = cfg["zero_optimization"]
        zo["offload_param"] = {"device": "cpu", "pin_memory": False}
        zo["offload_optimizer"] = {"device": "cpu", "pin_memory": False}
        cfg.pop("aio", None)
    return cfg


CHILDREN = {"build": build, **{n: (lambda n: lambda s: run_contender(n, s))(n) for n in CONTENDERS + OPT_IN}}


def child_main(name: str, settings_json: str) -> None:
    s = TrainerSettings(**json.loads(settings_json))
    result = CHILDREN[name](s)
    result["contender"] = name
    bso.emit(result)


def spawn(name: str, s: TrainerSettings) -> dict:
    return bso.spawn(name, s, script=SCRIPT, distributed=())


# ---- parent ----------------------------------------------------------------------------------------------

def mib(n) -> str:
    return "-" if n is None else f"{n / 2**20:,.0f} MiB"


def summarize(runs: dict, ref_name: str = "trainer") -> dict:
    rows = {}
    ref = next((r for r in runs.get(ref_name, []) if "error" not in r), None)
    for name, rs in runs.items():
        ok = [r for r in rs if "error" not in r]
        if not ok:
            rows[name] = {"error": rs[-1].get("error") if rs else "not run",
                          "output_tail": rs[-1].get("output_tail") if rs else None}
            continue
        r = ok[-1]
        row = {"rounds": len(ok), "n_params": r["n_params"],
               "median_step_s": statistics.median(x["median_step_s"] for x in ok),
               "train_s_per_step": statistics.median(x["s_per_step"] for x in ok),
               "peak_rss_load_bytes": max(x["peak_rss_load_bytes"] for x in ok),
               "peak_rss_train_bytes": max(x["peak_rss_train_bytes"] for x in ok),
               "load_s": statistics.median(x["load_s"] for x in ok),
               "first_loss": r["losses"][0], "last_loss": r["losses"][-1], "steps": len(r["losses"]),
               "nvme_read_bytes_per_step": r.get("nvme_read_bytes_per_step"),
               "nvme_written_bytes_per_step": r.get("nvme_written_bytes_per_step"),
               "disk_read_bytes_per_step": r.get("proc_io_per_step", {}).get("read_bytes"),
               "disk_write_bytes_per_step": r.get("proc_io_per_step", {}).get("write_bytes"),
               "load_average": [r["load_average_start"], r["load_average_end"]]}
        if ref is not None:
            n = min(len(ref["losses"]), len(r["losses"]))
            diffs = [abs(a - b) for a, b in zip(ref["losses"][:n], r["losses"][:n])]
            row["max_abs_loss_diff"] = max(diffs) if diffs else None
            row["max_abs_loss_diff_step"] = diffs.index(max(diffs)) + 1 if diffs else None
            row["first_step_loss_diff"] = diffs[0] if diffs else None
        rows[name] = row
    return rows


def print_report(rows: dict, s: TrainerSettings, build_info: dict, rounds: int) -> None:
    n = build_info.get("n_params")
    print(f"\n# LlamaForCausalLM {n / 1e6:.1f}M params ({s.layers} layers, hidden {s.dim}, ff {s.ff}, heads "
          f"{s.heads}/{s.kv_heads} kv, vocab {s.vocab}), batch {s.batch} x seq {s.seq}, "
          f"{'bf16' if s.bf16 else 'fp32'}, {s.steps} steps, lr {s.lr} linear warmup {s.lr_warmup}, max_grad_norm "
          f"{s.clip}; {s.threads} threads/process; {rounds} round(s)")
    print(f"# offload: params+optimizer nvme, cpu_budget {s.cpu_budget}, device_budget {s.device_budget}; "
          f"deepspeed: ZeRO-3 offload_param+offload_optimizer {s.ds_offload}")
    print(f"# median s/step over steps {s.warmup + 1}..{s.steps}; loss diff = max over all steps of |loss - "
          f"trainer's loss|")
    print("| contender | median s/step | train wall s/step | vs trainer | first loss | last loss | max abs loss diff "
          "(step) | peak RSS load | peak RSS train | nvme R/step | nvme W/step | disk R/step | disk W/step |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    ref = rows.get("trainer", {}).get("median_step_s")
    for name, row in rows.items():
        if "error" in row:
            print(f"| {name} | failed: {row['error']} | | | | | | | | | | | |")
            continue
        vs = f"{row['median_step_s'] / ref:.2f}x" if ref else "-"
        diff = row.get("max_abs_loss_diff")
        diff_s = "-" if diff is None else f"{diff:.2e} ({row['max_abs_loss_diff_step']})"
        print(f"| {name} | {row['median_step_s']:.3f} | {row['train_s_per_step']:.3f} | {vs} | {row['first_loss']:.5f} "
              f"| {row['last_loss']:.5f} | {diff_s} | {mib(row['peak_rss_load_bytes'])} | "
              f"{mib(row['peak_rss_train_bytes'])} | {mib(row['nvme_read_bytes_per_step'])} | "
              f"{mib(row['nvme_written_bytes_per_step'])} | {mib(row['disk_read_bytes_per_step'])} | "
              f"{mib(row['disk_write_bytes_per_step'])} |")
    for name, row in rows.items():
        if "error" not in row:
            print(f"# {name}: load {row['load_s']:.1f} s; load average at start/end "
                  f"{[round(x, 2) for x in row['load_average'][0]]} / {[round(x, 2) for x in row['load_average'][1]]}")
        else:
            print(f"# {name} failed: {row['error']}; last lines:\n#   " + "\n#   ".join(row.get("output_tail") or []))


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contenders", default=",".join(CONTENDERS), help=f"of {CONTENDERS + OPT_IN}")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=5, help="first steps left out of the median and per-step bytes")
    ap.add_argument("--lr-warmup", type=int, default=20, help="Trainer's warmup_steps")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--ff", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--kv-heads", type=int, default=None, help="default: --heads")
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--bf16", action="store_true", help="bf16 for all three (default fp32)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cpu-budget", default="256MiB")
    ap.add_argument("--device-budget", default="512MiB")
    ap.add_argument("--ds-offload", default="nvme", choices=("nvme", "cpu"))
    ap.add_argument("--ds-buffer-count", type=int, default=32)
    ap.add_argument("--ds-zero-extra", default="", help="JSON merged into the deepspeed contenders' zero_optimization, "
                    "e.g. '{\"stage3_max_reuse_distance\": 0, \"stage3_max_live_parameters\": 0}'")
    ap.add_argument("--nvme-path", default=None, help="work/swap directory (default: a temp dir under /tmp, removed)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--settings", default=None, help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.child:
        child_main(args.child, args.settings)
        return 0
    contenders = [c.strip() for c in args.contenders.split(",") if c.strip()]
    unknown = [c for c in contenders if c not in CONTENDERS + OPT_IN]
    if unknown:
        raise SystemExit(f"unknown contender(s) {unknown}; choose from {CONTENDERS + OPT_IN}")
    owned = args.nvme_path is None
    root = tempfile.mkdtemp(prefix="bench-trainer-") if owned else args.nvme_path
    os.makedirs(root, exist_ok=True)
    base = TrainerSettings(vocab=args.vocab, dim=args.hidden, layers=args.layers, heads=args.heads,
                           kv_heads=args.kv_heads or args.heads, ff=args.ff, seq=args.seq, batch=args.batch,
                           steps=args.steps, warmup=args.warmup, lr_warmup=args.lr_warmup, bf16=args.bf16,
                           threads=args.threads, seed=args.seed, cpu_budget=args.cpu_budget,
                           device_budget=args.device_budget, ds_offload=args.ds_offload,
                           ds_buffer_count=args.ds_buffer_count, ds_zero_extra=args.ds_zero_extra, model_dir=os.path.join(root, "model"))
    info = bso.machine_info()
    started = time.time()
    try:
        print(f"# building the model into {base.model_dir} ...", flush=True)
        build_info = spawn("build", dataclasses.replace(base, nvme_dir=os.path.join(root, "build")))
        if "error" in build_info:
            raise SystemExit("building the model failed:\n" + "\n".join(build_info["output_tail"]))
        print(f"# {build_info['n_params'] / 1e6:.1f}M params, {build_info['bytes'] / 2**20:.0f} MiB of "
              f"{build_info['files']}", flush=True)

        def settings_for(name: str, r: int) -> TrainerSettings:
            return dataclasses.replace(base, nvme_dir=os.path.join(root, f"{name}-r{r}"))

        runs = bso.interleaved_rounds(contenders, args.rounds, settings_for, run_child=spawn)
    finally:
        if owned:
            shutil.rmtree(root, ignore_errors=True)
    rows = summarize(runs)
    print_report(rows, base, build_info, args.rounds)
    if args.json:
        doc = {"command": [sys.executable] + sys.argv, "settings": dataclasses.asdict(base), "machine": info,
               "load_average_end": os.getloadavg(), "started": started, "wall_s": time.time() - started,
               "build": build_info, "deepspeed_config": ds_trainer_config(base), "runs": runs, "table": rows}
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1, default=str)
        print(f"# wrote {args.json}")
    return 1 if any("error" in row for row in rows.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
