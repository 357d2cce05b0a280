"""The host pool (csrc/memory/host_pool.cpp, offload/store/host_pool.py): torch's CPU allocator while a runtime
computes on the CPU. A freed block is reused by the next request of its size class, what it maps stays within its
peak in use plus the headroom (huge-page blocks evicted first), tensors that outlive it free to the OS, small and
raw allocations keep working, threads with delays and fork() neither corrupt nor deadlock it, the training it
serves is bit for bit the same, and its window peak (a step's) restarts where it is taken."""
from __future__ import annotations

import os
import random
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch
import torch.nn as nn

import offload
from offload.store import host_pool

MiB = 1 << 20
pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux") or offload._ext.get() is None,
                                reason="the pool is a Linux mapping allocator inside the C++ extension")


@pytest.fixture
def pool():
    """The pool held for one test with 16 MiB of headroom (released after: the rest of the suite is unaffected)."""
    assert not host_pool.installed(), "a runtime or test left the pool installed"
    assert host_pool.acquire(16 * MiB)
    try:
        yield
    finally:
        host_pool.release()
    assert not host_pool.installed()


def test_size_classes_round_up_by_at_most_an_eighth():
    rng = random.Random(0)
    sizes = [host_pool.MIN_BYTES, 1 << 20, (1 << 20) + 1, 3 << 20, 1 << 30] + \
            [rng.randrange(host_pool.MIN_BYTES, 1 << 31) for _ in range(2000)]
    for n in sizes:
        c = host_pool.size_class(n)
        assert n <= c <= n + n // 8 + 4096 and c % 4096 == 0, (n, c)
    classes = sorted({host_pool.size_class(n) for n in range((1 << 20) + 1, (2 << 20) + 1, 4096)})
    assert len(classes) == 8  # eight classes per power of two: (1, 2] MiB
    assert host_pool.size_class(host_pool.size_class(12345678)) == host_pool.size_class(12345678)


def test_a_freed_block_is_reused_by_the_next_request_of_its_class(pool):
    before = host_pool.stats()
    t = torch.empty(3 * MiB, dtype=torch.uint8)
    ptr = t.data_ptr()
    t.fill_(7)
    del t
    assert host_pool.stats()["cached_bytes"] >= 3 * MiB
    u = torch.empty(3 * MiB - 1000, dtype=torch.uint8)  # the same class
    assert u.data_ptr() == ptr
    after = host_pool.stats()
    assert after["hits"] == before["hits"] + 1 and after["maps"] == before["maps"] + 1
    assert after["in_use_bytes"] - before["in_use_bytes"] == host_pool.size_class(3 * MiB)


def test_what_the_pool_maps_stays_within_its_peak_in_use_plus_the_headroom(pool):
    """Random allocations and frees of mixed classes, the bound checked after every one: mapped (in use + cached)
    never above the peak in use + 16 MiB; freed blocks are reused; trim() gives the cache back."""
    host_pool.trim()
    rng = random.Random(1)
    held = []
    for i in range(600):
        if held and (rng.random() < 0.45 or len(held) > 30):
            held.pop(rng.randrange(len(held)))
        else:
            held.append(torch.empty(rng.choice([256 << 10, MiB, 3 * MiB, 5 * MiB, 9 * MiB]), dtype=torch.uint8))
        s = host_pool.stats()
        assert s["in_use_bytes"] + s["cached_bytes"] <= s["peak_in_use_bytes"] + 16 * MiB, (i, s)
    del held
    s = host_pool.stats()
    assert s["hits"] > 200 and s["unmaps"] > 0, s  # reuse, and the bound did evict
    assert host_pool.trim() == s["cached_bytes"] and host_pool.stats()["cached_bytes"] == 0


def test_the_window_peak_is_the_most_in_use_since_it_was_last_taken(pool):
    """take_window_peak(): a step's peak, restarted from what is in use at each call, apart from the peak that
    sizes the cache (which it leaves alone)."""
    kept = torch.empty(2 * MiB, dtype=torch.uint8)
    host_pool.take_window_peak()
    base = host_pool.stats()["in_use_bytes"]
    burst = [torch.empty(5 * MiB, dtype=torch.uint8) for _ in range(3)]
    del burst
    small = torch.empty(MiB, dtype=torch.uint8)
    assert host_pool.take_window_peak() == base + 15 * MiB
    assert host_pool.take_window_peak() == base + MiB  # the window restarted from what was in use: `small`
    overall = host_pool.stats()["peak_in_use_bytes"]
    assert overall >= base + 15 * MiB  # untouched by the windows
    del small, kept


def test_huge_page_blocks_are_evicted_before_small_ones(pool):
    """Mapping a small block again faults every 4 KiB, a 2 MiB+ one every 2 MiB: the huge ones go first."""
    host_pool.trim()  # the peak restarts here (nothing of this test in use)
    unmaps = host_pool.stats()["unmaps"]  # (the counts run over the process's life)
    held = [torch.empty(MiB, dtype=torch.uint8) for _ in range(8)] + \
        [torch.empty(4 * MiB, dtype=torch.uint8) for _ in range(4)]  # 24 MiB in use: the peak
    del held  # all 24 MiB cached (the bound: 24 + 16)
    s = host_pool.stats()
    assert s["cached_bytes"] == 24 * MiB and s["unmaps"] == unmaps, s
    big = [torch.empty(12 * MiB, dtype=torch.uint8) for _ in range(2)]  # a new class at the peak: 8 MiB must go
    s = host_pool.stats()
    assert s["cached_bytes"] == 16 * MiB and s["unmaps"] == unmaps + 2, s  # two 4 MiB blocks, not eight of 1 MiB
    again = [torch.empty(MiB, dtype=torch.uint8) for _ in range(8)]
    assert host_pool.stats()["maps"] == s["maps"], "a small block was evicted while huge ones were cached"
    del again, big


def test_tensors_that_outlive_the_pool_go_back_to_the_os():
    assert host_pool.acquire(16 * MiB)
    t = torch.empty(2 * MiB, dtype=torch.uint8).fill_(1)
    host_pool.release()  # uninstalled: torch's own allocator is back
    assert not host_pool.installed()
    before = host_pool.stats()
    del t
    after = host_pool.stats()
    assert after["in_use_bytes"] == before["in_use_bytes"] - host_pool.size_class(2 * MiB)
    assert after["cached_bytes"] == 0 and after["unmaps"] == before["unmaps"] + 1
    torch.empty(4 * MiB, dtype=torch.uint8)
    assert host_pool.stats()["maps"] == after["maps"]  # not the pool's any more


def _train(seed: int) -> list[torch.Tensor]:
    """A few steps touching small, large and raw (oneDNN scratch) allocations: attention, a conv, AdamW."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Conv1d(64, 64, 3, padding=1), nn.Flatten(0, 1), nn.Unflatten(0, (4, 64)))
    layer = nn.TransformerEncoderLayer(128, 4, 512, batch_first=True, dropout=0.0)
    opt = torch.optim.AdamW(list(model.parameters()) + list(layer.parameters()), lr=1e-3)
    x = torch.randn(4, 64, 128)
    for _ in range(3):
        loss = layer(model(x)).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in list(model.parameters()) + list(layer.parameters())]


def test_training_under_the_pool_is_bitwise_training_without(pool):
    with_pool = _train(0)
    host_pool.release()
    try:
        without = _train(0)
    finally:
        assert host_pool.acquire(16 * MiB)
    assert all(torch.equal(a, b) for a, b in zip(with_pool, without))
    assert host_pool.stats()["small_requests"] > 0


def test_threads_with_delays_never_share_a_block(pool):
    """Four threads allocate blocks of random classes, write their mark, sleep, check the mark, free: a block
    handed to two holders at once (a missing lock) shows as a foreign mark."""
    errors = []

    def worker(mark: int):
        rng = random.Random(mark)
        try:
            for _ in range(60):
                held = []
                for _ in range(rng.randrange(1, 4)):
                    t = torch.empty(rng.randrange(128 << 10, 6 * MiB), dtype=torch.uint8)
                    t.fill_(mark)
                    held.append(t)
                time.sleep(rng.random() * 0.002)  # the other threads allocate and free meanwhile
                for t in held:
                    if not bool((t == mark).all()):
                        errors.append(f"thread {mark}: a block of {t.numel()} bytes was overwritten")
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(repr(e))

    base = host_pool.stats()["in_use_bytes"]
    threads = [threading.Thread(target=worker, args=(m,)) for m in (1, 2, 3, 4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors[:5]
    s = host_pool.stats()
    assert s["in_use_bytes"] == base and s["cached_bytes"] <= s["peak_in_use_bytes"] + 16 * MiB and s["hits"] > 0, s


def test_fork_while_another_thread_allocates_leaves_the_child_a_working_pool(tmp_path):
    """A DataLoader worker forks while the training thread allocates: the child must not inherit the pool's lock
    held by a thread it does not have."""
    code = textwrap.dedent("""
        import os, threading, torch
        from offload.store import host_pool
        assert host_pool.acquire(16 << 20)
        stop = False
        def churn():
            while not stop:
                torch.empty(1 << 20, dtype=torch.uint8).fill_(1)
        t = threading.Thread(target=churn, daemon=True)
        t.start()
        for _ in range(30):
            pid = os.fork()
            if pid == 0:
                x = torch.empty(2 << 20, dtype=torch.uint8).fill_(3)
                os._exit(0 if int(x.sum()) == 3 * (2 << 20) else 1)
            _, status = os.waitpid(pid, 0)
            assert os.waitstatus_to_exitcode(status) == 0, status
        stop = True
        t.join()
        host_pool.release()
        print("FORKS OK")
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert out.returncode == 0 and "FORKS OK" in out.stdout, out.stderr[-3000:]


def test_a_runtime_holds_the_pool_while_open_and_reports_it(tmp_path, monkeypatch):
    """The pool mode (a CPU run's default, "auto"; named here so a GPU machine runs the same test)."""
    monkeypatch.setenv("OFFLOAD_MALLOC_TUNE", "pool")
    cfg = offload.Config(params="cpu", optimizer="cpu", cpu_budget="64MiB", device_budget="32MiB")
    with offload.init(cfg) as rt:
        model = nn.Sequential(nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 512))
        opt = offload.AdamW(model.parameters(), lr=1e-3)
        for _ in range(2):
            model(torch.randn(64, 512, device=rt.device)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
        assert host_pool.installed()
        mem = rt.stats()["memory"]
        assert mem["malloc_mode"] == "pool" and mem["host_pool"]["hits"] > 0, mem
    assert not host_pool.installed()
