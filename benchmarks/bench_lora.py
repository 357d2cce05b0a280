"""LoRA over an offloaded frozen base: nvme bytes written and read per step, with the adapters as units of their own
(trainable islands, the default) or folded into their frozen blocks (--no-islands: what the runtime did before:
gradients, optimizer states and write-backs for the whole block).

    PYTHONPATH=. python benchmarks/bench_lora.py [--no-islands]

A transformers Llama (4 layers, d 256, vocab 2000) with PEFT LoRA r=8 on q_proj and v_proj, params and optimizer
on nvme, a 12 MiB cpu budget (the states do not fit: they page); 3 steps, the last one's bytes printed.

--base: the same question at the size LoRA is for, side by side (each contender in its own process, bench_offload_step's
spawn and interleaved rounds):

    PYTHONPATH=. python benchmarks/bench_lora.py --base [--deepspeed] [--memory] [--json lora_base.json]

A transformers Llama built from a config (nothing downloaded; default the TinyLlama-1.1B shape: hidden 2048, 22
layers, 32 heads / 4 kv heads, intermediate 5632, vocab 32000, untied head: 1.10B parameters, 4.1 GiB in fp32), built
once from torch.manual_seed(seed) in a child, saved as safetensors (--model-dir keeps it for the next run; default a
temporary directory, removed) and freed; PEFT LoRA r=16, alpha 32 on q_proj and v_proj (PEFT's default init, adapters
seeded with seed + 7), fp32, AdamW lr 1e-4 on the adapters, clip 1.0, batch 1 x seq 128 of seeded random tokens
(another block each step, the same for every contender), --steps 5 of which the first --warmup 1 is left out of the
medians. Contenders:
  offload    from_pretrained in memory, get_peft_model, then offload.init(Config(params="nvme", optimizer="nvme",
             cpu_budget=--cpu-budget 512MiB, device_budget=--device-budget 1GiB)) and rt.wrap(model): the README's
             LoRA recipe; offload.AdamW, rt.clip_grad_norm_; every step ends with rt.quiesce() inside its time.
  offload-stream  the same, but the base never whole in memory: inside offload.init,
             offload.integrations.lora.load_peft_model(DIR, LoraConfig) streams the safetensors under the adapters
             (their initial values come from the runtime's seeded init, not torch.manual_seed: the first loss is
             the same, later ones differ slightly).
  deepspeed  (--deepspeed) PEFT + DeepSpeed ZeRO-3, offload_param and offload_optimizer on nvme (bench_offload_step's
             deepspeed_config, fp32, buffer_count --ds-buffer-count 32, buffer_size = the embedding's elements):
             HfDeepSpeedConfig kept alive so from_pretrained loads inside zero.Init, get_peft_model, then
             deepspeed.initialize(model=peft_model, model_parameters=the adapters), engine.backward / engine.step.
             With DeepSpeed 0.19.8 its second step fails: at 2-8 layers in the nvme prefetch ("AssertionError:
             param N already assigned swap buffer id M", as DeepSpeed issue 4072), at 1.1B for want of swap buffers
             ("AssertionError: Not enough buffers 0 for swapping 1"): the frozen base's parameters stay assigned to
             their swap buffers after the first step. The contender reports the step and the error.
  deepspeed-noreuse (with --deepspeed) the same with stage3_max_reuse_distance 0 and stage3_max_live_parameters 0
             (every parameter released after its use), which avoids both failures.
  deepspeed-noprefetch (opt-in, --contenders) stage3_prefetch_bucket_size 0: avoids the first failure only (at
             2-8 layers it trains; at 1.1B its second step runs out of buffers).
  memory     (--memory) PEFT in memory, torch.optim.AdamW (fused), clip_grad_norm_: the losses' reference.
Reported per contender: median s/step, first/last loss and max |loss - memory's|, peak RSS while loading (process
start through the model being ready: load, PEFT, wrap / deepspeed.initialize) and while training (VmHWM reset by
/proc/self/clear_refs between the two), nvme bytes read/written per step (offload: rt.stats() after rt.quiesce();
every contender: /proc/self/io read_bytes / write_bytes, DeepSpeed's swap traffic).
Smoke: --base --layers 2 --hidden 256 --ff 512 --heads 4 --kv-heads 2 --vocab 2000 --steps 3 --cpu-budget 16MiB
--device-budget 64MiB --deepspeed --memory
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

import torch
from peft import LoraConfig, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM

import offload
from offload.zero.units import discover as units


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--no-islands", action="store_true", help="fold the adapters into their blocks (the old way)")
    p.add_argument("--no-pipeline", action="store_true", help="Config(pipeline=False): no read-ahead or overlap")
    g = p.add_argument_group("--base: a >= 1B base on nvme, side by side with DeepSpeed and in memory")
    g.add_argument("--base", action="store_true", help="the large-base benchmark (module docstring)")
    g.add_argument("--deepspeed", action="store_true", help="--base: add PEFT + DeepSpeed ZeRO-3 nvme")
    g.add_argument("--memory", action="store_true", help="--base: add PEFT in memory (the losses' reference)")
    g.add_argument("--contenders", default=None, help=f"--base: a list of {BASE_CONTENDERS} (overrides the two above)")
    g.add_argument("--rounds", type=int, default=1)
    g.add_argument("--steps", type=int, default=5)
    g.add_argument("--warmup", type=int, default=1, help="first steps left out of the medians")
    g.add_argument("--layers", type=int, default=22)
    g.add_argument("--hidden", type=int, default=2048)
    g.add_argument("--ff", type=int, default=5632)
    g.add_argument("--heads", type=int, default=32)
    g.add_argument("--kv-heads", type=int, default=4)
    g.add_argument("--vocab", type=int, default=32000)
    g.add_argument("--seq", type=int, default=128)
    g.add_argument("--batch", type=int, default=1)
    g.add_argument("--r", type=int, default=16)
    g.add_argument("--alpha", type=int, default=32)
    g.add_argument("--lr", type=float, default=1e-4)
    g.add_argument("--cpu-budget", default="512MiB")
    g.add_argument("--device-budget", default="1GiB")
    g.add_argument("--ds-buffer-count", type=int, default=32)
    g.add_argument("--threads", type=int, default=2)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--model-dir", default=None, help="the base's directory: built there if it has no config.json, "
                                                     "kept (default: a temporary one, removed)")
    g.add_argument("--nvme-path", default=None, help="swap directory root (default: a temp dir under /tmp, removed)")
    g.add_argument("--json", default=None)
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--settings", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        base_child(args.child, args.settings)
        return
    if args.base:
        sys.exit(base_main(args))
    if args.no_islands:
        units.trainable_islands = lambda root, chosen: []
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=2000, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                                         num_attention_heads=4, num_key_value_heads=2))
    model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]))
    ids = torch.randint(0, 2000, (2, 64), generator=torch.Generator().manual_seed(2))
    cfg = offload.Config(params="nvme", optimizer="nvme", nvme_path=tempfile.mkdtemp(), cpu_budget="12MiB",
                         device_budget="64MiB", pipeline=not args.no_pipeline)
    with offload.init(cfg) as rt:
        rt.wrap(model)
        opt = offload.AdamW([q for q in model.parameters() if q.requires_grad], lr=1e-3)
        marks = []
        for _ in range(3):
            t0 = time.perf_counter()
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad()
            rt.quiesce()
            s = rt.stats()
            marks.append((s["nvme_written_bytes"], s["nvme_read_bytes"], time.perf_counter() - t0))
        trainable = sum(q.numel() for q in model.parameters() if q.requires_grad)
        frozen = sum(q.numel() for q in model.parameters() if not q.requires_grad)
        trained_units = sum(u.layout.trainable for u in rt.units)
    print(f"{'folded' if args.no_islands else 'islands'}: {trainable} trainable / {frozen} frozen params, "
          f"{trained_units} of {len(rt.units)} units train; last step: nvme written {marks[2][0] - marks[1][0]} B, "
          f"read {marks[2][1] - marks[1][1]} B, {marks[2][2]:.3f} s")


# ---- --base: a >= 1B base, side by side -------------------------------------------------------------------

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_offload_step as bso  # noqa: E402  (spawn, interleaved rounds, peak RSS, DeepSpeed's nvme config)

BASE_CONTENDERS = ("offload", "offload-stream", "deepspeed", "deepspeed-noreuse", "deepspeed-noprefetch", "memory")
SCRIPT = os.path.abspath(__file__)
DIST_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
KEEP_ALIVE: list = []  # transformers finds the DeepSpeed config through a weak reference


@dataclasses.dataclass
class LoraSettings(bso.Settings):
    vocab: int = 32000
    dim: int = 2048
    layers: int = 22
    heads: int = 32
    kv_heads: int = 4
    ff: int = 5632
    seq: int = 128
    batch: int = 1
    steps: int = 5
    warmup: int = 1
    lr: float = 1e-4
    weight_decay: float = 0.0
    r: int = 16
    alpha: int = 32
    model_dir: str = ""
    cpu_budget: str = "512MiB"
    device_budget: str = "1GiB"
    ds_buffer_count: int = 32


def base_config(s: LoraSettings):
    return LlamaConfig(vocab_size=s.vocab, hidden_size=s.dim, intermediate_size=s.ff, num_hidden_layers=s.layers,
                       num_attention_heads=s.heads, num_key_value_heads=s.kv_heads,
                       max_position_embeddings=max(2048, s.seq), tie_word_embeddings=False)


def build_base(s: LoraSettings) -> dict:
    torch.manual_seed(s.seed)
    t0 = time.perf_counter()
    model = LlamaForCausalLM(base_config(s))
    n_params = sum(q.numel() for q in model.parameters())
    model.save_pretrained(s.model_dir, safe_serialization=True)
    del model
    files = sorted(os.listdir(s.model_dir))
    return {"n_params": n_params, "files": files, "build_s": time.perf_counter() - t0,
            "bytes": sum(os.path.getsize(os.path.join(s.model_dir, f)) for f in files),
            "peak_rss_bytes": bso.peak_rss_bytes()}


def lora_config(s: LoraSettings) -> LoraConfig:
    return LoraConfig(r=s.r, lora_alpha=s.alpha, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)


def base_batch(s: LoraSettings, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(s.seed * 1_000_003 + step)
    return torch.randint(0, s.vocab, (s.batch, s.seq), generator=g)


def run_base(name: str, s: LoraSettings) -> dict:
    """One contender: load (and wrap / initialize), then s.steps timed steps, each ending with its I/O drained."""
    from transformers import AutoModelForCausalLM

    if not name.startswith("deepspeed"):
        for key in DIST_ENV:
            os.environ.pop(key, None)
    torch.set_num_threads(s.threads)
    out: dict = {"load_average_start": os.getloadavg()}
    t_load = time.perf_counter()
    ctx = rt = engine = None
    if name.startswith("deepspeed"):
        import deepspeed
        from transformers.integrations import HfDeepSpeedConfig

        deepspeed.init_distributed(dist_backend="gloo")
        ds_config = bso.deepspeed_config(s, largest=s.vocab * s.dim)
        ds_config["bf16"] = {"enabled": False}
        ds_config["zero_optimization"]["offload_param"]["buffer_count"] = s.ds_buffer_count
        if name == "deepspeed-noreuse":  # the work-around: no parameter kept gathered for reuse (frozen ones leak)
            ds_config["zero_optimization"].update(stage3_max_reuse_distance=0, stage3_max_live_parameters=0)
        if name == "deepspeed-noprefetch":  # no nvme prefetch: enough at a few layers, not at 1B
            ds_config["zero_optimization"]["stage3_prefetch_bucket_size"] = 0
        KEEP_ALIVE.append(HfDeepSpeedConfig(ds_config))  # alive while from_pretrained runs: it loads in zero.Init
        model = AutoModelForCausalLM.from_pretrained(s.model_dir)
        torch.manual_seed(s.seed + 7)
        model = get_peft_model(model, lora_config(s))
        trainable = [q for q in model.parameters() if q.requires_grad]
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=trainable, config=ds_config)
        out["ds_config"] = ds_config
        n_frozen = sum(getattr(q, "ds_numel", q.numel()) for q in model.parameters() if not q.requires_grad)
    elif name == "offload-stream":  # the base streamed from its files under PEFT's adapters: never whole in memory
        from offload.integrations.lora import load_peft_model

        cfg = offload.Config(params="nvme", optimizer="nvme", nvme_path=s.nvme_dir, cpu_budget=s.cpu_budget,
                             device_budget=s.device_budget, seed=s.seed, compute_dtype="fp32")
        ctx = offload.init(cfg)
        rt = ctx.__enter__()
        model = load_peft_model(s.model_dir, lora_config(s))
        trainable = [q for q in model.parameters() if q.requires_grad]
        n_frozen = sum(q.numel() for q in model.parameters() if not q.requires_grad)
        opt = offload.AdamW(trainable, lr=s.lr, weight_decay=s.weight_decay)
        out["units"], out["trainable_units"] = len(rt.units), sum(u.layout.trainable for u in rt.units)
    else:
        model = AutoModelForCausalLM.from_pretrained(s.model_dir)  # in memory (PEFT goes on before the wrap)
        torch.manual_seed(s.seed + 7)
        model = get_peft_model(model, lora_config(s))
        trainable = [q for q in model.parameters() if q.requires_grad]
        n_frozen = sum(q.numel() for q in model.parameters() if not q.requires_grad)
        if name == "offload":
            cfg = offload.Config(params="nvme", optimizer="nvme", nvme_path=s.nvme_dir, cpu_budget=s.cpu_budget,
                                 device_budget=s.device_budget, seed=s.seed, compute_dtype="fp32")
            ctx = offload.init(cfg)
            rt = ctx.__enter__()
            rt.wrap(model)
            opt = offload.AdamW(trainable, lr=s.lr, weight_decay=s.weight_decay)
            out["units"], out["trainable_units"] = len(rt.units), sum(u.layout.trainable for u in rt.units)
        else:
            opt = torch.optim.AdamW(trainable, lr=s.lr, weight_decay=s.weight_decay, fused=True)
    n_trainable = sum(getattr(q, "ds_numel", q.numel()) for q in trainable)
    import gc

    gc.collect()
    out.update(load_s=time.perf_counter() - t_load, peak_rss_load_bytes=bso.peak_rss_bytes(),
               rss_after_load_bytes=bso.rss_bytes(), peak_rss_reset=bso.reset_peak_rss())

    def step(i: int) -> float:
        ids = base_batch(s, i)
        if engine is not None:
            loss = engine(input_ids=ids, labels=ids).loss
            engine.backward(loss)
            engine.step()  # clips to gradient_clipping, steps, zeroes the gradients
            return loss.item()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        if rt is not None:
            rt.clip_grad_norm_(s.clip)
        else:
            torch.nn.utils.clip_grad_norm_(trainable, s.clip)
        opt.step()
        opt.zero_grad()
        if rt is not None:
            rt.quiesce()  # this step's reads, writes and updates paid for inside its time
        return loss.item()

    losses, times, nvme, io = [], [], [], []
    try:
        for i in range(s.steps):
            io0, st0 = bso.proc_io(), (rt.stats() if rt is not None else None)
            t0 = time.perf_counter()
            try:
                losses.append(step(i))
            except Exception as exc:  # noqa: BLE001 - reported with the step it happened in, the run's figures kept
                import traceback

                out.update(contender=name, error=f"step {i + 1} of {s.steps}: {type(exc).__name__}: {exc}",
                           output_tail=traceback.format_exc().splitlines()[-12:], losses=losses, step_s=times,
                           peak_rss_train_bytes=bso.peak_rss_bytes(), n_trainable=n_trainable, n_frozen=n_frozen)
                return out
            times.append(time.perf_counter() - t0)
            io1 = bso.proc_io()
            io.append({k: io1[k] - io0[k] for k in io0})
            if rt is not None:
                st1 = rt.stats()
                nvme.append({"read": st1["nvme_read_bytes"] - st0["nvme_read_bytes"],
                             "written": st1["nvme_written_bytes"] - st0["nvme_written_bytes"]})
        out["peak_rss_train_bytes"] = bso.peak_rss_bytes()
        if rt is not None:
            out["rt_stats"] = rt.stats()  # cumulative counters, the last step's split, memory outside the budgets
    finally:
        if ctx is not None:
            ctx.__exit__(None, None, None)
        if engine is not None and hasattr(engine, "destroy"):
            engine.destroy()
    w = slice(s.warmup, None) if s.steps > s.warmup else slice(None)
    out.update(contender=name, n_trainable=n_trainable, n_frozen=n_frozen, losses=losses, step_s=times,
               median_step_s=statistics.median(times[w]), s_per_step=statistics.median(times[w]),
               proc_io_step=io, load_average_end=os.getloadavg(),
               disk_read_bytes_per_step=statistics.median(x["read_bytes"] for x in io[w]),
               disk_write_bytes_per_step=statistics.median(x["write_bytes"] for x in io[w]))
    if nvme:
        out.update(nvme_step=nvme, nvme_read_bytes_per_step=statistics.median(x["read"] for x in nvme[w]),
                   nvme_written_bytes_per_step=statistics.median(x["written"] for x in nvme[w]))
    return out


BASE_CHILDREN = {"build": build_base, **{n: (lambda n: lambda s: run_base(n, s))(n) for n in BASE_CONTENDERS}}


def base_child(name: str, settings_json: str) -> None:
    s = LoraSettings(**json.loads(settings_json))
    result = BASE_CHILDREN[name](s)
    result["contender"] = name
    bso.emit(result)


def base_spawn(name: str, s: LoraSettings) -> dict:
    return bso.spawn(name, s, script=SCRIPT, distributed=())


def mib(n) -> str:
    return "-" if n is None else f"{n / 2**20:,.1f} MiB"


def base_main(args) -> int:
    if args.contenders:
        contenders = [c.strip() for c in args.contenders.split(",") if c.strip()]
    else:
        contenders = (["offload"] + (["deepspeed", "deepspeed-noreuse"] if args.deepspeed else [])
                      + (["memory"] if args.memory else []))
    unknown = [c for c in contenders if c not in BASE_CONTENDERS]
    if unknown:
        raise SystemExit(f"unknown contender(s) {unknown}; choose from {BASE_CONTENDERS}")
    owned = args.nvme_path is None
    root = tempfile.mkdtemp(prefix="bench-lora-base-") if owned else args.nvme_path
    os.makedirs(root, exist_ok=True)
    model_dir = args.model_dir or os.path.join(root, "model")
    base = LoraSettings(vocab=args.vocab, dim=args.hidden, layers=args.layers, heads=args.heads, kv_heads=args.kv_heads,
                        ff=args.ff, seq=args.seq, batch=args.batch, steps=args.steps, warmup=args.warmup, lr=args.lr,
                        r=args.r, alpha=args.alpha, threads=args.threads, seed=args.seed, model_dir=model_dir,
                        cpu_budget=args.cpu_budget, device_budget=args.device_budget,
                        ds_buffer_count=args.ds_buffer_count)
    info = bso.machine_info()
    started = time.time()
    build = None
    try:
        if not os.path.exists(os.path.join(model_dir, "config.json")):
            print(f"# building the base into {model_dir} ...", flush=True)
            build = base_spawn("build", dataclasses.replace(base, nvme_dir=os.path.join(root, "build")))
            if "error" in build:
                raise SystemExit("building the base failed:\n" + "\n".join(build["output_tail"]))
            print(f"# {build['n_params'] / 1e9:.3f}B params, {build['bytes'] / 2**30:.2f} GiB, built and saved in "
                  f"{build['build_s']:.0f} s (peak RSS {mib(build['peak_rss_bytes'])})", flush=True)
        else:
            print(f"# reusing the base in {model_dir}", flush=True)

        def settings_for(name: str, r: int) -> LoraSettings:
            return dataclasses.replace(base, nvme_dir=os.path.join(root, f"{name}-r{r}"))

        runs = bso.interleaved_rounds(contenders, args.rounds, settings_for, run_child=base_spawn)
    finally:
        if owned:
            shutil.rmtree(root, ignore_errors=True)
    ref = next((r for r in runs.get("memory", []) if "error" not in r), None)
    rows = {}
    for name, rs in runs.items():
        ok = [r for r in rs if "error" not in r]
        if not ok:
            r = rs[-1]
            rows[name] = {k: r.get(k) for k in ("error", "output_tail", "losses", "step_s", "load_s",
                                                 "peak_rss_load_bytes", "peak_rss_train_bytes")}
            continue
        r = ok[-1]
        row = {k: r.get(k) for k in ("n_trainable", "n_frozen", "load_s", "nvme_read_bytes_per_step",
                                      "nvme_written_bytes_per_step", "disk_read_bytes_per_step",
                                      "disk_write_bytes_per_step", "units", "trainable_units")}
        row.update(median_step_s=statistics.median(x["median_step_s"] for x in ok),
                   peak_rss_load_bytes=max(x["peak_rss_load_bytes"] for x in ok),
                   peak_rss_train_bytes=max(x["peak_rss_train_bytes"] for x in ok),
                   first_loss=r["losses"][0], last_loss=r["losses"][-1], losses=r["losses"], step_s=r["step_s"],
                   load_average=[r["load_average_start"], r["load_average_end"]])
        if ref is not None:
            row["max_abs_loss_diff_vs_memory"] = max(abs(a - b) for a, b in zip(ref["losses"], r["losses"]))
        rows[name] = row
    n = build["n_params"] if build else next((x["n_trainable"] + x["n_frozen"] for x in rows.values()
                                               if "n_frozen" in x), None)
    print(f"\n# LoRA r={base.r} alpha={base.alpha} on q_proj,v_proj over a Llama base of "
          f"{(n or 0) / 1e9:.3f}B params ({base.layers} layers, hidden {base.dim}, ff {base.ff}, heads "
          f"{base.heads}/{base.kv_heads} kv, vocab {base.vocab}), fp32, batch {base.batch} x seq {base.seq}, "
          f"{base.steps} steps (median over steps {base.warmup + 1}..{base.steps}), {base.threads} threads/process")
    print(f"# offload: params+optimizer nvme, cpu_budget {base.cpu_budget}, device_budget {base.device_budget}; "
          f"deepspeed: ZeRO-3 offload_param+offload_optimizer nvme, buffer_count {base.ds_buffer_count}")
    print("| contender | median s/step | first loss | last loss | max abs loss diff vs memory | peak RSS load | "
          "peak RSS train | nvme R/step | nvme W/step | disk R/step | disk W/step | load s |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name, row in rows.items():
        if "error" in row:
            print(f"| {name} | failed: {row['error']} | | | | {mib(row.get('peak_rss_load_bytes'))} | "
                  f"{mib(row.get('peak_rss_train_bytes'))} | | | | | |")
            continue
        diff = row.get("max_abs_loss_diff_vs_memory")
        print(f"| {name} | {row['median_step_s']:.2f} | {row['first_loss']:.5f} | {row['last_loss']:.5f} | "
              f"{'-' if diff is None else f'{diff:.2e}'} | {mib(row['peak_rss_load_bytes'])} | "
              f"{mib(row['peak_rss_train_bytes'])} | {mib(row['nvme_read_bytes_per_step'])} | "
              f"{mib(row['nvme_written_bytes_per_step'])} | {mib(row['disk_read_bytes_per_step'])} | "
              f"{mib(row['disk_write_bytes_per_step'])} | {row['load_s']:.0f} |")
    for name, row in rows.items():
        if "error" in row:
            print(f"# {name} failed: {row['error']}; losses before it {row.get('losses')}, step s {row.get('step_s')}; "
                  "last lines:\n#   " + "\n#   ".join(row.get("output_tail") or []))
        else:
            print(f"# {name}: {row['n_trainable']} trainable / {row['n_frozen']} frozen; step s "
                  f"{[round(x, 2) for x in row['step_s']]}; losses {[round(x, 5) for x in row['losses']]}; load average "
                  f"start/end {[round(x, 2) for x in row['load_average'][0]]} / "
                  f"{[round(x, 2) for x in row['load_average'][1]]}"
                  + (f"; {row['trainable_units']} of {row['units']} units train" if row.get("units") else ""))
    if args.json:
        doc = {"command": [sys.executable] + sys.argv, "settings": dataclasses.asdict(base), "machine": info,
               "load_average_end": os.getloadavg(), "started": started, "wall_s": time.time() - started,
               "build": build, "runs": runs, "table": rows}
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1, default=str)
        print(f"# wrote {args.json}")
    return 1 if any("error" in row for row in rows.values()) else 0


if __name__ == "__main__":
    main()
