"""The kernel thread pool (csrc/common/thread_pool.cpp): usable in a forked child, settings that never
wait for a running kernel, and a bound on the thread count."""
from __future__ import annotations

import os
import threading
import time

import pytest
import torch

from offload import _ext, ops

C = _ext.get()
pytestmark = pytest.mark.skipif(C is None, reason=f"C++ extension unavailable: {_ext.error()}")


@pytest.fixture
def two_threads():
    before = C.num_threads()
    C.set_num_threads(2)
    yield
    C.set_num_threads(before)


def _wait_child(pid: int, timeout: float = 30.0) -> int:
    """Exit code of the child, or kills it and fails when it does not finish (a hang)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.02)
    os.kill(pid, 9)
    os.waitpid(pid, 0)
    pytest.fail(f"the forked child hung for {timeout} s")


def test_kernels_run_in_a_forked_child(two_threads):
    src = torch.randn(1 << 20)
    dst = torch.empty(1 << 20, dtype=torch.bfloat16)
    ops.copy_(dst, src)  # starts the pool's workers in this process
    expected = src.to(torch.bfloat16).view(torch.int16).numpy().tobytes()
    pid = os.fork()
    if pid == 0:  # child: the workers above do not exist here
        # (No parallel torch op in the child: torch's own OpenMP pool may hang after fork.)
        code = 1
        try:
            out = torch.empty(1 << 20, dtype=torch.bfloat16)
            ops.copy_(out, src)  # several chunks: needs helpers
            same = out.view(torch.int16).numpy().tobytes() == expected
            code = 0 if same and C.num_threads() == 2 else 2
        finally:
            os._exit(code)
    assert _wait_child(pid) == 0
    ops.copy_(dst, src)  # the parent's pool is untouched
    assert torch.equal(dst, src.to(torch.bfloat16))


def test_thread_count_is_read_and_set_while_a_kernel_runs():
    """Both calls used to take the pool's run lock: they waited (holding the GIL) until a running kernel finished.
    Up to 5 tries, passing on the first whose calls return while the kernel is still running (a try can lose the
    race on a busy machine: the kernel may end before the calls are made); with the lock, every try fails."""
    before, isa = C.num_threads(), C.active_isa()
    C.set_isa("scalar")  # one long kernel call (~0.3 s here) that holds the pool's run lock
    n = 24 << 20
    p, g, m, v = torch.randn(n), torch.randn(n), torch.zeros(n), torch.zeros(n)
    tries = []
    try:
        for _ in range(5):
            C.set_num_threads(1)
            last = p[-1].item()  # the kernel (one thread, chunks in order) updates this element at its very end
            started = threading.Event()

            def run():
                started.set()
                ops.adamw_step_(p, g, m, v, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, step=1)

            t = threading.Thread(target=run)
            t.start()
            try:
                started.wait()
                time.sleep(0.05)  # let the kernel start
                assert C.num_threads() == 1
                C.set_num_threads(2)
                tries.append(p[-1].item() == last)  # True: both calls returned while the kernel still ran
            finally:
                t.join()
            if tries[-1]:
                break
        assert any(tries), f"num_threads()/set_num_threads() waited for the running kernel in {len(tries)} tries"
    finally:
        C.set_num_threads(before)
        C.set_isa("auto" if isa == C.best_isa() else isa)
    assert C.num_threads() == before


def test_thread_count_is_bounded():
    before = C.num_threads()
    with pytest.raises(ValueError, match="between 1 and 1024"):
        C.set_num_threads(5000)
    with pytest.raises(ValueError, match="between 1 and 1024"):
        ops.set_num_threads(-1)
    assert C.num_threads() == before
    C.set_num_threads(1024)  # the bound itself is allowed (threads start only as chunks need them)
    assert C.num_threads() == 1024
    C.set_num_threads(before)


def test_loading_the_extension_leaves_the_global_random_stream_alone():
    """On an AVX-512 CPU the load timed the kernel on torch.randn data from the global generator: a seeded run's
    first draws (its initialization, its dropout masks) depended on whether, and when, the extension loaded."""
    import subprocess
    import sys

    code = ("import os, sys, torch; torch.manual_seed(0); import offload._ext as e; "
            "e.get() if sys.argv[1] == 'load' else None; print(torch.rand(3).tolist())")
    env = {k: v for k, v in os.environ.items() if k != "OFFLOAD_ISA"}  # (the probe runs when no ISA is forced)
    draws = [subprocess.run([sys.executable, "-c", code, mode], capture_output=True, text=True, env=env,
                            timeout=300).stdout.strip().splitlines()[-1] for mode in ("load", "no")]
    assert draws[0] == draws[1]


def test_the_host_pool_refuses_a_size_beyond_its_classes():
    """A size class above 2^63 looped forever (the power of two overflowed to 0), holding the GIL."""
    with pytest.raises(ValueError, match="above 2\\^62"):
        C.host_pool_size_class(2**63 + 1)


def test_conjugate_and_negative_views_copy_their_values():
    """The kernels read bytes: a conjugate (or negative) view was copied as the tensor under it."""
    src = torch.randn(1000, dtype=torch.complex64)
    dst = torch.empty_like(src)
    ops.copy_(dst, src.conj())
    assert torch.equal(dst, src.conj().resolve_conj())
    real = torch.randn(1000)
    out = torch.empty_like(real)
    ops.copy_(out, torch._neg_view(real))
    assert torch.equal(out, -real)
