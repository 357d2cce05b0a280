"""Leaving the store leaves nothing behind: files, directory, threads, fds, arena bytes, locked pages."""
import gc
import os
import weakref

import pytest
import torch

from offload import inject
from offload.store import StoreConfig, StoreError, TieredStore
from offload.telemetry import Queue

from _aio_support import fd_count, thread_count


def vm_locked_kib() -> int:
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) for l in f if l.startswith("VmLck:"))


def cfg(path, **kw):
    return StoreConfig(device_budget="2MiB", cpu_budget="2MiB", nvme_budget="64MiB", nvme_path=str(path), **kw)


def fill(st, n=20):
    for i in range(n):
        st.register(f"s{i}", 3000 + i, torch.float32, home="nvme" if i % 3 else "cpu",
                    tier_class="optim" if i % 2 else "params", init=torch.randn(3000 + i))


@pytest.fixture
def baseline():
    # warm up the lazily started pieces shared by the process (kernel thread pool, extension load)
    with TieredStore(cfg("/tmp/offload-store-warm-%d" % os.getpid())) as st:
        fill(st, 3)
        st.wait_all()
    gc.collect()
    return thread_count(), fd_count(), vm_locked_kib()


def assert_clean(path, base, arena_ref=None):
    gc.collect()
    assert not os.path.exists(path), os.listdir(path)
    threads, fds, locked = base
    assert thread_count() <= threads  # a leak adds; an earlier test's leftovers may exit meanwhile
    assert fd_count() <= fds
    assert vm_locked_kib() <= locked
    if arena_ref is not None:
        assert arena_ref() is None  # the one big allocation is gone


def test_close_leaves_nothing(tmp_path, baseline):
    d = tmp_path / "swap"
    st = TieredStore(cfg(d))
    fill(st)
    futs = [st.fetch(f"s{i}", "device") for i in range(0, 20, 2)]
    assert thread_count() > baseline[0] and len(os.listdir(d)) == 2
    arena_ref = weakref.ref(st._arena._raw)
    del futs
    st.close()
    assert st.stats()["cpu"]["bytes_in_use"] == 0 and st.stats()["device"]["bytes_in_use"] == 0
    del st
    assert_clean(d, baseline, arena_ref)


def test_exception_inside_with_with_moves_in_flight(tmp_path, baseline):
    d = tmp_path / "swap"
    # every write 50 ms slow (in the worker): the queue holds seconds of moves when the block dies, so the exit
    # meets moves not yet started however the threads were scheduled (2 workers could drain it unslowed)
    with pytest.raises(ZeroDivisionError), inject.delay(Queue.NVME_WRITE, 0.05):
        with TieredStore(cfg(d, io_workers=2)) as st:
            fill(st)
            futs = []
            for i in range(20):
                for _ in range(3):  # chains of moves per shard: queued, some running when the block dies
                    futs.append(st.fetch(f"s{i}", "cpu"))
                    futs.append(st.release(f"s{i}", writeback=True))
            arena_ref = weakref.ref(st._arena._raw)
            1 / 0
    assert st.closed
    assert all(f.done() for f in futs)
    cancelled = sum(f.cancelled() for f in futs)
    assert cancelled > 0  # the exit did not run the whole queue
    # no move of a shard ran beside another move of the same shard (the transitions would have asserted)
    assert not [f.exception() for f in futs if not f.cancelled() and f.exception() is not None]
    with pytest.raises(StoreError, match="closed"):
        st.fetch("s1", "cpu")
    del st
    assert_clean(d, baseline, arena_ref)


def test_existing_directory_is_kept_files_removed(tmp_path, baseline):
    d = tmp_path / "mine"
    d.mkdir()
    (d / "other.txt").write_text("not the store's")
    with TieredStore(cfg(d)) as st:
        fill(st, 4)
    assert sorted(os.listdir(d)) == ["other.txt"]


def test_many_open_close_cycles(tmp_path, baseline):
    d = tmp_path / "swap"
    for k in range(25):
        with TieredStore(cfg(d)) as st:
            fill(st, 6)
            x = st.fetch("s1", "device").result()
            assert x.numel() == 3001
            if k % 2:
                st.release("s1", writeback=True)
    assert_clean(d, baseline)
