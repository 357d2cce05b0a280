"""`offload bench nvme`: sequential read/write GB/s of the aio engine over block size x queue depth,
with fio's figures for the same file, block size and depth (direct=1) measured in the same run, and what a
pure-Python offloader gets: aiofiles (asyncio over a thread pool) with `queue depth` tasks reading or
writing the same blocks, O_DIRECT too.

Every measurement uses O_DIRECT, so the page cache plays no part and nothing needs dropping.
Engine and fio alternate within each configuration (and their order flips every round), so
background load hits both alike. GB/s are decimal (1e9 bytes/s), as fio reports them.
"""
from __future__ import annotations

import asyncio
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

from ..errors import InputError
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
    stream: bool = True                        # also time the large-buffer pattern (the store's)
    deepspeed: bool = False                    # also time DeepSpeed's AsyncIOBuilder handle (if it builds)
    aiofiles: bool = True                      # also time aiofiles (asyncio + threads): the pure-Python way


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
    """Times the engine over the whole file in two buffer patterns:

    ring:   like fio, a host buffer of queue_depth x block_size slots reused round robin (one request
            per block, submitted in windows of 256 so the queue never runs dry). Same memory footprint as
            fio's, which matters on virtual disks, where the VMM's copy is faster for a cache-hot buffer.
    stream: the store's pattern: the file streamed through one large buffer, two half-buffer requests
            in flight, each cut into blocks by the engine.
    """

    _WINDOW = 256

    def __init__(self, path: str, size: int, buf: torch.Tensor):
        self.path, self.size, self.buf = path, size, buf

    def run(self, op: str, block_size: int, queue_depth: int, workers: int, backend: str,
            pattern: str = "ring") -> float:
        with AioEngine(block_size=block_size, queue_depth=queue_depth, workers=workers, backend=backend) as eng:
            with eng.open(self.path, "r+") as f:
                many = eng.write_many if op == "write" else eng.read_many
                if pattern == "ring":
                    slots = [self.buf[i * block_size:(i + 1) * block_size] for i in range(queue_depth)]
                    items = [(f, o, slots[i % queue_depth]) for i, o in enumerate(range(0, self.size, block_size))]
                    windows = [items[k:k + self._WINDOW] for k in range(0, len(items), self._WINDOW)]
                else:
                    half = self.buf.numel() // 2 // block_size * block_size or block_size
                    windows = [[(f, pos, self.buf[(k % 2) * half:(k % 2) * half + min(half, self.size - pos)])]
                               for k, pos in enumerate(range(0, self.size, half))]
                pending: list = []
                t0 = time.perf_counter()
                for w in windows:
                    if len(pending) == 2:
                        pending.pop(0).wait()  # stream: that half-buffer is reused next; ring: bounds the backlog
                    pending.append(many(w))
                for h in pending:
                    h.wait()  # the timing covers every byte
                return _gbps(self.size, time.perf_counter() - t0)


class _DeepSpeedRunner:
    """DeepSpeed's async I/O handle (AsyncIOBuilder, libaio) on the same file: block size and queue depth
    as given, intra_op_parallelism = workers, one large page-locked tensor per synchronous call (the
    same pattern as the engine's stream runs)."""

    def __init__(self, path: str, size: int, buf: torch.Tensor):
        from deepspeed.ops.op_builder import AsyncIOBuilder  # type: ignore  # optional baseline

        builder = AsyncIOBuilder()
        if not builder.is_compatible():
            raise RuntimeError("DeepSpeed AsyncIOBuilder is not compatible here (libaio-dev missing?)")
        self.aio = builder.load(verbose=False)
        self.path, self.size, self.buf = path, size, buf

    def run(self, op: str, block_size: int, queue_depth: int, workers: int) -> float:
        handle = self.aio.aio_handle(block_size, queue_depth, False, True, workers)
        # DeepSpeed copies through a bounce buffer unless the tensor is page-locked by its own manager:
        # give it one (outside the timing) so it runs at its best.
        n = min(self.buf.numel(), self.size)
        locked = handle.new_cpu_locked_tensor(n, self.buf[:1])
        try:
            locked.copy_(self.buf[:n])
            t0 = time.perf_counter()
            pos = 0
            while pos < self.size:
                m = min(n, self.size - pos)
                view = locked[:m]
                rc = handle.sync_pwrite(view, self.path, pos) if op == "write" else handle.sync_pread(view, self.path, pos)
                if rc < 0:
                    raise RuntimeError(f"DeepSpeed aio {op} failed (rc {rc})")
                pos += m
            return _gbps(self.size, time.perf_counter() - t0)
        finally:
            handle.free_cpu_locked_tensor(locked)


class _AiofilesRunner:
    """aiofiles on the same file: `queue_depth` asyncio tasks, each with its own O_DIRECT file object, take the
    next block in turn (seek + readinto / write of an aligned slice of the same buffer); aiofiles runs each call
    on the event loop's thread pool. What an offloader written in Python alone would do."""

    def __init__(self, path: str, size: int, buf: torch.Tensor):
        self.path, self.size = path, size
        self.view = memoryview(buf.numpy())

    def run(self, op: str, block_size: int, queue_depth: int) -> float:
        return asyncio.run(self._run(op, block_size, queue_depth))

    async def _run(self, op: str, block_size: int, queue_depth: int) -> float:
        import aiofiles

        blocks = iter(range(0, self.size, block_size))
        span = len(self.view) // block_size * block_size  # the file is cycled through the buffer

        def opener(path, flags):
            return os.open(path, flags | os.O_DIRECT)

        async def worker():
            async with aiofiles.open(self.path, "r+b" if op == "write" else "rb", buffering=0, opener=opener) as f:
                for off in blocks:  # (one shared iterator: each task takes the next block)
                    await f.seek(off)
                    piece = self.view[off % span:off % span + block_size]
                    n = await (f.write(piece) if op == "write" else f.readinto(piece))
                    if n != block_size:
                        raise OSError(f"aiofiles {op} at {off}: {n} of {block_size} bytes")

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(queue_depth)))
        if op == "write":
            os.sync()  # (O_DIRECT: the data is on the device; the metadata as fio's end_fsync would)
        return _gbps(self.size, time.perf_counter() - t0)


def run_nvme_bench(cfg: NvmeBenchConfig, log: Callable[[str], None] = print) -> dict:
    os.makedirs(cfg.path, exist_ok=True)
    free = shutil.disk_usage(cfg.path).free
    if free < cfg.size + (256 << 20):
        raise RuntimeError(f"offload bench nvme: {cfg.path} has {free / 2**30:.1f} GiB free, the test file needs "
                           f"{cfg.size / 2**30:.1f} GiB plus 0.25 GiB headroom; pass a smaller --size")
    bad = [b for b in cfg.block_sizes if b % 4096 or b <= 0]
    if bad:
        raise InputError(f"offload bench nvme: block sizes must be positive multiples of 4096, got {bad}")
    if cfg.size % max(cfg.block_sizes):
        raise InputError(f"offload bench nvme: --size must be a multiple of the largest block size "
                         f"({max(cfg.block_sizes)} bytes), got {cfg.size}")
    fio_version = _fio_version() if cfg.fio else None
    path = os.path.join(cfg.path, f"offload-bench-nvme-{os.getpid()}.bin")
    buf = aligned_empty(max(min(cfg.size, _MAX_BUFFER), max(cfg.block_sizes) * max(cfg.queue_depths)))
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
        py = _AiofilesRunner(path, cfg.size, buf) if cfg.aiofiles else None
        log(f"nvme bench: {cfg.size / 2**30:.2f} GiB file {path}, engine backend {backend}, "
            f"fio {'(' + fio_version + ', ioengine ' + cfg.fio_ioengine + ')' if fio_version else 'not run'}")
        log(f"{'op':<6}{'block':>9}{'qd':>5}{'engine GB/s':>13}{'fio GB/s':>10}{'ratio':>7}{' stream' if cfg.stream else ''}{'  DS(str)' if ds else ''}{' aiofiles' if py else ''}")
        for op in cfg.ops:
            for bs in cfg.block_sizes:
                for qd in cfg.queue_depths:
                    eng_runs, fio_runs, ds_runs, stream_runs, py_runs = [], [], [], [], []
                    for r in range(cfg.rounds):
                        order = ("engine", "fio", "stream", "deepspeed", "aiofiles")
                        for who in order if r % 2 == 0 else order[::-1]:
                            if who == "engine":
                                eng_runs.append(runner.run(op, bs, qd, cfg.workers, cfg.backend, "ring"))
                            elif who == "stream" and cfg.stream:
                                stream_runs.append(runner.run(op, bs, qd, cfg.workers, cfg.backend, "stream"))
                            elif who == "fio" and fio_version:
                                fio_runs.append(run_fio(path, op, bs, qd, cfg.size, cfg.fio_ioengine))
                            elif who == "deepspeed" and ds is not None:
                                ds_runs.append(ds.run(op, bs, qd, cfg.workers))
                            elif who == "aiofiles" and py is not None:
                                py_runs.append(py.run(op, bs, qd))
                    row = {"op": op, "block_size": bs, "queue_depth": qd,
                           "engine_gbps": statistics.median(eng_runs), "engine_runs": eng_runs}
                    if fio_runs:
                        row["fio_gbps"] = statistics.median(fio_runs)
                        row["fio_runs"] = fio_runs
                        row["ratio"] = row["engine_gbps"] / row["fio_gbps"]
                    if stream_runs:
                        row["engine_stream_gbps"] = statistics.median(stream_runs)
                        row["engine_stream_runs"] = stream_runs
                    if ds_runs:
                        row["deepspeed_gbps"] = statistics.median(ds_runs)
                        row["deepspeed_runs"] = ds_runs
                    if py_runs:
                        row["aiofiles_gbps"] = statistics.median(py_runs)
                        row["aiofiles_runs"] = py_runs
                    sweep.append(row)
                    fio_s = f"{row['fio_gbps']:10.3f}{row['ratio']:7.2f}" if fio_runs else f"{'-':>10}{'-':>7}"
                    st_s = f"{row['engine_stream_gbps']:9.3f}" if stream_runs else ""
                    ds_s = f"{row['deepspeed_gbps']:9.3f}" if ds_runs else ""
                    py_s = f"{row['aiofiles_gbps']:9.3f}" if py_runs else ""
                    log(f"{op:<6}{bs // 1024:>8}K{qd:>5}{row['engine_gbps']:13.3f}{fio_s}{st_s}{ds_s}{py_s}")
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
        st_rows = [r for r in rows if "engine_stream_gbps" in r]
        if st_rows:
            sbest = max(st_rows, key=lambda r: r["engine_stream_gbps"])
            out[f"stream_{op}_gbps"] = sbest["engine_stream_gbps"]
            out[f"stream_best_{op}"] = {"block_size": sbest["block_size"], "queue_depth": sbest["queue_depth"]}
        py_rows = [r for r in rows if "aiofiles_gbps" in r]
        if py_rows:  # the engine against the pure-Python way, configuration by configuration
            out[f"aiofiles_{op}_gbps"] = max(r["aiofiles_gbps"] for r in py_rows)
            out[f"{op}_vs_aiofiles_geomean"] = math.exp(sum(math.log(r["engine_gbps"] / r["aiofiles_gbps"])
                                                            for r in py_rows) / len(py_rows))
        ds_rows = [r for r in rows if "deepspeed_gbps" in r]
        if ds_rows:
            dbest = max(ds_rows, key=lambda r: r["deepspeed_gbps"])
            out[f"deepspeed_{op}_gbps"] = dbest["deepspeed_gbps"]
            out[f"deepspeed_best_{op}"] = {"block_size": dbest["block_size"], "queue_depth": dbest["queue_depth"]}
            # DeepSpeed takes one large tensor per call: compare it with the engine's stream pattern
            if st_rows:
                out[f"stream_{op}_vs_deepspeed_best"] = sbest["engine_stream_gbps"] / dbest["deepspeed_gbps"]
    out["sweep"] = sweep
    return out


def run_striped_bench(paths: list[str], size: int, block_size: int = 1 << 20, queue_depth: int = 32,
                      backend: str = "auto", log: Callable[[str], None] = print) -> dict:
    """Several drives at once (the store's stream pattern on one file per path, all concurrently, one engine
    and one buffer each): each path alone, then all together; GB/s of all the bytes over the wall time."""
    import threading

    files, runners = [], []
    try:
        for k, directory in enumerate(paths):
            os.makedirs(directory, exist_ok=True)
            path = os.path.join(directory, f"offload-bench-stripe-{os.getpid()}-{k}.bin")
            buf = aligned_empty(max(min(size, 256 << 20), block_size * 2))
            buf.copy_(torch.randint(0, 256, (buf.numel(),), dtype=torch.uint8))
            with AioEngine(block_size="4MiB", queue_depth=8, backend=backend) as eng:
                with eng.open(path, "x+") as f:
                    eng.fallocate(f, size)
            files.append(path)
            runner = _EngineRunner(path, size, buf)
            runner.run("write", 4 << 20, 8, 1, backend)  # lay the file out
            runners.append(runner)
        out: dict = {"paths": list(paths), "size_per_path": size, "block_size": block_size,
                     "queue_depth": queue_depth}
        for op in ("write", "read"):
            alone = [r.run(op, block_size, queue_depth, 1, backend, "stream") for r in runners]
            errors: list[BaseException] = []

            def one(r):
                try:
                    r.run(op, block_size, queue_depth, 1, backend, "stream")
                except BaseException as exc:  # noqa: BLE001 - reported by the caller's thread
                    errors.append(exc)

            threads = [threading.Thread(target=one, args=(r,)) for r in runners]
            t0 = time.perf_counter()
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            wall = time.perf_counter() - t0
            if errors:
                raise errors[0]
            out[f"{op}_alone_gbps"] = alone
            out[f"{op}_striped_gbps"] = _gbps(size * len(runners), wall)
            log(f"striped {op}: {out[f'{op}_striped_gbps']:.3f} GB/s over {len(paths)} path(s) at once; alone: "
                + ", ".join(f"{g:.3f}" for g in alone))
        return out
    finally:
        for path in files:
            if os.path.exists(path):
                os.unlink(path)

