"""The tiered store on a GPU: the pinned arena registered with CUDA, round trips bitwise equal to the leases replayed
one at a time with hundreds of moves in flight, and the stream ordering of its copies (device.py,
device_tier.DeviceMemoryTier.copy, Lease.release): a write-back sees the caller's queued kernel, a released block
is not reused under a kernel still reading it, a fetch is not queued behind compute submitted before it, and a
prefetch backs off when the device tier is full.

Ordering is checked with torch.cuda._sleep: a kernel that spins on the GPU for hundreds of milliseconds while the
host goes on. What is asserted is the order of events (a future resolved while an event queued after the sleep is
still pending), never a duration.
"""
from __future__ import annotations

import gc
import os
import sys
import time

import pytest
import torch

from offload.store import LeaseMode, PinnedArena, StoreConfig, TieredStore

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import store_grid  # noqa: E402
from cuda_common import cycles_per_ms, record_figure, sleep_ms  # noqa: E402
from store_grid import rand, same  # noqa: E402

pytestmark = pytest.mark.cuda

SLEEP_MS = 500  # far longer than any copy here (tens of MiB over PCIe: milliseconds), so the order is unambiguous


def gpu_store(tmp_path, **kw) -> TieredStore:
    kw.setdefault("device_budget", "256MiB")
    kw.setdefault("cpu_budget", "256MiB")
    kw.setdefault("nvme_budget", "1GiB")
    kw.setdefault("nvme_path", str(tmp_path / "swap-cuda"))
    return TieredStore(StoreConfig(device="cuda", io_workers=8, **kw))


# ---- the arena ----------------------------------------------------------------------------------------------
def test_the_store_arena_is_registered_with_cuda_and_its_views_are_pinned(tmp_path):
    """Every cpu-tier buffer is a view of one cudaHostRegister'ed range: pinned for async DMA (a pageable source
    would make every H2D copy synchronous and serialize prefetch behind the host)."""
    with gpu_store(tmp_path, cpu_budget="64MiB") as st:
        assert st._arena.lock_kind == "cuda", st._arena.lock_error
        assert st.stats()["cpu"]["lock_kind"] == "cuda" and st.stats()["cpu"]["locked"]
        st.register("h", 12_345, torch.bfloat16, home="cpu", init=rand(12_345, torch.bfloat16, 1)).result()
        assert st.fetch("h", "cpu").result().is_pinned()
        st.register("n", 4097, torch.float32, home="nvme", init=rand(4097, torch.float32, 2)).result()
        staged = st.fetch("n", "cpu").result()  # a staging buffer of an nvme shard: also in the arena
        assert staged.is_pinned() and same(staged, rand(4097, torch.float32, 2))
        st.release("n").result()
    with PinnedArena("16MiB") as arena:
        assert arena.lock_kind == "cuda", arena.lock_error
        blk = arena.alloc(100_003)
        assert blk.view(torch.float32).is_pinned() and blk.tensor.is_pinned()
        blk.free()


def test_a_failed_host_registration_is_cleared_and_reported():
    """cudaHostRegister of a range that is already registered fails: the failure is reported (a warning, the
    reason in lock_error) and CUDA's last error is cleared, or torch's next kernel-launch check would raise it as
    its own, far from here."""
    with PinnedArena("8MiB") as arena:
        assert arena.lock_kind == "cuda", arena.lock_error
        with pytest.warns(RuntimeWarning, match="not page-locked"):
            arena._lock(required=False)  # the same range again: cudaErrorHostMemoryAlreadyRegistered
        assert "cudaHostRegister" in (arena.lock_error or ""), arena.lock_error
        x = torch.ones(1024, device="cuda")
        assert float((x + 1).sum()) == 2048.0  # a kernel launch and its check: no stale error surfaces
        torch.cuda.synchronize()


# ---- round trips ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_round_trip_grid_on_cuda_ends_with_the_bytes_of_one_lease_at_a_time(tmp_path, dtype):
    """Homes device/cpu/nvme x leases to the device and the cpu tier x READ/UPDATE/OVERWRITE, 108 shards x 3 rounds
    with every lease of a round issued before the first is waited and every release left in flight (store_grid.py):
    the GPU store's bytes are bit for bit the sequence replayed on plain tensors. (It was once compared with a CPU
    store's run instead, which shared a bug with it: a cpu-homed shard leased home while its device lease's release
    was in flight lost the home lease's writes; the two agreed until their timings differed.)"""
    t0 = time.perf_counter()
    with gpu_store(tmp_path) as st:
        gpu = store_grid.run(st, dtype)
    bad = store_grid.differing(gpu, store_grid.expected(dtype))
    assert not bad, f"{len(bad)} shards differ from one lease at a time, e.g. {bad[:5]}"
    moved = gpu["stats"]["moved"]
    assert moved["cpu->device"] > 0 and moved["device->cpu"] > 0 and moved["nvme->cpu"] > 0 and moved["cpu->nvme"] > 0
    assert gpu["stats"]["device"]["bytes_in_use"] == gpu["homes"], gpu["stats"]  # every working copy was given back
    record_figure("store_round_trip_grid", dtype=str(dtype), shards=len(gpu["final"]), rounds=store_grid.ROUNDS,
                  moved=moved, seconds=time.perf_counter() - t0)


# ---- stream ordering -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("how", ["release", "writeback"])
@pytest.mark.parametrize("home", ["cpu", "nvme"])
def test_a_write_back_sees_the_kernel_queued_behind_a_sleep(tmp_path, home, how):
    """The caller fills its device working copy with a kernel queued behind a long sleep and asks for the write-back
    at once: the store's device->host copy must wait for the caller's stream (an event recorded at the request),
    so the home copy holds the kernel's result, not the zeros the block held when the copy could have started."""
    n = 1 << 20
    with gpu_store(tmp_path) as st:
        st.register("w", n, torch.float32, home=home).result()  # zeros
        src = torch.arange(n, dtype=torch.float32, device="cuda")
        per_ms = cycles_per_ms()
        t = st.fetch("w", "device").result()
        torch.cuda.synchronize()
        sleep_ms(SLEEP_MS, per_ms)
        torch.add(src, 1.0, out=t)  # runs only after the sleep
        queued = torch.cuda.Event()
        queued.record()
        fut = st.release("w", writeback=True) if how == "release" else st.writeback("w")
        fut.result(timeout=120)
        assert queued.query(), "the write-back finished before the kernel it had to copy"
        if how == "writeback":
            st.release("w").result()  # drop the working copy: what is read next is the home copy
        home_bytes = st.fetch("w", "cpu").result()
        assert same(home_bytes, torch.arange(n, dtype=torch.float32) + 1)
        if home == "nvme":
            st.release("w").result()


def test_a_released_device_block_is_not_reused_while_a_kernel_still_reads_it(tmp_path):
    """Lease shard a to the device, queue a sleep and then a kernel reading it, release the lease and at once
    fetch shard b of the same size. The block is a's until that kernel has run (Lease.release retires it on the
    holder's stream: record_stream), so b's host->device copy lands elsewhere and the kernel reads a's bytes."""
    n = 8 << 20  # 32 MiB of fp32
    a, b = torch.full((n,), 1.0), torch.full((n,), 2.0)
    with gpu_store(tmp_path) as st:
        st.register("a", n, torch.float32, home="cpu", init=a).result()
        st.register("b", n, torch.float32, home="cpu", init=b).result()
        per_ms = cycles_per_ms()
        torch.cuda.synchronize()
        lease = st.lease("a", "device", LeaseMode.READ)
        x = lease.wait()
        a_ptr = x.data_ptr()
        sleep_ms(SLEEP_MS, per_ms)
        seen = x.clone()  # reads a's block after the sleep
        reader_done = torch.cuda.Event()
        reader_done.record()
        del x
        lease.release()
        del lease
        gc.collect()  # the block's last reference is gone: the caching allocator has it back now
        tb = st.fetch("b", "device").result(timeout=120)
        raced = not reader_done.query()
        reused = tb.data_ptr() == a_ptr
        record_figure("block_reuse", fetched_while_reader_queued=raced, same_address=reused)
        assert raced, "b's fetch waited for the reading kernel: the race this test needs did not happen"
        assert same(seen, a), "the kernel read b's bytes: a's block was reused while it still read it"
        assert same(tb, b)
        st.release("b").result()


def test_a_fetch_to_the_device_is_not_queued_behind_earlier_compute(tmp_path):
    """A prefetch is not serialized behind compute: with a long sleep queued on the caller's stream, a fetch to
    the device asked for after it resolves (bytes on the GPU) while an event recorded after the sleep is still
    pending."""
    n = 8 << 20
    x = rand(n, torch.float32, 5)
    with gpu_store(tmp_path) as st:
        st.register("p", n, torch.float32, home="cpu", init=x).result()
        st.register("q", n // 8, torch.float32, home="nvme", init=x[: n // 8].neg()).result()
        for name in ("p", "q"):  # warm: the copy streams, the workers, a cached block of this size
            st.fetch(name, "device").result()
            st.release(name).result()
        per_ms = cycles_per_ms()
        torch.cuda.synchronize()
        sleep_ms(SLEEP_MS, per_ms)
        behind = torch.cuda.Event()
        behind.record()
        t0 = time.perf_counter()
        tp = st.fetch("p", "device").result(timeout=120)
        lease = st.lease("q", "device", LeaseMode.READ)  # the runtime's prefetch path (nvme -> cpu -> device)
        tq = lease.wait(timeout=120)
        fetched_s = time.perf_counter() - t0
        pending = not behind.query()
        record_figure("fetch_behind_sleep", sleep_ms=SLEEP_MS, cycles_per_ms=per_ms, fetch_s=fetched_s,
                      sleep_still_running=pending)
        assert pending, "the fetches waited for compute queued before them (prefetch serialized behind compute)"
        assert same(tp, x) and same(tq, x[: n // 8].neg())
        lease.release()
        st.release("p").result()


def test_a_prefetch_backs_off_when_the_device_tier_is_full(tmp_path):
    """lease(block=False) returns None while the device budget is held by other leases (nothing is queued), and
    a later one succeeds once a lease is released."""
    n = 1 << 20  # 4 MiB: the budget holds exactly two
    with gpu_store(tmp_path, device_budget=2 * 4 * n) as st:
        for i, name in enumerate("abc"):
            st.register(name, n, torch.float32, home="cpu", init=torch.full((n,), float(i))).result()
        la = st.lease("a", "device", LeaseMode.READ)
        lb = st.lease("b", "device", LeaseMode.READ)
        la.wait(), lb.wait()
        assert st.lease("c", "device", LeaseMode.READ, block=False) is None
        assert st.stats()["device"]["bytes_in_use"] == 2 * 4 * n
        la.release().result()
        lc = st.lease("c", "device", LeaseMode.READ, block=False)
        assert lc is not None and same(lc.wait(timeout=60), torch.full((n,), 2.0))
        lb.release().result()
        lc.release().result()
        assert st.stats()["device"]["bytes_in_use"] == 0


def test_a_device_tier_limit_lowered_under_a_waiter_raises_instead_of_hanging(tmp_path):
    """DeviceTier.set_limit (an "auto" budget fitted after the first step) below what a blocked request asks for:
    the request raises (naming device_budget) instead of waiting for room that can never come; a request with a
    timeout backs off (ArenaBusyError); one within the limit still waits for a free and gets its block."""
    import threading

    from offload.store import ArenaBusyError, ArenaFullError
    from offload.store.budget import DeviceTier

    kib = 1024
    tier = DeviceTier(1024 * kib, torch.device("cuda", torch.cuda.current_device()))
    held = tier.alloc(512 * kib)
    outcome = []

    def wait_for(nbytes):
        try:
            tier.alloc(nbytes).free()
            outcome.append(("got", nbytes))
        except ArenaFullError as e:
            outcome.append((type(e).__name__, nbytes))

    big = threading.Thread(target=wait_for, args=(768 * kib,))
    big.start()
    time.sleep(0.2)
    assert outcome == []  # 512 + 768 KiB > 1 MiB: waiting for a free
    assert tier.set_limit(640 * kib) == 640 * kib
    big.join(10)
    assert outcome == [("ArenaFullError", 768 * kib)]  # over the new limit: raised, not left waiting
    with pytest.raises(ArenaBusyError):
        tier.alloc(700 * kib, timeout=0)  # a prefetch over the limit backs off
    small = threading.Thread(target=wait_for, args=(256 * kib,))
    small.start()
    time.sleep(0.2)
    assert outcome[1:] == []  # 512 + 256 KiB > 640 KiB: waits
    held.free()
    small.join(10)
    assert outcome[1:] == [("got", 256 * kib)] and tier.bytes_in_use == 0


def test_a_prefetch_backs_off_when_the_gpu_is_full_below_the_budget(tmp_path):
    """The device budget has room but the GPU has not (activations, NCCL, another process took what the budget
    assumed free): the allocator's OOM inside a non-blocking lease escaped to the training thread. Now it
    backs off (None) like a full budget, a blocking request past its deadline names device_budget, and a
    lease succeeds once the memory is back."""
    from offload.store import ArenaBusyError
    from offload.store.budget import DeviceTier

    n = 16 << 20  # 64 MiB of fp32
    with gpu_store(tmp_path, device_budget="1GiB") as st:
        st.register("a", n, torch.float32, home="cpu", init=torch.full((n,), 3.0)).result()
        torch.cuda.empty_cache()
        free, _ = torch.cuda.mem_get_info()
        filler = torch.empty(free - (32 << 20), dtype=torch.uint8, device="cuda")  # leaves less than 64 MiB
        try:
            assert st.lease("a", "device", LeaseMode.READ, block=False) is None
            assert st.stats()["device"]["bytes_in_use"] == 0  # the budget it reserved was given back
            tier = DeviceTier(1 << 30, torch.device("cuda", torch.cuda.current_device()))
            with pytest.raises(ArenaBusyError, match="though the device budget has room.*lower device_budget"):
                tier.alloc(n * 4, timeout=0.2)
        finally:
            del filler
            torch.cuda.empty_cache()
        # until the tier frees a block, prefetches do not retry (each try flushes the allocator's cache); a
        # blocking lease does, and gets it
        assert st.lease("a", "device", LeaseMode.READ, block=False) is None
        lease = st.lease("a", "device", LeaseMode.READ)
        assert same(lease.wait(timeout=60), torch.full((n,), 3.0))
        lease.release().result()  # a free: prefetches try again
        lease = st.lease("a", "device", LeaseMode.READ, block=False)
        assert lease is not None and same(lease.wait(timeout=60), torch.full((n,), 3.0))
        lease.release().result()


def test_fetches_land_on_the_stores_device_from_its_worker_threads(tmp_path):
    """The store's copies run in its worker threads, each bound to the store's device at start (a thread starts
    on device 0): what they fetch is on that device and correct."""
    with gpu_store(tmp_path) as st:
        assert st.device == torch.device("cuda", torch.cuda.current_device())
        st.register("s", 4096, torch.float32, home="nvme", init=rand(4096, torch.float32, 9)).result()
        t = st.fetch("s", "device").result()
        assert t.device == st.device and same(t, rand(4096, torch.float32, 9))
        st.release("s").result()
