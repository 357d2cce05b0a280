"""Races between threads (and processes) sharing an engine: close() against a submit in progress,
waits without a deadline, files dropped without close(), use after fork."""
from __future__ import annotations

import gc
import os
import threading
import time

import pytest
import torch

from _aio_support import BACKENDS, fd_count, file_bytes, random_bytes
from offload.store.aio import AioEngine


class _SlowSubmitCore:
    """The engine's real core, with a pause before each submit reaches it: the window in which another
    thread's close() used to shut the fd under the queued pieces. Everything else is the real core."""

    def __init__(self, core, on_submit):
        self._core = core
        self._on_submit = on_submit

    def submit(self, reqs):
        self._on_submit()
        return self._core.submit(reqs)

    def __getattr__(self, name):
        return getattr(self._core, name)


@pytest.mark.parametrize("backend", BACKENDS)
def test_close_from_another_thread_waits_for_a_submit_in_progress(backend, tmp_path):
    data = random_bytes(64 * 1024, seed=7)
    with AioEngine(block_size="4KiB", queue_depth=1, backend=backend) as eng:
        f = eng.open(tmp_path / "race.bin", "w+")
        closer = threading.Thread(target=f.close)

        def close_meanwhile():
            closer.start()
            # Give close() ample time to run; it must instead block until this submit is recorded.
            closer.join(timeout=0.5)

        eng._core = _SlowSubmitCore(eng._core, close_meanwhile)
        h = eng.write(f, 0, data)
        h.wait()  # before the fix: EBADF, the fd was closed while the pieces were queued
        closer.join()
        assert f.closed
        assert file_bytes(str(tmp_path / "race.bin"), 0, data.numel()) == data.numpy().tobytes()
        with pytest.raises(ValueError, match="closed file"):
            eng.write(f, 0, data)


@pytest.mark.parametrize("backend", BACKENDS)
def test_engine_refuses_io_in_a_forked_child(backend, tmp_path):
    data = random_bytes(64 * 1024, seed=8)
    with AioEngine(block_size="16KiB", queue_depth=2, backend=backend) as eng:
        f = eng.open(tmp_path / "fork.bin", "w+")
        eng.write(f, 0, data).wait()  # the workers are running
        pid = os.fork()
        if pid == 0:  # child: the engine's workers do not exist here
            code = 1
            try:
                try:
                    eng.write(f, 0, data)
                    code = 2  # queued with nobody to run it: wait() would hang
                except RuntimeError as exc:
                    ok = "cannot be used after fork" in str(exc) and "create a new AioEngine" in str(exc)
                    eng.close()  # must not try to join the parent's threads
                    code = 0 if ok and f.closed else 3
            finally:
                os._exit(code)
        deadline = time.monotonic() + 30
        while not (done := os.waitpid(pid, os.WNOHANG))[0] and time.monotonic() < deadline:
            time.sleep(0.02)
        if not done[0]:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            pytest.fail("the forked child hung")
        assert os.waitstatus_to_exitcode(done[1]) == 0
        out = random_bytes(64 * 1024, seed=9)
        eng.read(f, 0, out).wait()  # the parent's engine and file are untouched
        assert torch.equal(out, data)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("timeout", [float("inf"), 1e300, 1e12])
def test_wait_without_a_real_deadline_waits_for_the_io(backend, timeout, tmp_path):
    nbytes = 8 << 20
    data = random_bytes(nbytes, seed=10)
    with AioEngine(block_size="4KiB", queue_depth=1, backend=backend) as eng:
        with eng.open(tmp_path / "long.bin", "w+", direct=False) as f:
            h = eng.write(f, 0, data)  # 2048 one-at-a-time blocks: still in flight at the wait below
            # The core waits are checked directly too: the handle may turn these into "forever" itself.
            assert h._batch.wait(timeout) is True  # was: False at once (C++ overflow) / OverflowError (python)
            assert h.done()
            h.wait(timeout)
            eng.read(f, 0, out := torch.empty_like(data)).wait(float("inf"))
            assert torch.equal(out, data)
            with pytest.raises(ValueError, match="nan"):
                h.wait(float("nan"))


@pytest.mark.parametrize("backend", BACKENDS)
def test_files_dropped_without_close_release_their_fd(backend, tmp_path):
    data = random_bytes(1 << 20, seed=11)
    with AioEngine(block_size="4KiB", queue_depth=1, backend=backend) as eng:
        base = fd_count()
        for i in range(20):
            f = eng.open(tmp_path / f"drop{i % 3}.bin", "w+")
            del f
        gc.collect()
        assert fd_count() <= base  # was: 20 fds leaked until the process exit
        # Dropped while its write is still in flight: the fd must stay open until the write is over.
        f = eng.open(tmp_path / "inflight.bin", "w+")
        h = eng.write(f, 0, data)
        del f
        gc.collect()
        h.wait()
        assert file_bytes(str(tmp_path / "inflight.bin"), 0, data.numel()) == data.numpy().tobytes()
        with eng.open(tmp_path / "next.bin", "w+"):  # the engine closes handed-over fds on its next call
            pass
        assert fd_count() <= base


class _AbandonedBatch:
    """A finished batch as the io_uring core reports it after its ring broke mid-flight (which no test
    can provoke): failed, and abandoned, so the kernel may still own the buffer."""

    def done(self):
        return True

    def failed(self):
        return True

    def abandoned(self):
        return True

    def bytes(self):
        return 4096

    def wait(self, timeout_s=-1.0):
        return True

    def error(self):
        return (5, True, "/x", 0, 4096, 0, 4096, "io_uring_submit_and_wait failed: the kernel may still own it")


def test_buffers_of_an_abandoned_batch_are_never_freed():
    import weakref

    from offload.store import aio

    with AioEngine(backend=BACKENDS[0]) as eng:
        buf = torch.empty(4096, dtype=torch.uint8)
        ref = weakref.ref(buf)
        h = aio.AioHandle(eng, _AbandonedBatch(), [buf])
        del buf
        with pytest.raises(aio.AioError, match="may still own"):
            h.wait()
        del h
        gc.collect()
        assert ref() is not None  # kept for the life of the process: late kernel writes hit no reused memory
    assert any(t is ref() for ts in aio._ABANDONED for t in ts)
