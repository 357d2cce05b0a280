"""The `offload bench` command group. Each benchmark adds one subcommand here."""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys

from ..store.aio import parse_size


def _csv(convert):
    def parse(text: str) -> list:
        try:
            return [convert(x) for x in text.split(",") if x.strip()]
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    return parse


def _existing_dirs(paths) -> None:
    """--path names a directory on the drive to test: one that does not exist (a typo) is refused, never created
    (the bench then ran for minutes in a directory of its own making and left it behind)."""
    from ..errors import InputError

    for path in paths or ():
        if not os.path.isdir(path):
            what = "is not a directory" if os.path.exists(path) else "does not exist"
            raise InputError(f"--path {path} {what}; give an existing directory on the drive to test")


def _machine() -> dict:
    """The machine the figures are from: CPU, RAM, GPUs and driver, filesystems."""
    import os

    import psutil
    import torch

    cpu_model = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            cpu_model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu_model)
    except OSError:
        pass
    gpus = [torch.cuda.get_device_name(d) for d in range(torch.cuda.device_count())] if torch.cuda.is_available() else []
    filesystems = [{"mount": p.mountpoint, "fstype": p.fstype, "device": p.device}
                   for p in psutil.disk_partitions(all=False)]
    return {"python": platform.python_version(), "torch": torch.__version__, "kernel": platform.release(),
            "cpus": os.cpu_count(), "cpu_model": cpu_model, "machine": platform.machine(),
            "ram_bytes": psutil.virtual_memory().total, "gpus": gpus, "cuda": torch.version.cuda,
            "filesystems": filesystems}


def _bar(total: int, desc: str):
    from tqdm import tqdm

    bar = tqdm(total=total, desc=desc, leave=False, dynamic_ncols=True)
    return bar, bar.update


def _write(result: dict, args: argparse.Namespace) -> None:
    result.setdefault("machine", _machine())
    result.setdefault("command", " ".join(["offload"] + sys.argv[1:]))
    if getattr(args, "json", None):
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=2)
        print(f"wrote {args.json}")
    if getattr(args, "plot", None):
        from .plot import plot_results

        plot_results(result, args.plot)
        print(f"wrote {args.plot}")


def _output_problem(path: str) -> str | None:
    """Why `path` cannot be written (the file is opened for append, so nothing is truncated; a file made
    here is removed again), or None."""
    import os

    if os.path.isdir(path):
        return "is a directory; give a file name"
    existed = os.path.exists(path)
    try:
        open(path, "ab").close()
    except OSError as exc:
        return f"cannot be written ({exc.strerror}); give a path in an existing, writable directory"
    if not existed:
        os.unlink(path)
    return None


def _check_outputs(args: argparse.Namespace) -> str | None:
    """The --json / --plot outputs are written after the measurements, which take minutes: a path or a
    plotting library that would fail then is reported now instead. One line, or None."""
    import os

    if getattr(args, "json", None):
        why = _output_problem(args.json)
        if why:
            return f"--json {args.json}: {why}"
    plot = getattr(args, "plot", None)
    if not plot:
        return None
    try:
        import matplotlib
        from matplotlib.backend_bases import FigureCanvasBase
    except ImportError as exc:
        return f"--plot {plot}: matplotlib cannot be imported ({exc}); pip install matplotlib, or drop --plot"
    ext = os.path.splitext(plot)[1].lstrip(".").lower()
    kinds = FigureCanvasBase.get_supported_filetypes()
    if ext and ext not in kinds:
        return f"--plot {plot}: matplotlib {matplotlib.__version__} cannot write .{ext} images; end the name in .png"
    why = _output_problem(plot)
    return f"--plot {plot}: {why}" if why else None


def _checked(cmd):
    def run(args: argparse.Namespace) -> int:
        problem = _check_outputs(args)
        if problem:
            print(f"offload bench: error: {problem}", file=sys.stderr)
            return 2
        return cmd(args)
    return run


def _emit(key: str, r: dict, args: argparse.Namespace, result: dict | None) -> int:
    """Add one bench's result under `key`: into `result` when `offload bench all` collects them, else written
    out on its own (JSON, plot)."""
    if result is not None:
        result[key] = r
    else:
        _write({key: r}, args)
    return 0


def _cmd_memcpy(args: argparse.Namespace, result: dict | None = None) -> int:
    import os

    import torch

    from .host import memcpy_bench

    sizes = args.sizes or [parse_size("64MiB"), parse_size("256MiB")]
    threads = sorted({1, 2, 4, 8, 16, os.cpu_count() or 1} & set(range(1, (os.cpu_count() or 1) + 1)))
    bar, tick = _bar(len(sizes) * len(threads) * (2 if torch.cuda.is_available() else 1), "memcpy")
    r = memcpy_bench(sizes, threads, args.rounds, tick)
    bar.close()
    print(f"{'memory':<9} {'size':>9} {'threads':>7} {'impl':<8} {'GB/s':>7}")
    for row in r["rows"]:
        print(f"{row['memory']:<9} {row['bytes'] >> 20:>7}Mi {row['threads']:>7} {row['impl']:<8} {row['GBps']:>7.2f}")
    if not r["pinned_tested"]:
        print("pinned: not measured (page-locking host memory needs a CUDA driver)")
    return _emit("memcpy", r, args, result)


def _cmd_adam(args: argparse.Namespace, result: dict | None = None) -> int:
    from .host import adam_bench

    r = adam_bench(int(args.numel), args.rounds)
    print(f"fused CPU AdamW (bf16 grad in, bf16 param out): {r['offload_params_per_s'] / 1e9:.2f} G params/s "
          f"({r['offload_GBps']:.1f} GB/s); torch fused AdamW (fp32): {r['torch_fused_params_per_s'] / 1e9:.2f} "
          f"G params/s ({r['torch_fused_GBps']:.1f} GB/s); {r['speedup']:.2f}x")
    return _emit("adam", r, args, result)


def _cmd_pcie(args: argparse.Namespace, result: dict | None = None) -> int:
    from .pcie import DEFAULT_SIZES, pcie_bench

    import torch

    if not torch.cuda.is_available():
        print("pcie: no CUDA device on this machine; nothing to measure")
        r = {"available": False, "reason": "no CUDA device"}
    else:
        sizes = args.sizes or DEFAULT_SIZES
        bar, tick = _bar(torch.cuda.device_count() * 2 * len(sizes), "pcie")
        r = pcie_bench(sizes, args.rounds, tick)
        bar.close()
        print(f"{'gpu':>3} {'host mem':<9} {'size':>10} {'h2d GB/s':>9} {'d2h GB/s':>9}")
        for row in r["rows"]:
            print(f"{row['gpu']:>3} {'pinned' if row['pinned'] else 'pageable':<9} {row['bytes']:>10} "
                  f"{row['h2d_GBps']:>9.2f} {row['d2h_GBps']:>9.2f}")
        print(f"both directions at once (pinned, largest size): {r['both_directions_GBps']}")
        together = r["all_gpus"]
        if together:
            per_gpu = ", ".join(f"{g['gpu']}: {g['h2d_GBps']:.2f}/{g['d2h_GBps']:.2f}" for g in together["per_gpu"])
            print(f"all GPUs at once (pinned, {together['bytes_per_copy']} bytes x {together['rounds']} each, "
                  f"bytes over the host's wall clock): h2d {together['h2d_GBps']:.2f} GB/s, d2h "
                  f"{together['d2h_GBps']:.2f} GB/s; each GPU meanwhile (h2d/d2h GB/s) {per_gpu}")
    return _emit("pcie", r, args, result)


def _cmd_all(args: argparse.Namespace) -> int:
    result: dict = {}
    _cmd_pcie(args, result)
    _cmd_memcpy(args, result)
    _cmd_adam(args, result)
    _existing_dirs(args.path)
    if args.path:
        from .nvme import NvmeBenchConfig, run_nvme_bench, run_striped_bench

        result["nvme"] = run_nvme_bench(NvmeBenchConfig(path=args.path[0], size=parse_size("256MiB"), rounds=1))
        nv = result["nvme"]
        print(f"nvme: read {nv['read_gbps']:.2f} GB/s, write {nv['write_gbps']:.2f} GB/s")
        if len(args.path) > 1:
            nv["striped"] = run_striped_bench(args.path, parse_size("256MiB"))
    else:
        print("nvme: skipped (give --path DIR on the drive to test)")
    _write(result, args)
    return 0


def _cmd_nvme(args: argparse.Namespace) -> int:
    from .nvme import DEFAULT_BLOCK_SIZES, DEFAULT_QUEUE_DEPTHS, NvmeBenchConfig, run_nvme_bench, run_striped_bench

    from ..errors import InputError

    _existing_dirs(args.path)
    try:
        size = parse_size(args.size, "--size")
    except ValueError as exc:
        raise InputError(str(exc)) from None
    cfg = NvmeBenchConfig(
        path=args.path[0],
        size=size,
        block_sizes=args.block_sizes or [parse_size(s) for s in DEFAULT_BLOCK_SIZES],
        queue_depths=args.queue_depths or list(DEFAULT_QUEUE_DEPTHS),
        workers=args.workers,
        backend=args.backend,
        rounds=args.rounds,
        fio=not args.no_fio,
        fio_ioengine=args.fio_ioengine,
        ops=tuple(args.ops),
        deepspeed=args.deepspeed,
        stream=not args.no_stream,
        aiofiles=not args.no_aiofiles,
    )
    result = {"nvme": run_nvme_bench(cfg)}
    if len(args.path) > 1:  # several drives: the sweep ran on the first; now all of them at once
        result["nvme"]["striped"] = run_striped_bench(args.path, cfg.size, backend=cfg.backend)
    nv = result["nvme"]
    for op in cfg.ops:
        line = f"best {op}: {nv[f'{op}_gbps']:.3f} GB/s at {nv[f'best_{op}']}"
        if f"fio_{op}_gbps" in nv:
            line += f"; fio best {nv[f'fio_{op}_gbps']:.3f} GB/s at {nv[f'fio_best_{op}']} -> {nv[f'{op}_vs_fio_best']:.0%}"
        if f"stream_{op}_gbps" in nv:
            line += f"; engine stream (large buffer) {nv[f'stream_{op}_gbps']:.3f} GB/s"
        if f"aiofiles_{op}_gbps" in nv:
            line += (f"; aiofiles best {nv[f'aiofiles_{op}_gbps']:.3f} GB/s (engine {nv[f'{op}_vs_aiofiles_geomean']:.1f}x "
                     "it, geomean)")
        if f"deepspeed_{op}_gbps" in nv:
            line += (f"; DeepSpeed best {nv[f'deepspeed_{op}_gbps']:.3f} GB/s -> stream "
                     f"{nv[f'stream_{op}_vs_deepspeed_best']:.0%}")
        print(line)
    _write(result, args)
    return 0


def add_bench_parser(subparsers, help_line: str) -> None:
    bench = subparsers.add_parser("bench", help=help_line)
    sub = bench.add_subparsers(dest="bench_command", metavar="BENCH")
    bench.set_defaults(func=lambda args: (bench.print_help(), 2)[1])

    nvme = sub.add_parser("nvme", help="sequential read/write GB/s of the aio engine vs block size and queue "
                                       "depth, with fio side by side")
    nvme.add_argument("--path", required=True, action="append",
                      help="directory on the disk to test (a temporary file goes there); repeat it for several "
                           "drives: the sweep runs on the first, then every path is streamed at once (striping)")
    nvme.add_argument("--size", default="1GiB", help="test file size (default 1GiB)")
    nvme.add_argument("--json", help="write the results here")
    nvme.add_argument("--plot", help="write a PNG of the sweep here")
    nvme.add_argument("--block-sizes", type=_csv(parse_size), default=None,
                      help="comma list, default 128KiB,512KiB,1MiB,4MiB,8MiB")
    nvme.add_argument("--queue-depths", type=_csv(int), default=None, help="comma list, default 1,4,16,64")
    nvme.add_argument("--workers", type=int, default=1, help="engine submitting threads (default 1, as one fio job)")
    nvme.add_argument("--backend", default="auto", choices=["auto", "io_uring", "threads", "python"],
                      help="the engine's I/O path (default auto: io_uring where the kernel allows it)")
    nvme.add_argument("--rounds", type=int, default=2, help="alternating engine/fio runs per configuration (median)")
    nvme.add_argument("--ops", type=_csv(str), default=["read", "write"], help="read,write (default both)")
    nvme.add_argument("--no-fio", action="store_true", help="skip fio even when installed")
    nvme.add_argument("--no-aiofiles", action="store_true",
                      help="skip the aiofiles runs (asyncio + a thread pool: the pure-Python baseline)")
    nvme.add_argument("--no-stream", action="store_true",
                      help="skip the large-buffer (stream) engine runs; the fio-like ring runs always happen")
    nvme.add_argument("--deepspeed", action="store_true",
                      help="also time DeepSpeed's AsyncIOBuilder handle (pip install deepspeed; needs libaio-dev)")
    nvme.add_argument("--fio-ioengine", default="io_uring", choices=["io_uring", "libaio", "psync"],
                      help="fio's ioengine for the comparison (default io_uring)")
    nvme.set_defaults(func=_checked(_cmd_nvme))

    def common(p, sizes_help=None):
        p.add_argument("--json", help="write the results (and the machine's description) here")
        p.add_argument("--plot", help="write a PNG of the sweeps here")
        p.add_argument("--rounds", type=int, default=5, help="timed repetitions per figure (median)")
        if sizes_help:
            p.add_argument("--sizes", type=_csv(parse_size), default=None, help=sizes_help)

    memcpy = sub.add_parser("memcpy", help="host copy GB/s over kernel threads, pageable and pinned")
    common(memcpy, "comma list of buffer sizes, default 64MiB,256MiB")
    memcpy.set_defaults(func=_checked(_cmd_memcpy))
    adam = sub.add_parser("adam", help="fused CPU AdamW params/s and GB/s vs torch's fused AdamW")
    common(adam)
    adam.add_argument("--numel", type=float, default=2 ** 24, help="parameters per step (default 16.8M)")
    adam.set_defaults(func=_checked(_cmd_adam))
    pcie = sub.add_parser("pcie", help="host<->device GB/s, pinned vs pageable, per GPU and all at once")
    common(pcie, "comma list of sizes, default 4KiB..1GiB")
    pcie.set_defaults(func=_checked(_cmd_pcie))
    every = sub.add_parser("all", help="pcie, memcpy, adam, and nvme when --path is given")
    common(every, "memcpy/pcie sizes")
    every.add_argument("--numel", type=float, default=2 ** 24, help="AdamW parameters per step (default 16.8M)")
    every.add_argument("--path", action="append",
                       help="directory on an NVMe drive for the nvme sweep (repeat for several drives)")
    every.set_defaults(func=_checked(_cmd_all))
