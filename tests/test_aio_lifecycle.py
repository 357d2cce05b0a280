"""No thread, file descriptor or buffer outlives the engine, after many open/close cycles and after
exceptions; the backend reported is the one asked for."""
from __future__ import annotations

import errno
import gc
import os
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch

from _aio_support import BACKENDS, fd_count, random_bytes, thread_count
from offload.store.aio import AioEngine, AioError, aio_backends, aligned_empty


def _settle(count_fn, baseline: int, timeout: float = 5.0) -> int:
    """Engine threads are joined by close(); poll a while anyway, so a slow exit on a busy machine is not
    taken for a leak (io_uring's own kernel helpers are not counted: see thread_count).

    Leak checks assert "no more than the baseline": a leak adds threads or fds, while a thread or file of an
    earlier test (a pool or file freed by the garbage collector, a helper torch retires) may go away during
    this one, so "exactly the baseline" failed by chance (5 == 6 in CI)."""
    deadline = time.monotonic() + timeout
    n = count_fn()
    while n > baseline and time.monotonic() < deadline:
        time.sleep(0.05)
        n = count_fn()
    return n


@pytest.mark.parametrize("backend", BACKENDS)
def test_no_thread_or_fd_leak_after_many_cycles(backend, tmp_path):
    data = random_bytes(256 * 1024, seed=1)
    out = aligned_empty(256 * 1024)
    gc.collect()  # what earlier tests dropped goes now, not during the count
    base_threads, base_py, base_fds = thread_count(), threading.active_count(), fd_count()
    for i in range(40):
        with AioEngine(block_size="64KiB", queue_depth=4, workers=2, backend=backend) as eng:
            assert eng.num_threads >= 1
            with eng.open(tmp_path / f"c{i % 3}.bin", "w+") as f:
                eng.write(f, 0, data).wait()
                eng.read(f, 0, out).wait()
            g = eng.open(tmp_path / "left-open.bin", "w+")  # closed by the engine
            eng.write(g, 0, data)  # left in flight: close() must finish or cancel it
        assert g.closed
    assert torch.equal(out, data)
    assert _settle(thread_count, base_threads) <= base_threads
    assert threading.active_count() <= base_py
    assert fd_count() <= base_fds


@pytest.mark.parametrize("backend", BACKENDS)
def test_no_leak_when_the_block_exits_by_exception(backend, tmp_path):
    gc.collect()
    base_threads, base_fds = thread_count(), fd_count()
    for _ in range(10):
        with pytest.raises(AioError) as ei:
            with AioEngine(block_size="64KiB", queue_depth=2, backend=backend) as eng:
                f = eng.open(tmp_path / "x.bin", "w+")
                eng.read(f, 0, aligned_empty(65536)).wait()  # empty file: end of file
        assert ei.value.errno == errno.ENODATA
        assert eng.closed and f.closed
    assert _settle(thread_count, base_threads) <= base_threads
    assert fd_count() <= base_fds


def test_backend_reported_is_the_one_in_use():
    states = aio_backends()
    assert states["threads"] in ("usable",) or "unavailable" in states["threads"]
    for backend in BACKENDS:
        with AioEngine(queue_depth=6, workers=2, backend=backend) as eng:
            assert eng.backend == backend
            # io_uring: one thread per worker; threads/python: one thread per queue slot
            assert eng.num_threads == (2 if backend == "io_uring" else 6)
    with AioEngine(backend="auto") as eng:
        expected = "io_uring" if states.get("io_uring") == "usable" else (
            "threads" if states.get("threads") == "usable" else "python")
        assert eng.backend == expected
        assert (eng.fallback_reason == "") == (expected == "io_uring")


def test_running_out_of_threads_at_construction_raises_and_leaves_nothing(tmp_path):
    # pthread_create fails once the address space has no room for another 8 MiB stack: the engine stops the
    # workers it started and raises (a joinable thread left in the half-built engine would abort the process).
    script = tmp_path / "no_threads.py"
    script.write_text(textwrap.dedent("""
        import resource
        from offload.store.aio import AioEngine
        from _aio_support import thread_count
        with AioEngine(block_size="64KiB", queue_depth=2, workers=1, backend="threads"):
            pass
        before = thread_count()
        used = int(open("/proc/self/statm").read().split()[0]) * resource.getpagesize()
        resource.setrlimit(resource.RLIMIT_AS, (used + 64 * 2**20, resource.RLIM_INFINITY))
        try:
            AioEngine(block_size="64KiB", queue_depth=64, workers=1, backend="threads")
            raise SystemExit("64 threads started inside 64 MiB of address space")
        except RuntimeError as e:
            assert "cannot start worker threads" in str(e), e
        resource.setrlimit(resource.RLIMIT_AS, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
        assert thread_count() <= before, (thread_count(), before)
        with AioEngine(block_size="64KiB", queue_depth=64, workers=1, backend="threads") as eng:
            assert eng.backend == "threads"
        print("ok")
    """))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.dirname(__file__), os.environ.get("PYTHONPATH", "")])}
    res = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, env=env)
    assert res.returncode == 0 and res.stdout.strip().endswith("ok"), res.stdout + res.stderr
