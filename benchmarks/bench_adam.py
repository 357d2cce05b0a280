"""CPU AdamW benchmark: offload's fused kernel vs torch.optim.AdamW (foreach, fused=True) and
DeepSpeedCPUAdam, against a memory roofline measured in the same run.

All variants step the SAME buffers (fp32 param/grad/moments, plus bf16 grad/param copies and bf16
moments) in interleaved rounds, so host noise (other processes on the cores) hits them alike; ratios
are taken per round and their median reported.

Roofline: STREAM-like kernels on the same thread pool (offload._C.membw_*), bytes counted as real
traffic, write-allocate reads included: copy b=a 12 B/elem, triad a=b+s*c 16 B/elem, the in-place
axpy a+=s*b 12 B/elem, and an "adam-shaped" a,b,c += s*d (4 streams read, 3 written back in place,
28 B/elem: the fp32 Adam step's traffic without its arithmetic). On this host one core's bandwidth is
bound by how many misses it keeps in flight, so kernels with more streams go faster; the
adam-shaped kernel is the honest ceiling for Adam. The roofline is the best of the four (median over
rounds); "% roofline" compares counted Adam bytes with it. Adam's stores hit lines it has just
read, so it pays no write-allocate either.

Bytes per param (counted, no write-allocate):
  fp32 step            read p,g,m,v (16) + write p,m,v (12)                 = 28
  offload bf16 update  read p,m,v (12) + bf16 g (2) + write p,m,v (12) + bf16 out (2) = 28
  assembled bf16       upcast g (2+4) + fp32 step (28) + cast p (4+2)       = 40
  bf16 moments         read p (4) + g,m,v bf16 (6) + write p (4) + m,v,out bf16 (6) = 20

Usage:
  python benchmarks/bench_adam.py                       # 10M,100M,400M, 2 threads
  python benchmarks/bench_adam.py --sizes 10M --rounds 3  # quick
DeepSpeedCPUAdam is used when `import deepspeed` works (extra import paths: --ds-path).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time


def _parse_size(s: str) -> int:
    s = s.strip().upper()
    mult = {"K": 10**3, "M": 10**6, "G": 10**9}.get(s[-1], 1)
    return int(float(s[:-1] if s[-1] in "KMG" else s) * mult)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="10M,100M,400M", help="comma list of param counts (K/M/G suffixes)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds per size")
    ap.add_argument("--min-sample-s", type=float, default=0.3, help="repeat a step until a sample lasts this long")
    ap.add_argument("--no-deepspeed", action="store_true")
    ap.add_argument("--ds-path", default="", help="extra sys.path entry where deepspeed is installed")
    ap.add_argument("--json", default="", help="write raw results here")
    args = ap.parse_args()

    # Thread counts must be fixed before torch / OpenMP (DeepSpeed) initialise.
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    if args.ds_path:
        sys.path.insert(0, args.ds_path)
    import torch

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import offload
    from offload import _ext

    C = _ext.require()
    torch.set_num_threads(args.threads)
    C.set_num_threads(args.threads)

    ds_cls = None
    if not args.no_deepspeed:
        try:
            import logging

            logging.disable(logging.WARNING)
            from deepspeed.ops.adam import DeepSpeedCPUAdam

            ds_cls = DeepSpeedCPUAdam
        except Exception as exc:  # not installed or its JIT build failed: run without it, say so
            print(f"# DeepSpeedCPUAdam unavailable: {type(exc).__name__}: {exc}", file=sys.stderr)

    import platform

    info = {
        "cpu": _cpu_model(),
        "isa": C.active_isa(),
        "threads": args.threads,
        "torch": torch.__version__,
        "deepspeed": _ds_version() if ds_cls else None,
        "python": platform.python_version(),
        "nontemporal_out": C.adam_nontemporal_out(),
    }
    print("# " + json.dumps(info))
    results = {"info": info, "sizes": {}}
    for n in [_parse_size(s) for s in args.sizes.split(",")]:
        results["sizes"][n] = bench_size(n, args, torch, offload, C, ds_cls)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


def _ds_version():
    import deepspeed

    return deepspeed.__version__


def bench_size(n, args, torch, offload, C, ds_cls):
    lr, betas, eps, wd = 1e-3, (0.9, 0.999), 1e-8, 0.01
    gen = torch.Generator().manual_seed(0)
    # Shared buffers; every variant steps these in place (values stay sane: small grads, small lr).
    p = torch.randn(n, generator=gen)
    g = torch.randn(n, generator=gen).mul_(1e-3)
    m = torch.zeros(n)
    v = torch.zeros(n)
    g16 = g.to(torch.bfloat16)
    p16 = p.to(torch.bfloat16)
    m16 = torch.zeros(n, dtype=torch.bfloat16)
    v16 = torch.zeros(n, dtype=torch.bfloat16)

    param = torch.nn.Parameter(p)  # shares p's storage
    param.grad = g
    param16 = torch.nn.Parameter(p16)
    param16.grad = g16

    def shared_state(opt, prm, step, master=None, moments=(m, v)):
        st = {"step": step, "exp_avg": moments[0], "exp_avg_sq": moments[1]}
        if master is not None:
            st["master"] = master
        opt.state[prm] = st
        return opt

    fp32_step = torch.tensor(0.0)
    ours = shared_state(offload.AdamW([param], lr=lr, betas=betas, eps=eps, weight_decay=wd), param, fp32_step.clone())
    foreach = shared_state(torch.optim.AdamW([param], lr=lr, betas=betas, eps=eps, weight_decay=wd, foreach=True),
                           param, fp32_step.clone())
    fused = shared_state(torch.optim.AdamW([param], lr=lr, betas=betas, eps=eps, weight_decay=wd, fused=True),
                         param, fp32_step.clone())
    ours16 = shared_state(offload.AdamW([param16], lr=lr, betas=betas, eps=eps, weight_decay=wd), param16,
                          fp32_step.clone(), master=p)
    ours16m = shared_state(offload.AdamW([param16], lr=lr, betas=betas, eps=eps, weight_decay=wd,
                                         moments_dtype=torch.bfloat16), param16, fp32_step.clone(), master=p,
                           moments=(m16, v16))
    ds = None
    if ds_cls is not None:
        ds = ds_cls([param], lr=lr, betas=betas, eps=eps, weight_decay=wd, adamw_mode=True)
        shared_state(ds, param, 0)

    def assembled(opt):
        # The best a user can build from a fp32 optimizer: upcast the bf16 grad into the fp32 grad
        # buffer, the fp32 step, cast the param to bf16.
        def run():
            g.copy_(g16)
            opt.step()
            p16.copy_(p)

        return run

    def nt_off(fn):
        def run():
            C.adam_set_nontemporal_out(False)
            try:
                fn()
            finally:
                C.adam_set_nontemporal_out(True)

        return run

    # name -> (callable, counted bytes per param, group)
    variants = {
        "roofline: copy b=a": (lambda: C.membw_copy_(m, v), 12, "roof"),
        "roofline: triad a=b+s*c": (lambda: C.membw_triad_(m, p, g, 1e-9), 16, "roof"),
        "roofline: axpy a+=s*b": (lambda: C.membw_axpy_(p, g, 1e-9), 12, "roof"),
        "roofline: adam-shaped a,b,c+=s*d": (lambda: C.membw_adam_shaped_(p, m, v, g, 1e-9), 28, "roof"),
        "fp32: offload.AdamW": (ours.step, 28, "fp32"),
        "fp32: torch foreach": (foreach.step, 28, "fp32"),
        "fp32: torch fused": (fused.step, 28, "fp32"),
        "bf16 update: offload.AdamW": (ours16.step, 28, "bf16"),
        "bf16 update: offload.AdamW (no NT store)": (nt_off(ours16.step), 28, "bf16x"),
        "bf16 update: upcast+torch foreach+cast": (assembled(foreach), 40, "bf16"),
        "bf16 update: upcast+torch fused+cast": (assembled(fused), 40, "bf16"),
        "bf16 moments: offload.AdamW": (ours16m.step, 20, "bf16m"),
    }
    if ds is not None:
        variants["fp32: DeepSpeedCPUAdam"] = (ds.step, 28, "fp32")
        variants["bf16 update: upcast+DeepSpeedCPUAdam+cast"] = (assembled(ds), 40, "bf16")

    names = list(variants)
    reps = {}
    for name in names:  # warm-up (first-touch, JIT, thread spin-up) and sample sizing
        fn = variants[name][0]
        fn()
        t = time.perf_counter()
        fn()
        dt = time.perf_counter() - t
        reps[name] = max(1, int(args.min_sample_s / max(dt, 1e-6)))
    times = {name: [] for name in names}
    cpu = {name: [] for name in names}  # process CPU time (all threads): what a variant costs a shared host
    for r in range(args.rounds):
        order = names[r % len(names):] + names[: r % len(names)]  # rotate: no fixed position bias
        for name in order:
            fn, k = variants[name][0], reps[name]
            t, c = time.perf_counter(), time.process_time()
            for _ in range(k):
                fn()
            times[name].append((time.perf_counter() - t) / k)
            cpu[name].append((time.process_time() - c) / k)

    roof = {name: [variants[name][1] * n / t / 1e9 for t in times[name]] for name in names if variants[name][2] == "roof"}
    roof_gbs = max(statistics.median(x) for x in roof.values())
    # Per round, the best roofline kernel of that round: ratios robust to slow phases of the host.
    roof_round = [max(x[i] for x in roof.values()) for i in range(args.rounds)]

    rows = []
    for name in names:
        ts = times[name]
        med = statistics.median(ts)
        gbs = variants[name][1] * n / med / 1e9
        rows.append(dict(name=name, ms=med * 1e3, ms_min=min(ts) * 1e3, ms_max=max(ts) * 1e3,
                         cpu_ms=statistics.median(cpu[name]) * 1e3,
                         gparams=n / med / 1e9, gbs=gbs, roof_frac=gbs / roof_gbs,
                         # per-round fraction of that round's triad: robust to slow phases of the host
                         roof_frac_round=statistics.median(
                             variants[name][1] * n / t / 1e9 / rr for t, rr in zip(ts, roof_round))))

    def ratio(ours_name, group):
        # Median over rounds of (best competitor time / our time) in that round.
        others = [x for x in names if variants[x][2] == group and x != ours_name]
        per_round = [min(times[o][i] for o in others) / times[ours_name][i] for i in range(args.rounds)]
        best = min(others, key=lambda o: statistics.median(times[o]))
        return statistics.median(per_round), best

    r32, best32 = ratio("fp32: offload.AdamW", "fp32")
    r16, best16 = ratio("bf16 update: offload.AdamW", "bf16")
    summary = dict(fp32_speedup_vs_best=r32, fp32_best_other=best32, bf16_speedup_vs_best=r16,
                   bf16_best_other=best16, roofline_gbs=roof_gbs)
    _print(n, rows, summary, args)
    return dict(rows=rows, summary=summary, times=times, cpu=cpu)


def _print(n, rows, s, args):
    print(f"\n## {n / 1e6:g}M params, {args.threads} threads, {args.rounds} interleaved rounds")
    print("| variant | ms/step (median) | min-max | CPU ms/step | Gparam/s | GB/s (counted) | % roofline "
          "| % roofline (per round) |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['name']} | {r['ms']:.1f} | {r['ms_min']:.1f}-{r['ms_max']:.1f} | {r['cpu_ms']:.0f} | "
              f"{r['gparams']:.3f} | "
              f"{r['gbs']:.1f} | {100 * r['roof_frac']:.0f}% | {100 * r['roof_frac_round']:.0f}% |")
    print(f"\nroofline {s['roofline_gbs']:.1f} GB/s; fp32: offload.AdamW is {s['fp32_speedup_vs_best']:.2f}x "
          f"the best other ({s['fp32_best_other']}); bf16 update: {s['bf16_speedup_vs_best']:.2f}x the best "
          f"assembled ({s['bf16_best_other']}) [median of per-round ratios]")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
