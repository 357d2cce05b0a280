"""A transformers Llama whose training states are larger than this machine's RAM (issue 21): offload with params
and optimizer on nvme beside DeepSpeed ZeRO-Infinity (ZeRO-3, offload_param and offload_optimizer on nvme) on the
same model, batch and machine.

Each contender runs in its own child process, built from the same seed; the parent watches the child's resident
set every 0.2 s (its own VmHWM is lost if the kernel kills it) and stops it once it passes --rss-limit, before the
machine's OOM killer picks a victim. Per step: wall time, the child's peak RSS against offload's budgets, and the
nvme bytes moved (offload's rt.stats()). One bf16 micro-batch of --seq tokens, AdamW, clipping at 1.0.

    python benchmarks/bench_llama_bigger_than_ram.py --hidden 2048 --layers 36 --steps 2 --contenders offload,deepspeed
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import bench_offload_step as bso  # noqa: E402  (its DeepSpeed config, RSS probes, free port)

GiB = 1 << 30


def llama_config(a):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=a.hidden * 11 // 4,
                       num_hidden_layers=a.layers, num_attention_heads=a.hidden // 64,
                       num_key_value_heads=a.hidden // 128, max_position_embeddings=max(2048, a.seq),
                       tie_word_embeddings=False, torch_dtype="bfloat16")


def batch(a, i: int):
    import torch

    g = torch.Generator().manual_seed(1000 + i)
    return torch.randint(0, a.vocab, (1, a.seq), generator=g)


def child_offload(a) -> dict:
    import torch
    from transformers import LlamaForCausalLM

    import offload

    torch.set_num_threads(a.threads)
    out = {"steps": []}
    cfg = offload.Config(params="nvme", optimizer="nvme", nvme_path=a.nvme_path, cpu_budget=a.cpu_budget,
                         device_budget=a.device_budget, compute_dtype="bf16", seed=0)
    t0 = time.perf_counter()
    with offload.init(cfg) as rt:
        model = LlamaForCausalLM(llama_config(a))  # materialized unit by unit into the store
        opt = offload.AdamW(model.parameters(), lr=1e-5, weight_decay=0.0)
        out["params"] = sum(p.numel() for p in model.parameters())
        out["init_s"] = time.perf_counter() - t0
        out["peak_rss_after_init"] = bso.peak_rss_bytes()
        for i in range(a.steps):
            before = rt.stats()
            ts = time.perf_counter()
            ids = batch(a, i)
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            rt.clip_grad_norm_(1.0)
            opt.step()
            opt.zero_grad()
            value = loss.item()
            after = rt.stats()
            out["steps"].append({"s": time.perf_counter() - ts, "loss": value, "peak_rss": bso.peak_rss_bytes(),
                                 "nvme_read": after["nvme_read_bytes"] - before["nvme_read_bytes"],
                                 "nvme_written": after["nvme_written_bytes"] - before["nvme_written_bytes"]})
            print(f"# offload step {i + 1}: {out['steps'][-1]['s']:.1f} s, loss {value:.4f}", file=sys.stderr, flush=True)
        ts = time.perf_counter()
        rt.quiesce()  # the last step's pipelined updates land
        out["drain_s"] = time.perf_counter() - ts
        mem = rt.stats()["memory"]
        out["budgets"] = {t: rt.stats()["budgets"][t] for t in ("device", "cpu")}
        out["host_pool"] = mem["host_pool"]
        out["outside_budgets_bytes"] = mem["outside_budgets_bytes"]
        out["rss_at_open"] = mem["rss_at_open_bytes"]
    out["peak_rss"] = bso.peak_rss_bytes()
    return out


def child_deepspeed(a) -> dict:
    import deepspeed
    import torch
    from transformers import LlamaForCausalLM

    torch.set_num_threads(a.threads)
    deepspeed.init_distributed(dist_backend="gloo")
    s = bso.Settings(vocab=a.vocab, dim=a.hidden, batch=1, seq=a.seq, clip=1.0, lr=1e-5, weight_decay=0.0,
                     nvme_dir=a.nvme_path)
    ds_config = bso.deepspeed_config(s, largest=a.vocab * a.hidden)
    out = {"steps": []}
    t0 = time.perf_counter()
    torch.manual_seed(0)
    with deepspeed.zero.Init(config_dict_or_path=ds_config):
        model = LlamaForCausalLM(llama_config(a))
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)
    out["params"] = sum(p.ds_numel for p in model.parameters())
    out["init_s"] = time.perf_counter() - t0
    print(f"# deepspeed initialized in {out['init_s']:.0f} s", file=sys.stderr, flush=True)
    for i in range(a.steps):
        ts = time.perf_counter()
        ids = batch(a, i)
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        out["steps"].append({"s": time.perf_counter() - ts, "loss": loss.item(), "peak_rss": bso.peak_rss_bytes()})
        print(f"# deepspeed step {i + 1}: {out['steps'][-1]['s']:.1f} s", file=sys.stderr, flush=True)
    out["peak_rss"] = bso.peak_rss_bytes()
    return out


def rss_of(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def run_child(a, name: str) -> dict:
    """The contender in its own process, watched: its result, or how it ended (killed, stopped at the limit)."""
    nvme = tempfile.mkdtemp(prefix=f"llama-big-{name}-", dir=a.nvme_path)
    cmd = [sys.executable, os.path.abspath(__file__), "--child", name, "--nvme-path", nvme] + [
        f"--{k}={v}" for k, v in (("hidden", a.hidden), ("layers", a.layers), ("vocab", a.vocab), ("seq", a.seq),
                                  ("steps", a.steps), ("threads", a.threads), ("cpu-budget", a.cpu_budget),
                                  ("device-budget", a.device_budget))]
    env = dict(os.environ)
    if name == "deepspeed":
        env.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(bso.free_port()))
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=None, text=True, env=env)
    peak, stopped = 0, False
    while proc.poll() is None:
        peak = max(peak, rss_of(proc.pid))
        if peak > a.rss_limit and not stopped:
            proc.send_signal(signal.SIGKILL)  # before the kernel's OOM killer picks a victim of its own
            stopped = True
        time.sleep(0.2)
    stdout = proc.stdout.read()
    line = next((x for x in stdout.splitlines() if x.startswith("RESULT ")), None)
    result = json.loads(line[len("RESULT "):]) if line else {}
    result.update(name=name, returncode=proc.returncode, watched_peak_rss=peak, wall_s=time.perf_counter() - t0,
                  stopped_at_limit=stopped)
    shutil.rmtree(nvme, ignore_errors=True)
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--contenders", default="offload,deepspeed")
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--layers", type=int, default=36)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--cpu-budget", default="4GiB")
    p.add_argument("--device-budget", default="2GiB")
    p.add_argument("--rss-limit", type=float, default=20, help="GiB: a child above it is stopped (default 20)")
    p.add_argument("--nvme-path", default=tempfile.gettempdir())
    p.add_argument("--json", default=None)
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        result = {"offload": child_offload, "deepspeed": child_deepspeed}[a.child](a)
        print("RESULT " + json.dumps(result), flush=True)
        return
    a.rss_limit = int(a.rss_limit * GiB)
    import psutil

    print(f"# Llama d{a.hidden} x {a.layers} layers, vocab {a.vocab}, 1 x {a.seq} tokens, bf16; machine RAM "
          f"{psutil.virtual_memory().total / GiB:.1f} GiB; offload budgets cpu {a.cpu_budget} + device "
          f"{a.device_budget}", flush=True)
    results = []
    for name in a.contenders.split(","):
        r = run_child(a, name)
        results.append(r)
        steps = r.get("steps", [])
        how = ("completed" if r["returncode"] == 0 else
               f"stopped by the bench above {a.rss_limit / GiB:.0f} GiB RSS" if r["stopped_at_limit"] else
               f"exited {r['returncode']}" + (" (SIGKILL: the OOM killer?)" if r["returncode"] == -9 else ""))
        print(f"{name:9s} {how}; params {r.get('params', 0) / 1e9:.2f} B; init {r.get('init_s', float('nan')):.0f} s; "
              f"steps s {[round(x['s'], 1) for x in steps]}; peak RSS {r['watched_peak_rss'] / GiB:.2f} GiB "
              f"(watched), {r.get('peak_rss', 0) / GiB:.2f} GiB (VmHWM); wall {r['wall_s']:.0f} s", flush=True)
        if steps and "nvme_read" in steps[-1]:
            print(f"          nvme per step read {[round(x['nvme_read'] / GiB, 2) for x in steps]} GiB, written "
                  f"{[round(x['nvme_written'] / GiB, 2) for x in steps]} GiB; rss at open "
                  f"{r['rss_at_open'] / GiB:.2f} GiB; host pool peak in use "
                  f"{(r['host_pool'] or {}).get('peak_in_use_bytes', 0) / GiB:.2f} GiB", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"args": vars(a), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
