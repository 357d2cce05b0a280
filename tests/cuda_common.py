"""Shared by tests/test_cuda_*.py and tests/cuda_worker.py: the parity harness of zero_common.py on the compute
device, a per-rank launcher for multi-GPU runs, CUDA probes (sleep calibration, primary contexts, profiler
trace intervals) and the figures file benchmarks/gpu_check.sh collects.

Nothing here touches CUDA at import: the GPU test files must import and collect (all skipped) on a CPU box.

Why a device copy of offload_run / reference_run instead of zero_common's: those build their inputs and the
loss accumulator on the host (right on a CPU-only runtime, whose compute device is the CPU); on a GPU the model
computes on `rt.device` and everything it reads must be there. The pieces (Case, models, data, flows,
comparisons) are zero_common's own.
"""
from __future__ import annotations

import contextlib
import copy
import ctypes
import json
import math
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

# cuBLAS is run-to-run deterministic only with a fixed workspace config when it may use several streams (the
# runtime's lanes run on their own streams); read when the first cuBLAS handle is made, so set it at import
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from zero_common import (Case, _bitwise_mismatches, _data, _injected, _rel, make_model,  # noqa: E402
                         offload_run, reference_run, worst_param_error)

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent
WORKER = TESTS / "cuda_worker.py"

# fp32 against plain PyTorch on the GPU: the runtime steps with offload's fused CPU AdamW, the reference with
# torch.optim.AdamW on the GPU (foreach), and cuBLAS/cuDNN reduce in their own order; 1e-5 is the CPU suite's
# bound against the CPU reference. 5e-5 still catches any ordering bug (those give errors of 1e-3 and up).
FP32_TOL = 5e-5
BF16_TOL = 1e-4  # zero_common / test_zero_parity's bf16 bound, against a reference doing the same casts


# ---- figures: printed, and appended to $OFFLOAD_GPU_FIGURES (gpu_check.sh collects them) ---------------------
def record_figure(name: str, **values) -> None:
    line = {"figure": name, **values}
    print(f"[gpu figure] {json.dumps(line, default=str)}", flush=True)
    from offload import env

    path = env.GPU_FIGURES.get()
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(line, default=str) + "\n")


# ---- CUDA probes --------------------------------------------------------------------------------------------
def cycles_per_ms(device=None) -> float:
    """torch.cuda._sleep cycles per millisecond on this GPU now (the clock varies: callers leave a wide margin)."""
    torch.cuda.synchronize(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    cycles = 20_000_000
    torch.cuda._sleep(1_000_000)  # warm-up: the first launch pays for loading the kernel
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    end.synchronize()
    return cycles / max(start.elapsed_time(end), 1e-3)


def sleep_ms(ms: float, per_ms: float) -> None:
    """Queue a kernel on the current stream that spins for about `ms` milliseconds (the host does not wait)."""
    torch.cuda._sleep(int(ms * per_ms))


def primary_context_active(ordinal: int) -> bool | None:
    """Whether this process holds a primary CUDA context on device `ordinal` (driver API, so a stray context
    shows without NVML or nvidia-smi); None where libcuda cannot be asked."""
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
        dev, flags, active = ctypes.c_int(), ctypes.c_uint(), ctypes.c_int()
        if cuda.cuDeviceGet(ctypes.byref(dev), ctypes.c_int(ordinal)) != 0:
            return None
        if cuda.cuDevicePrimaryCtxGetState(dev, ctypes.byref(flags), ctypes.byref(active)) != 0:
            return None
        return bool(active.value)
    except (OSError, AttributeError):
        return None


def trace_intervals(path: str) -> list[dict]:
    """GPU activity of a torch.profiler Chrome trace: [{kind, name, stream, start, end}] in microseconds, kind one
    of "kernel", "h2d", "d2h", "d2d", "nccl" (NCCL kernels are not compute)."""
    events = json.loads(Path(path).read_text())
    events = events.get("traceEvents", events) if isinstance(events, dict) else events
    out = []
    for e in events:
        cat, name = str(e.get("cat", "")).lower(), str(e.get("name", ""))
        if e.get("ph") != "X" or "dur" not in e or cat not in ("kernel", "gpu_memcpy"):
            continue
        if cat == "gpu_memcpy":
            kind = "h2d" if "HtoD" in name else "d2h" if "DtoH" in name else "d2d" if "DtoD" in name else "memcpy"
        else:
            kind = "nccl" if "nccl" in name.lower() else "kernel"
        args = e.get("args") or {}
        stream = args.get("stream", e.get("tid"))
        start = float(e["ts"])
        out.append({"kind": kind, "name": name, "stream": stream, "start": start, "end": start + float(e["dur"])})
    return out


def compute_stream(intervals: list[dict]):
    """The stream with the most kernel time: the training thread's (the model's forward and backward)."""
    busy: dict = {}
    for i in intervals:
        if i["kind"] == "kernel":
            busy[i["stream"]] = busy.get(i["stream"], 0.0) + i["end"] - i["start"]
    return max(busy, key=busy.get) if busy else None


def overlaps(intervals: list[dict], kind_a: str, kind_b: str = "kernel", name_has: str = "", b_stream=None) -> dict:
    """How many `kind_a` intervals (whose name contains `name_has`) overlap in time a `kind_b` interval on
    another stream (only on `b_stream` when given), and the total overlapped microseconds."""
    a = [i for i in intervals if i["kind"] == kind_a and name_has.lower() in i["name"].lower()]
    b = sorted((i for i in intervals if i["kind"] == kind_b and (b_stream is None or i["stream"] == b_stream)),
               key=lambda i: i["start"])
    starts = [i["start"] for i in b]
    import bisect

    count, overlapped = 0, 0.0
    for x in a:
        hit = 0.0
        for y in b[:bisect.bisect_left(starts, x["end"])]:
            if y["end"] > x["start"] and y["stream"] != x["stream"]:
                hit = max(hit, min(x["end"], y["end"]) - max(x["start"], y["start"]))
        if hit > 0:
            count += 1
            overlapped += hit
    return {"intervals": len(a), "overlapping": count, "overlap_us": overlapped}


# ---- a model whose kernels last long enough to see overlap in a profile ---------------------------------------
class MLPBlock(nn.Module):
    def __init__(self, d: int, ff: int):
        super().__init__()
        self.up = nn.Linear(d, ff)
        self.down = nn.Linear(ff, d)

    def forward(self, x):
        return x + self.down(torch.nn.functional.gelu(self.up(x)))


class MLPStack(nn.Module):
    """`layers` residual MLP blocks (one unit each, 8.4M parameters at d=1024): with 8192 tokens each matmul runs
    for about a millisecond in fp32 on an H100, about as long as the block's host->device copy."""

    def __init__(self, d: int = 1024, ff: int = 4096, layers: int = 6):
        super().__init__()
        self.blocks = nn.ModuleList(MLPBlock(d, ff) for _ in range(layers))
        self.norm = nn.LayerNorm(d)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.norm(x)


def mlp_loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).float().pow(2).mean()


def mlp_step(model: nn.Module, rt, opt, x: torch.Tensor) -> None:
    """One training step of the MLP stack under the runtime, clipped as the tests' loops do."""
    mlp_loss(model, x).backward()
    rt.clip_grad_norm_(1.0)
    opt.step()
    opt.zero_grad()


# ---- determinism on the GPU --------------------------------------------------------------------------------
@contextlib.contextmanager
def deterministic():
    """Run-to-run bitwise results for the parity runs: attention by the math backend (the fused backends'
    backward accumulate with atomics in fp32 / bf16), and torch's deterministic kernels where it has them
    (warn_only: none is refused; no NaN fill of new memory, which would change what the runtime does)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    import torch.utils.deterministic as td

    was, was_warn = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    fill = td.fill_uninitialized_memory
    torch.use_deterministic_algorithms(True, warn_only=True)
    td.fill_uninitialized_memory = False
    try:
        with sdpa_kernel(SDPBackend.MATH):
            yield
    finally:
        torch.use_deterministic_algorithms(was, warn_only=was_warn)
        td.fill_uninitialized_memory = fill


# ---- the parity harness on the compute device -----------------------------------------------------------------
def device_run_case(case: Case, nvme_dir: str, against_torch: bool = True) -> dict:
    """zero_common.run_case on the GPU: the synchronous runtime, the pipelined one (with case.delay injected) and,
    when `against_torch`, plain PyTorch on the same device, all from the same init and data."""
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    t0 = time.perf_counter()
    with deterministic():
        torch.manual_seed(1234)
        ref = make_model(case.model)
        model = copy.deepcopy(ref)
        sync_model = copy.deepcopy(ref)
        data = _data(case)
        s_losses, s_snaps, s_norms, _ = offload_run(case, sync_model, data, nvme_dir, pipeline=False)
        with _injected(case.delay):
            o_losses, o_snaps, o_norms, stats = offload_run(case, model, data, nvme_dir, pipeline=True)
        if against_torch:
            r_losses, r_snaps, r_norms = reference_run(case, ref, data, device)
    out = {"case": case.name, "steps": stats["steps"],
           "pipeline_mismatches": _bitwise_mismatches((o_losses, o_snaps, o_norms), (s_losses, s_snaps, s_norms)),
           "plans_made": stats["plans_made"], "nvme_read": stats["nvme_read_bytes"],
           "nvme_written": stats["nvme_written_bytes"], "h2d_bytes": stats["host_to_device_bytes"],
           "peak_gathered": stats["peak_gathered_bytes"], "gathered_bound": stats["gathered_bound_bytes"],
           "peak_cpu": stats["peak_resident_bytes"]["cpu"], "cpu_budget": stats["budgets"]["cpu"],
           "peak_device": stats["peak_resident_bytes"]["device"], "device_budget": stats["budgets"]["device"],
           "grads_tier": stats["grads_tier"], "losses": o_losses,
           "skipped_steps": stats["loss_scale"]["skipped_steps"]}  # fp16: steps whose gradients overflowed
    if against_torch:
        out["loss_err"] = max(abs(a - b) / abs(b) for a, b in zip(o_losses, r_losses))
        out["norm_err"] = max((abs(a - b) / abs(b) for a, b in zip(o_norms, r_norms)), default=0.0)
        param_err, worst = worst_param_error(o_snaps, r_snaps)
        out.update(param_err=param_err, worst_param=worst,
                   moved=max(_rel(r_snaps[case.steps - 1][n], r_snaps[0][n]) for n in r_snaps[0]))
    out["seconds"] = time.perf_counter() - t0
    return out


def tolerance(case: Case) -> float:
    """fp32: FP32_TOL; 2e-4 beyond 2 ranks, where NCCL's ring sums the ranks' gradients in another order than
    one full-batch backward (1e-5 / 2e-5 on the CPU at 1 / 2 ranks). bf16: BF16_TOL."""
    if case.dtype != "fp32":
        return BF16_TOL
    return FP32_TOL if case.world <= 2 else 2e-4


def check_case(r: dict, case: Case) -> None:
    """What must hold for every GPU parity case (tests/test_zero_parity.check, device edition)."""
    assert "error" not in r, r.get("error")
    assert r["pipeline_mismatches"] == 0, r  # pipelined == synchronous, bit for bit, also with a slow queue
    assert r["steps"] == case.steps - r["skipped_steps"] and r["plans_made"] >= 1, r
    assert (r["skipped_steps"] >= 1) == (case.dtype == "fp16"), r  # the fp16 cases' scaler overflows at first
    assert all(math.isfinite(x) for x in r["losses"]), r
    assert r["peak_cpu"] <= r["cpu_budget"] and r["peak_device"] <= r["device_budget"], r
    assert r["peak_gathered"] <= r["gathered_bound"], r
    if "loss_err" in r:
        tol = tolerance(case)
        assert r["loss_err"] <= tol and r["param_err"] <= tol and r["norm_err"] <= tol, r
        assert r["moved"] > 1e-3, r  # training really changed the parameters
    if "nvme" in (case.params, case.optimizer, case.grads):
        assert r["nvme_read"] > 0, r
    if case.params != "device":
        assert r["h2d_bytes"] > 0, r  # params came up to the GPU through the store


# ---- checkpoints ---------------------------------------------------------------------------------------------
def checkpoint_flats(ckpt: Path) -> dict:
    """Every (unit, state) of a checkpoint as one unpadded fp32 vector, whatever its world size."""
    from test_checkpoint import _flats_present

    return _flats_present(ckpt)


# ---- ranks: one process each, its own environment ------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_ranks(world: int, spec: dict, tmp: Path, name: str, env_for=None, timeout: float = 300.0) -> list[dict]:
    """Run tests/cuda_worker.py as `world` ranks (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT set per process,
    plus env_for(rank)), the way torchrun or Slurm start them, but each with its own environment (a per-rank
    injected delay, a per-rank CUDA_VISIBLE_DEVICES). Waits at most `timeout` seconds for all of them: a hang is
    killed (each rank's process group, started by us) and fails the test with every rank's log tail. Returns each
    rank's JSON output."""
    tmp.mkdir(parents=True, exist_ok=True)
    spec = dict(spec, out=str(tmp / f"{name}.out"))
    spec_path = tmp / f"{name}.spec.json"
    spec_path.write_text(json.dumps(spec))
    port = free_port()
    procs, logs = [], []
    for r in range(world):
        env = dict(os.environ, RANK=str(r), WORLD_SIZE=str(world), LOCAL_RANK=str(r), LOCAL_WORLD_SIZE=str(world),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="2",
                   PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
        env.update((env_for or (lambda _r: {}))(r))
        log = tmp / f"{name}.rank{r}.log"
        logs.append(log)
        with open(log, "w") as fh:
            procs.append(subprocess.Popen([sys.executable, str(WORKER), str(spec_path)], env=env, stdout=fh,
                                          stderr=subprocess.STDOUT, start_new_session=True, cwd=str(REPO)))
    deadline = time.monotonic() + timeout
    hung = False
    for p in procs:
        try:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            hung = True
            break
    if hung:
        for p in procs:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)  # the rank's own session: only what we started
        for p in procs:
            p.wait()

    def tails() -> str:
        return "\n".join(f"--- rank {r} (rc {p.returncode}) ---\n{logs[r].read_text()[-2500:]}"
                         for r, p in enumerate(procs))

    assert not hung, f"{name}: the ranks did not finish within {timeout:.0f} s (a hang?)\n{tails()}"
    assert all(p.returncode == 0 for p in procs), f"{name}: a rank failed\n{tails()}"
    outs = []
    for r in range(world):
        path = Path(f"{spec['out']}.rank{r}.json")
        assert path.exists(), f"{name}: rank {r} wrote no result\n{tails()}"
        outs.append(json.loads(path.read_text()))
    return outs


def require_gpus(n: int) -> None:
    """Skip (with the reason) below `n` GPUs: conftest's multi_gpu marker only knows 'two or more'."""
    import pytest

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count < n:
        pytest.skip(f"needs {n} CUDA GPUs ({count} here)")
