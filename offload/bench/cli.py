"""The `offload bench` command group. Each benchmark adds one subcommand here."""
from __future__ import annotations

import argparse
import json
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


def _machine() -> dict:
    import os

    import torch

    return {"python": platform.python_version(), "torch": torch.__version__, "kernel": platform.release(),
            "cpus": os.cpu_count(), "machine": platform.machine()}


def _cmd_nvme(args: argparse.Namespace) -> int:
    from .nvme import DEFAULT_BLOCK_SIZES, DEFAULT_QUEUE_DEPTHS, NvmeBenchConfig, run_nvme_bench

    cfg = NvmeBenchConfig(
        path=args.path,
        size=parse_size(args.size, "--size"),
        block_sizes=args.block_sizes or [parse_size(s) for s in DEFAULT_BLOCK_SIZES],
        queue_depths=args.queue_depths or list(DEFAULT_QUEUE_DEPTHS),
        workers=args.workers,
        backend=args.backend,
        rounds=args.rounds,
        fio=not args.no_fio,
        fio_ioengine=args.fio_ioengine,
        ops=tuple(args.ops),
        deepspeed=args.deepspeed,
    )
    result = {"nvme": run_nvme_bench(cfg), "machine": _machine(), "command": " ".join(["offload"] + sys.argv[1:])}
    nv = result["nvme"]
    for op in cfg.ops:
        line = f"best {op}: {nv[f'{op}_gbps']:.3f} GB/s at {nv[f'best_{op}']}"
        if f"fio_{op}_gbps" in nv:
            line += f"; fio best {nv[f'fio_{op}_gbps']:.3f} GB/s at {nv[f'fio_best_{op}']} -> {nv[f'{op}_vs_fio_best']:.0%}"
        if f"deepspeed_{op}_gbps" in nv:
            line += f"; DeepSpeed best {nv[f'deepspeed_{op}_gbps']:.3f} GB/s -> {nv[f'{op}_vs_deepspeed_best']:.0%}"
        print(line)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=2)
        print(f"wrote {args.json}")
    return 0


def add_bench_parser(subparsers) -> None:
    bench = subparsers.add_parser("bench", help="measure this machine (writes JSON the planner reads)")
    sub = bench.add_subparsers(dest="bench_command", metavar="BENCH")
    bench.set_defaults(func=lambda args: (bench.print_help(), 2)[1])

    nvme = sub.add_parser("nvme", help="sequential read/write GB/s of the aio engine vs block size and queue "
                                       "depth, with fio side by side")
    nvme.add_argument("--path", required=True, help="directory on the disk to test (a temporary file goes there)")
    nvme.add_argument("--size", default="1GiB", help="test file size (default 1GiB)")
    nvme.add_argument("--json", help="write the results here")
    nvme.add_argument("--block-sizes", type=_csv(parse_size), default=None,
                      help="comma list, default 128KiB,512KiB,1MiB,4MiB,8MiB")
    nvme.add_argument("--queue-depths", type=_csv(int), default=None, help="comma list, default 1,4,16,64")
    nvme.add_argument("--workers", type=int, default=1, help="engine submitting threads (default 1, as one fio job)")
    nvme.add_argument("--backend", default="auto", choices=["auto", "io_uring", "threads", "python"])
    nvme.add_argument("--rounds", type=int, default=2, help="alternating engine/fio runs per configuration (median)")
    nvme.add_argument("--ops", type=_csv(str), default=["read", "write"], help="read,write (default both)")
    nvme.add_argument("--no-fio", action="store_true", help="skip fio even when installed")
    nvme.add_argument("--deepspeed", action="store_true",
                      help="also time DeepSpeed's AsyncIOBuilder handle (pip install deepspeed; needs libaio-dev)")
    nvme.add_argument("--fio-ioengine", default="io_uring", choices=["io_uring", "libaio", "psync"])
    nvme.set_defaults(func=_cmd_nvme)
