"""`offload bench nvme`: sequential read/write GB/s of the aio engine over block size x queue depth,
with fio's figures for the same file, block size and depth (direct=1) measured in the same run.

Every measurement uses O_DIRECT, so the page cache plays no part and nothing needs dropping.
Engine and fio alternate within each configuration (and their order flips every round), so
background load hits both alike. GB/s are decimal (1e9 bytes/s), as fio reports them.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import statistics
import subprocess
import time
from typing import Callable

import torch

from ..store.aio import AioEngine, aligned_empty, parse_size

DEFAULT_BLOCK_SIZES = ["128KiB", "512KiB", "1MiB", "4MiB", "8MiB"]
DEFAULT_QUEUE_DEPTHS = [1, 4, 16, 64]
_MAX_BUFFER = 1 << 30  # host buffer the engine reads into / writes from (the file is cycled through it)


@dataclasses.dataclass
class NvmeBenchConfig:
    path: str                                  # directory on the disk under test (a file is created there)
    size: int = 1 << 30                        # bytes of the test file
    block_sizes: list[int] = dataclasses.field(default_factory=lambda: [parse_size(s) for s in DEFAULT_BLOCK_SIZES])
    queue_depths: list[int] = dataclasses.field(default_factory=lambda: list(DEFAULT_QUEUE_DEPTHS))
    workers: int = 1                           # engine submitting threads (fio runs one job)
    backend: str = "auto"
    rounds: int = 2                            # alternating engine/fio rounds per configuration; the median counts
    fio: bool = True                           # run fio when installed
    fio_ioengine: str = "io_uring"
    ops: tuple[str, ...] = ("read", "write")
    deepspeed: bool = False                    # also time DeepSpeed's AsyncIOBuilder handle (if it builds)


def _gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


def _fio_version() -> str | None:
    exe = shutil.which("fio")
    if exe is None:
        return None
    try:
        return subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return None


def run_fio(path: str, op: str, block_size: int, queue_depth: int, size: int, ioengine: str) -> float:
    """fio's sequential `op` bandwidth (GB/s) over `size` bytes of `path` with direct=1, one job."""
    cmd = ["fio", "--name=offload-bench", f"--filename={path}", f"--rw={op}", f"--bs={block_size}",
           f"--iodepth={queue_depth}", f"--ioengine={ioengine}", "--direct=1", f"--size={size}",
           "--numjobs=1", "--output-format=json"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if res.returncode != 0:
        raise RuntimeError(f"fio failed ({' '.join(cmd)}): {res.stderr.strip() or res.stdout[-500:]}")
    job = json.loads(res.stdout[res.stdout.index("{"):])["jobs"][0]
    return job[op]["bw_bytes"] / 1e9


class _EngineRunner:
    """Streams the whole file through one host buffer, two half-buffer windows in flight, so the
    engine's queue never runs dry at a window boundary."""

    def __init__(self, path: str, size: int, buf: torch.Tensor):
        self.path, self.size, self.buf = path, size, buf

    def run(self, op: str, block_size: int, queue_depth: int, workers: int, backend: str) -> float:
        half = self.buf.numel() // 2 // block_size * block_size or block_size
        with AioEngine(block_size=block_size, queue_depth=queue_depth, workers=workers, backend=backend) as eng:
            with eng.open(self.path, "r+") as f:
                submit = eng.write if op == "write" else eng.read
                pending: list = []
                t0 = time.perf_counter()
                pos, k = 0, 0
                while pos < self.size:
                    n = min(half, self.size - pos)
                    if len(pending) == 2:
                        pending.pop(0).wait()  # the half-buffer is about to be reused by the next window
                    pending.append(submit(f, pos, self.buf[(k % 2) * half:(k % 2) * half + n]))
                    pos += n
                    k += 1
                for h in pending:
                    h.wait()  # the timing covers every byte
                return _gbps(self.size, time.perf_counter() - t0)


class _DeepSpeedRunner:
    """DeepSpeed's async I/O handle (AsyncIOBuilder, libaio) on the same file and buffer: block size and
    queue depth as given, intra_op_parallelism = workers, whole buffer per synchronous call."""

    def __init__(self, path: str, size: int, buf: torch.Tensor):
        from deepspeed.ops.op_builder import AsyncIOBuilder  # type: ignore  # optional baseline

        builder = AsyncIOBuilder()
        if not builder.is_compatible():
            raise RuntimeError("DeepSpeed AsyncIOBuilder is not compatible here (libaio-dev missing?)")
        self.aio = builder.load(verbose=False)
        self.path, self.size, self.buf = path, size, buf

    def run(self, op: str, block_size: int, queue_depth: int, workers: int) -> float:
        handle = self.aio.aio_handle(block_size, queue_depth, False, True, workers)
        t0 = time.perf_counter()
        pos = 0
        while pos < self.size:
            n = min(self.buf.numel(), self.size - pos)
            view = self.buf[:n]
            rc = handle.sync_pwrite(view, self.path, pos) if op == "write" else handle.sync_pread(view, self.path, pos)
            if rc < 0:
                raise RuntimeError(f"DeepSpeed aio {op} failed (rc {rc})")
            pos += n
        return _gbps(self.size, time.perf_counter() - t0)


def run_nvme_bench(cfg: NvmeBenchConfig, log: Callable[[str], None] = print) -> dict:
    os.makedirs(cfg.path, exist_ok=True)
    free = shutil.disk_usage(cfg.path).free
    if free < cfg.size + (256 << 20):
        raise RuntimeError(f"offload bench nvme: {cfg.path} has {free / 2**30:.1f} GiB free, the test file needs "
                           f"{cfg.size / 2**30:.1f} GiB plus 0.25 GiB headroom; pass a smaller --size")
    bad = [b for b in cfg.block_sizes if b % 4096 or b <= 0]
    if bad:
        raise ValueError(f"offload bench nvme: block sizes must be positive multiples of 4096, got {bad}")
    if cfg.size % max(cfg.block_sizes):
        raise ValueError(f"offload bench nvme: --size must be a multiple of the largest block size "
                         f"({max(cfg.block_sizes)} bytes), got {cfg.size}")
    fio_version = _fio_version() if cfg.fio else None
    path = os.path.join(cfg.path, f"offload-bench-nvme-{os.getpid()}.bin")
    buf = aligned_empty(min(cfg.size, _MAX_BUFFER))
    buf.copy_(torch.randint(0, 256, (buf.numel(),), dtype=torch.uint8))  # also faults the pages in
    runner = _EngineRunner(path, cfg.size, buf)
    sweep = []
    backend = None
    try:
        with AioEngine(block_size="4MiB", queue_depth=8, backend=cfg.backend) as eng:
            backend = eng.backend
            with eng.open(path, "x+") as f:
                eng.fallocate(f, cfg.size)
        runner.run("write", 4 << 20, 8, 1, cfg.backend)  # lay the file out: later writes overwrite, as fio's do
        ds = None
        ds_note = "not requested (--deepspeed)"
        if cfg.deepspeed:
            try:
                ds = _DeepSpeedRunner(path, cfg.size, buf)
                ds_note = "AsyncIOBuilder (libaio)"
            except Exception as exc:  # optional baseline: say why it is missing, measure the rest
                ds_note = f"unavailable: {type(exc).__name__}: {exc}"
        log(f"deepspeed: {ds_note}")
        log(f"nvme bench: {cfg.size / 2**30:.2f} GiB file {path}, engine backend {backend}, "
            f"fio {'(' + fio_version + ', ioengine ' + cfg.fio_ioengine + ')' if fio_version else 'not run'}")
        log(f"{'op':<6}{'block':>9}{'qd':>5}{'engine GB/s':>13}{'fio GB/s':>10}{'ratio':>7}{'  DS GB/s' if ds else ''}")
        for op in cfg.ops:
            for bs in cfg.block_sizes:
                for qd in cfg.queue_depths:
                    eng_runs, fio_runs, ds_runs = [], [], []
                    for r in range(cfg.rounds):
                        order = ("engine", "fio", "deepspeed") if r % 2 == 0 else ("deepspeed", "fio", "engine")
                        for who in order:
                            if who == "engine":
                                eng_runs.append(runner.run(op, bs, qd, cfg.workers, cfg.backend))
                            elif who == "fio" and fio_version:
                                fio_runs.append(run_fio(path, op, bs, qd, cfg.size, cfg.fio_ioengine))
                            elif who == "deepspeed" and ds is not None:
                                ds_runs.append(ds.run(op, bs, qd, cfg.workers))
                    row = {"op": op, "block_size": bs, "queue_depth": qd,
                           "engine_gbps": statistics.median(eng_runs), "engine_runs": eng_runs}
                    if fio_runs:
                        row["fio_gbps"] = statistics.median(fio_runs)
                        row["fio_runs"] = fio_runs
                        row["ratio"] = row["engine_gbps"] / row["fio_gbps"]
                    if ds_runs:
                        row["deepspeed_gbps"] = statistics.median(ds_runs)
                        row["deepspeed_runs"] = ds_runs
                    sweep.append(row)
                    fio_s = f"{row['fio_gbps']:10.3f}{row['ratio']:7.2f}" if fio_runs else f"{'-':>10}{'-':>7}"
                    ds_s = f"{row['deepspeed_gbps']:8.3f}" if ds_runs else ""
                    log(f"{op:<6}{bs // 1024:>8}K{qd:>5}{row['engine_gbps']:13.3f}{fio_s}{ds_s}")
    finally:
        if os.path.exists(path):
            os.unlink(path)
    result = _summarize(cfg, backend, fio_version, sweep)
    result["deepspeed"] = ds_note
    return result


def _summarize(cfg: NvmeBenchConfig, backend: str | None, fio_version: str | None, sweep: list[dict]) -> dict:
    out: dict = {"backend": backend, "path": cfg.path, "size": cfg.size, "workers": cfg.workers,
                 "rounds": cfg.rounds, "gb": "1e9 bytes",
                 "fio": {"version": fio_version, "ioengine": cfg.fio_ioengine, "direct": 1, "numjobs": 1}
                 if fio_version else None}
    for op in cfg.ops:
        rows = [r for r in sweep if r["op"] == op]
        if not rows:
            continue
        best = max(rows, key=lambda r: r["engine_gbps"])
        out[f"{op}_gbps"] = best["engine_gbps"]
        out[f"best_{op}"] = {"block_size": best["block_size"], "queue_depth": best["queue_depth"]}
        fio_rows = [r for r in rows if "fio_gbps" in r]
        if fio_rows:
            fbest = max(fio_rows, key=lambda r: r["fio_gbps"])
            out[f"fio_{op}_gbps"] = fbest["fio_gbps"]
            out[f"fio_best_{op}"] = {"block_size": fbest["block_size"], "queue_depth": fbest["queue_depth"]}
            out[f"{op}_vs_fio_best"] = best["engine_gbps"] / fbest["fio_gbps"]
            # Paired per-configuration ratios are less at the mercy of one lucky run than best vs best.
            ratios = [r["ratio"] for r in fio_rows]
            out[f"{op}_ratio_geomean"] = math.exp(sum(math.log(x) for x in ratios) / len(ratios))
            out[f"{op}_ratio_min"] = min(ratios)
        ds_rows = [r for r in rows if "deepspeed_gbps" in r]
        if ds_rows:
            dbest = max(ds_rows, key=lambda r: r["deepspeed_gbps"])
            out[f"deepspeed_{op}_gbps"] = dbest["deepspeed_gbps"]
            out[f"deepspeed_best_{op}"] = {"block_size": dbest["block_size"], "queue_depth": dbest["queue_depth"]}
            out[f"{op}_vs_deepspeed_best"] = best["engine_gbps"] / dbest["deepspeed_gbps"]
    out["sweep"] = sweep
    return out
