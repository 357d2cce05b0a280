"""Pinned arena: exact 4096-aligned sub-allocation, coalescing, blocking, errors, locking, cleanup."""
import gc
import os
import threading
import time
import weakref

import pytest
import torch
from hypothesis import given, settings, strategies as st

from offload.store.arena import ALIGN, PREFAULT_MIN_BYTES, ArenaFullError, PinnedArena


def test_blocks_are_exact_aligned_and_disjoint():
    with PinnedArena("1MiB", lock=False) as a:
        sizes = [1, 4096, 5 * 4096 + 1, 100, 3000, 12345]
        blocks = [a.alloc(n) for n in sizes]
        for i, (b, n) in enumerate(zip(blocks, sizes)):
            assert b.tensor.numel() == n and b.nbytes == n
            assert b.offset % ALIGN == 0 and b.data_ptr() % ALIGN == 0 and b.tensor.data_ptr() == b.data_ptr()
            b.tensor.fill_(i + 1)
        for i, b in enumerate(blocks):
            assert torch.all(b.tensor == i + 1)  # nobody else wrote into it
        # exact rounding to 4096, not to a power of two: 5*4096+1 takes 6 pages, not 8
        assert blocks[2].reserved == 6 * 4096
        assert a.bytes_in_use == sum(-(-n // 4096) * 4096 for n in sizes) == 4096 * (1 + 1 + 6 + 1 + 1 + 4)
        assert a.bytes_requested == sum(sizes)
        assert a.peak_bytes == a.bytes_in_use
        for b in blocks:
            b.free()
        assert a.bytes_in_use == 0 and a.peak_bytes == 4096 * 14 and a.largest_free() == a.capacity


def test_view_dtype_and_bounds():
    with PinnedArena(64 * 1024, lock=False) as a, a.alloc(4000) as b:
        v = b.view(torch.bfloat16)
        assert v.numel() == 2000 and v.data_ptr() == b.data_ptr()
        assert b.view(torch.float32, 10).numel() == 10
        with pytest.raises(ValueError, match="needs 4004 bytes; the block has 4000"):
            b.view(torch.float32, 1001)


def test_coalescing_makes_the_whole_arena_allocatable_again():
    with PinnedArena(64 * 4096, lock=False) as a:
        blocks = [a.alloc(4096) for _ in range(64)]
        with pytest.raises(ArenaFullError, match="timed out"):
            a.alloc(1, timeout=0)
        order = torch.randperm(64, generator=torch.Generator().manual_seed(0)).tolist()
        for i in order:
            blocks[i].free()
        assert a.stats()["largest_free"] == 64 * 4096
        big = a.alloc(64 * 4096)
        assert big.offset == 0
        big.free()


def test_request_that_can_never_fit_names_size_and_capacity():
    with PinnedArena("1MiB", lock=False) as a:
        with pytest.raises(ArenaFullError, match=r"1.00 MiB \(1048577 bytes\) can never fit in the arena's capacity of 1.00 MiB"):
            a.alloc(1024 * 1024 + 1)
        with pytest.raises(ValueError, match="nbytes must be >= 0"):
            a.alloc(-1)


def test_alloc_blocks_until_a_free_and_times_out_with_state():
    with PinnedArena(8 * 4096, lock=False) as a:
        held = a.alloc(6 * 4096)
        t0 = time.monotonic()
        with pytest.raises(ArenaFullError, match=r"timed out after 0.05s waiting for 16.00 KiB; 24.00 KiB of 32.00 KiB in use"):
            a.alloc(4 * 4096, timeout=0.05)
        assert time.monotonic() - t0 >= 0.05
        got = []
        th = threading.Thread(target=lambda: got.append(a.alloc(4 * 4096, timeout=10)))
        th.start()
        time.sleep(0.1)
        assert not got  # still waiting: the range is taken
        held.free()
        th.join(10)
        assert len(got) == 1 and got[0].reserved == 4 * 4096
        got[0].free()


def test_a_lowered_limit_makes_requests_wait_and_keeps_what_is_in_use():
    """set_limit below what is in use keeps those blocks; a request that would pass the limit waits for a free
    though the arena has room; raising it again lets a waiter in; a request over the limit itself is refused."""
    with PinnedArena(8 * 4096, lock=False) as a:
        held = [a.alloc(4096) for _ in range(3)]
        assert a.set_limit(2 * 4096 + 1) == 3 * 4096  # rounded up to a page
        assert a.set_limit(2 * 4096) == 2 * 4096 and a.bytes_in_use == 3 * 4096
        with pytest.raises(ArenaFullError, match=r"timed out after 0.05s"):
            a.alloc(4096, timeout=0.05)  # 5 pages free in the range, none under the limit
        got = []
        th = threading.Thread(target=lambda: got.append(a.alloc(4096, timeout=10)))
        th.start()
        held.pop().free()
        time.sleep(0.1)
        assert not got  # 2 pages in use: at the limit still
        held.pop().free()
        th.join(10)
        assert len(got) == 1 and a.bytes_in_use == 2 * 4096
        with pytest.raises(ArenaFullError, match=r"over the arena's limit of 8.00 KiB"):
            a.alloc(3 * 4096)
        assert a.set_limit(1 << 40) == a.capacity and a.stats()["limit"] == a.capacity
        a.alloc(6 * 4096).free()


def test_double_free_and_closed_arena():
    a = PinnedArena(4 * 4096, lock=False)
    b = a.alloc(10)
    b.free()
    with pytest.raises(RuntimeError, match="freed twice"):
        b.free()
    # a waiter is released with an error when the arena closes under it
    hold = a.alloc(4 * 4096)
    errs = []

    def wait():
        try:
            a.alloc(4096)
        except RuntimeError as e:
            errs.append(str(e))

    th = threading.Thread(target=wait)
    th.start()
    time.sleep(0.05)
    a.close()
    th.join(5)
    assert not th.is_alive() and errs and "closed arena" in errs[0]
    assert hold.freed


def test_lock_reported_and_no_pin_memory_on_cpu_only():
    a = PinnedArena(256 * 1024)  # lock="auto"
    try:
        if torch.cuda.is_available():
            assert a.lock_kind in ("cuda", "none")
        else:
            assert a.lock_kind in ("mlock", "none")  # never CUDA registration, never pin_memory
            if a.lock_kind == "none":
                assert a.lock_error  # says why (RLIMIT_MEMLOCK or mlock errno)
            else:
                # the kernel reports the locked pages for this process
                with open("/proc/self/status") as f:
                    vmlck = next(int(l.split()[1]) for l in f if l.startswith("VmLck:"))
                assert vmlck >= 256
        assert a.stats()["locked"] == a.locked
    finally:
        a.close()
    assert not a.locked


@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA the arena is registered, not mlock'ed")
def test_lock_respects_rlimit_memlock():
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    resource.setrlimit(resource.RLIMIT_MEMLOCK, (64 * 1024, hard))
    try:
        a = PinnedArena("1MiB")  # auto: over the soft limit -> not locked, and says why
        assert a.lock_kind == "none" and "RLIMIT_MEMLOCK is 64.00 KiB < arena 1.00 MiB" in a.lock_error
        a.close()
        small = PinnedArena(64 * 1024)
        assert small.lock_kind == "mlock"
        small.close()
        try:
            forced = PinnedArena("1MiB", lock=True)  # root / CAP_IPC_LOCK may exceed the soft limit
        except OSError as e:
            assert "could not page-lock the arena" in str(e)
        else:
            assert forced.lock_kind == "mlock"
            forced.close()
    finally:
        resource.setrlimit(resource.RLIMIT_MEMLOCK, (soft, hard))


def test_close_releases_the_allocation():
    a = PinnedArena("4MiB", lock=False)
    ref = weakref.ref(a._raw)
    with a.alloc(1000) as b:
        b.tensor.fill_(1)
    a.close()
    gc.collect()
    assert ref() is None and a.bytes_in_use == 0
    with pytest.raises(RuntimeError, match="closed arena"):
        a.alloc(1)


def test_zero_byte_block():
    with PinnedArena(4096, lock=False) as a:
        full = a.alloc(4096)
        z = a.alloc(0, timeout=0)  # takes nothing, never waits
        assert z.tensor.numel() == 0 and a.bytes_in_use == 4096
        z.free()
        full.free()


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(0, 40_000)), max_size=60))
def test_random_alloc_free_matches_a_model(ops):
    cap = 32 * 4096
    with PinnedArena(cap, lock=False) as a:
        live = []
        for is_alloc, n in ops:
            if is_alloc or not live:
                try:
                    b = a.alloc(n, timeout=0)
                except ArenaFullError:
                    need = -(-n // 4096) * 4096
                    # only refused when no free range is large enough
                    assert a.largest_free() < need
                    continue
                live.append(b)
            else:
                live.pop(n % len(live)).free()
            spans = sorted((b.offset, b.offset + b.reserved) for b in live if b.reserved)
            assert all(e1 <= s2 for (_, e1), (s2, _) in zip(spans, spans[1:]))  # disjoint
            assert a.bytes_in_use == sum(b.reserved for b in live) <= cap
            assert a.peak_bytes >= a.bytes_in_use
        for b in live:
            b.free()
        assert a.largest_free() == cap and a.live_blocks == 0


def test_a_slot_takes_its_size_whatever_the_request_and_transfers_only_the_requests_pages():
    with PinnedArena(16 * ALIGN, lock=False) as a:
        home = a.alloc(3 * ALIGN + 5)  # long-lived: its own size
        s1 = a.alloc(100, slot=2 * ALIGN)  # short-lived: one slot each, whatever the request
        s2 = a.alloc(2 * ALIGN, slot=2 * ALIGN)
        assert home.span == 4 * ALIGN and s1.span == s2.span == 2 * ALIGN
        assert (s1.offset, s2.offset) == (4 * ALIGN, 6 * ALIGN)
        assert s1.reserved == ALIGN and s1.padded().numel() == ALIGN  # I/O length: the request's pages only
        assert a.bytes_in_use == 8 * ALIGN and a.free_slots(2 * ALIGN) == 4 and a.free_slots(3 * ALIGN) == 2
        s1.free()
        assert a.free_slots(2 * ALIGN) == 5
        assert a.alloc(1, slot=2 * ALIGN).offset == 4 * ALIGN  # the slot given back is the one taken again
        with pytest.raises(ValueError, match="slot must be a multiple of 4096 of at least 8192"):
            a.alloc(2 * ALIGN, slot=ALIGN)


def test_mixed_sizes_can_strand_free_bytes_but_slots_cannot():
    """First fit at exact sizes: 6 pages free in two 3-page holes cannot serve 4 pages (the 4.7 MiB request
    that waited with 10 MiB free). The same requests as 4-page slots: every one is served while fewer than
    free_slots are in use."""
    with PinnedArena(10 * ALIGN, lock=False) as a:
        held = [a.alloc(n * ALIGN) for n in (3, 2, 3, 2)]
        held[0].free()
        held[2].free()
        assert a.bytes_in_use == 4 * ALIGN
        with pytest.raises(ArenaFullError, match="timed out"):
            a.alloc(4 * ALIGN, timeout=0)
    with PinnedArena(10 * ALIGN, lock=False) as a:
        home = a.alloc(2 * ALIGN)  # 8 pages left: two slots
        x, y = (a.alloc(n * ALIGN, slot=4 * ALIGN) for n in (3, 2))
        x.free()
        z = a.alloc(4 * ALIGN, slot=4 * ALIGN, timeout=0)
        y.free()
        a.alloc(ALIGN, slot=4 * ALIGN, timeout=0).free()
        z.free()
        home.free()


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 9 * ALIGN), min_size=0, max_size=8), st.lists(st.booleans(), max_size=8),
       st.lists(st.tuples(st.booleans(), st.integers(1, 3 * ALIGN)), max_size=80))
def test_slots_never_wait_while_fewer_than_the_free_slots_counted_are_in_use(long_lived, drop, ops):
    """Long-lived blocks of any sizes (some freed again: holes between them), then any sequence of short-lived
    allocations and frees that keeps at most free_slots(S) (counted after the long-lived ones settled) live at
    once: none ever waits."""
    slot, capacity = 3 * ALIGN, 64 * ALIGN
    with PinnedArena(capacity, lock=False) as a:
        homes = [a.alloc(n) for n in long_lived]
        for blk, gone in zip(list(homes), drop):
            if gone:
                blk.free()
                homes.remove(blk)
        k = a.free_slots(slot)
        live = []
        for alloc, n in ops:
            if alloc and len(live) < k:
                live.append(a.alloc(n, slot=slot, timeout=0))  # ArenaBusyError here would be the bug
            elif live:
                live.pop(len(live) // 2).free()
        for b in live + homes:
            b.free()
        assert a.bytes_in_use == 0 and a.largest_free() == capacity


def _resident_kib(ptr: int, nbytes: int) -> int:
    """KiB of [ptr, ptr + nbytes) resident now, page by page (mincore). Not the Rss of its mapping in smaps: the
    kernel merges a fresh anonymous mapping with a neighbour of the same protection (another test's, the host
    pool's blocks), whose pages that Rss would count too."""
    import ctypes

    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    page = 4096
    start = ptr // page * page
    pages = (ptr + nbytes - start + page - 1) // page
    vec = (ctypes.c_ubyte * pages)()
    if libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(pages * page), vec) != 0:
        raise OSError(ctypes.get_errno(), "mincore")
    return sum(v & 1 for v in vec) * page >> 10


def test_prefault_makes_every_page_resident_from_several_threads():
    """The parallel pre-fault before a lock: a fresh mapping of 768 MiB (3 segments) is resident after it, with
    its contents unchanged (zeros); a range under PREFAULT_MIN_BYTES, or one thread, is left to the lock (None)."""
    import mmap

    from offload.store.arena import prefault

    n = 768 << 20
    m = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    t = torch.frombuffer(m, dtype=torch.uint8)
    ptr = t.data_ptr()
    assert _resident_kib(ptr, n) < 64 << 10  # nothing touched yet
    took = prefault(ptr, n, threads=2, min_bytes=0)
    if took is None:
        pytest.skip("MADV_POPULATE_WRITE needs Linux 5.14+")
    assert _resident_kib(ptr, n) >= (n >> 10) - 64  # every page in (up to a page table's rounding)
    assert int(t[:: 1 << 20].sum()) == 0 and int(t[-1]) == 0
    assert prefault(ptr, n) is None and prefault(ptr, n, threads=1, min_bytes=0) is None  # small; one thread
    del t
    m.close()


@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA the arena is registered, not mlock'ed")
def test_a_locked_arena_is_prefaulted_and_an_unlocked_one_is_not():
    try:
        a = PinnedArena(PREFAULT_MIN_BYTES, lock=True)
    except OSError:
        pytest.skip("no CAP_IPC_LOCK to lock 2 GiB here")
    try:
        cores = len(os.sched_getaffinity(0))
        assert a.lock_kind == "mlock" and (a.prefault_s is not None and a.prefault_s >= 0) == (cores >= 2)
    finally:
        a.close()
    b = PinnedArena(PREFAULT_MIN_BYTES, lock=False)
    try:
        assert b.prefault_s is None and _resident_kib(b.base_ptr, b.capacity) < 64 << 10  # not committed
    finally:
        b.close()
