"""Faults of the aio engine: each raises an AioError (an OSError) with the errno and a message naming
file, operation, offset and errno; nothing hangs, nothing exits."""
from __future__ import annotations

import errno
import os
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch

from _aio_support import BACKENDS, file_bytes, mounted, random_bytes
from offload.store import aio as aio_mod
from offload.store.aio import AioEngine, AioError, AioTimeoutError, aligned_empty

MiB = 1 << 20
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(params=BACKENDS)
def engine(request):
    with AioEngine(block_size="64KiB", queue_depth=4, workers=2, backend=request.param) as eng:
        yield eng


@pytest.mark.parametrize("what", ["buffer address", "offset", "length"])
def test_misalignment_raises_einval_naming_the_argument(engine, tmp_path, what):
    path = str(tmp_path / "a.bin")
    good = random_bytes(64 * 1024, seed=1)
    with engine.open(path, "w+") as f:
        engine.write(f, 0, good).wait()
        buf = aligned_empty(64 * 1024 + 4096)
        tensor, offset = buf[:64 * 1024], 0
        if what == "buffer address":
            tensor = buf[512:512 + 64 * 1024]
        elif what == "offset":
            offset = 100
        else:
            tensor = buf[:64 * 1024 + 10]
        for op in (engine.read, engine.write):
            with pytest.raises(AioError) as ei:
                op(f, offset, tensor)
            e = ei.value
            assert e.errno == errno.EINVAL and isinstance(e, OSError)
            assert what in str(e) and path in str(e) and "EINVAL" in str(e)
            off_by = {"buffer address": 512, "offset": 100, "length": 10}[what]
            assert f"off by {off_by} bytes" in str(e)
    assert file_bytes(path, 0, 64 * 1024) == good.numpy().tobytes()  # nothing was queued


def test_block_size_finer_than_the_files_alignment_is_refused(engine, tmp_path):
    # A device with 8 KiB sectors reports an O_DIRECT alignment of 8192 (statx STATX_DIOALIGN); this disk reports
    # 4096, so the file's recorded alignment is set to what such a device gives. A 64 KiB engine fits it; a 4 KiB
    # one would cut a request into pieces every other one of which starts misaligned.
    def aligned_8k(nbytes):
        buf = aligned_empty(nbytes + 8192)
        skip = -buf.data_ptr() % 8192
        return buf[skip:skip + nbytes]

    path = str(tmp_path / "a.bin")
    data = aligned_8k(64 * 1024)
    data.copy_(random_bytes(64 * 1024, seed=3))
    with AioEngine(block_size="4KiB", queue_depth=4, workers=1, backend=engine.backend) as fine:
        with fine.open(path, "w+") as f:
            if not f.direct:
                pytest.skip("this filesystem refuses O_DIRECT")
            f.alignment = 8192
            with pytest.raises(AioError, match=r"block_size = 4096 .* aligned to 8192 bytes; set block_size \(the "
                                               r"store's aio_block_size\) to a multiple of 8192") as ei:
                fine.write(f, 0, data)
            assert ei.value.errno == errno.EINVAL
    with engine.open(path, "r+") as f:
        f.alignment = 8192
        engine.write(f, 0, data).wait()
        back = aligned_8k(64 * 1024)
        engine.read(f, 0, back).wait()
        assert torch.equal(back, data)


@pytest.mark.parametrize("new_size", [512 * 1024, 512 * 1024 + 100])
def test_truncated_file_read_names_file_and_offset(engine, tmp_path, new_size):
    path = str(tmp_path / "trunc.bin")
    with engine.open(path, "w+") as f:
        engine.write(f, 0, random_bytes(MiB, seed=2)).wait()
        os.truncate(path, new_size)
        h = engine.read(f, 0, aligned_empty(MiB))
        with pytest.raises(AioError) as ei:
            h.wait()
    e = ei.value
    assert e.errno == errno.ENODATA and e.filename == path
    msg = str(e)
    assert path in msg and "read" in msg and "offset" in msg and f"holds {new_size} bytes" in msg
    assert "end of file" in msg


def test_full_filesystem_raises_enospc(engine, tmp_path):
    with mounted(tmp_path / "mnt", "tmpfs", "size=1m") as mnt:
        path = os.path.join(mnt, "full.bin")
        with engine.open(path, "w+") as f:
            h = engine.write(f, 0, random_bytes(4 * MiB, seed=3))
            with pytest.raises(AioError) as ei:
                h.wait()
            e = ei.value
            assert e.errno == errno.ENOSPC and e.filename == path
            assert "ENOSPC" in str(e) and "write" in str(e) and "offset" in str(e) and path in str(e)
            with pytest.raises(AioError) as ei:
                engine.fallocate(f, 8 * MiB)
            assert ei.value.errno == errno.ENOSPC and "fallocate" in str(ei.value)


def test_file_size_limit_raises_efbig_in_subprocess(tmp_path):
    """RLIMIT_FSIZE (set in a child so the test process keeps its limits) makes writes fail with EFBIG."""
    script = textwrap.dedent(
        f"""
        import errno, resource, signal, sys
        sys.path.insert(0, {REPO!r})
        sys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r})
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # get EFBIG instead of being killed
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
        from _aio_support import BACKENDS, random_bytes
        from offload.store.aio import AioEngine, AioError
        for backend in BACKENDS:
            with AioEngine(block_size="256KiB", queue_depth=4, backend=backend) as eng:
                with eng.open({str(tmp_path)!r} + "/lim-" + backend, "w+") as f:
                    try:
                        eng.write(f, 0, random_bytes(4 << 20, seed=4)).wait()
                        print(backend, "no-error")
                    except AioError as e:
                        print(backend, errno.errorcode[e.errno], "|", e)
        """
    )
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": REPO})
    assert res.returncode == 0, res.stderr
    lines = [ln for ln in res.stdout.splitlines() if ln.strip()]
    assert len(lines) == len(BACKENDS), res.stdout
    for ln in lines:
        backend, name, _, msg = ln.split(" ", 3)
        assert name == "EFBIG", ln
        assert "write" in msg and "lim-" + backend in msg and "offset" in msg


def test_short_write_is_resubmitted_until_the_size_limit(tmp_path):
    """A write that crosses RLIMIT_FSIZE is cut short by the kernel (pwrite/io_uring return fewer bytes):
    the engine must resubmit the remainder, which then fails with EFBIG at the exact byte, and the
    bytes before the limit must be on disk."""
    limit = (1 << 20) + 8192  # mid-block: the 256 KiB block at 1 MiB is written only 8 KiB deep
    script = textwrap.dedent(
        f"""
        import errno, os, resource, signal, sys
        sys.path.insert(0, {REPO!r})
        sys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r})
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # get EFBIG instead of being killed
        resource.setrlimit(resource.RLIMIT_FSIZE, ({limit}, {limit}))
        from _aio_support import BACKENDS, file_bytes, random_bytes
        from offload.store.aio import AioEngine, AioError
        data = random_bytes(2 << 20, seed=12)
        for backend in BACKENDS:
            path = {str(tmp_path)!r} + "/short-" + backend
            with AioEngine(block_size="256KiB", queue_depth=1, backend=backend) as eng:
                with eng.open(path, "w+") as f:
                    try:
                        eng.write(f, 0, data).wait()
                        print(backend, "no-error")
                    except AioError as e:
                        same = file_bytes(path, 0, {limit}) == data[:{limit}].numpy().tobytes()
                        print(backend, errno.errorcode[e.errno], os.path.getsize(path), same, "|", e)
        """
    )
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": REPO})
    assert res.returncode == 0, res.stderr
    lines = [ln for ln in res.stdout.splitlines() if ln.strip()]
    assert len(lines) == len(BACKENDS), res.stdout
    for ln in lines:
        backend, name, size, same, _, msg = ln.split(" ", 5)
        assert (name, int(size), same) == ("EFBIG", limit, "True"), ln
        # The failing piece starts where the short write stopped: the remainder was resubmitted.
        assert f"at offset {limit} ({256 * 1024 - 8192} bytes" in msg, ln
        assert "after a short transfer of 8192 bytes" in msg, ln


def test_write_to_read_only_file_raises_ebadf(engine, tmp_path):
    path = str(tmp_path / "ro.bin")
    with open(path, "wb") as fh:
        fh.write(b"\0" * 65536)
    with engine.open(path, "r") as f:
        with pytest.raises(AioError) as ei:
            engine.write(f, 0, random_bytes(65536, seed=5)).wait()
    assert ei.value.errno == errno.EBADF and "EBADF" in str(ei.value) and path in str(ei.value)
    assert file_bytes(path, 0, 65536) == b"\0" * 65536


def test_read_only_directory(engine, tmp_path):
    if os.geteuid() == 0:  # root ignores permission bits: use a read-only mount
        with mounted(tmp_path / "romnt", "tmpfs", "ro,size=1m") as mnt:
            with pytest.raises(AioError) as ei:
                engine.open(os.path.join(mnt, "x.bin"), "w+")
            assert ei.value.errno == errno.EROFS
    else:
        d = tmp_path / "ro"
        d.mkdir(mode=0o500)
        with pytest.raises(AioError) as ei:
            engine.open(d / "x.bin", "w+")
        assert ei.value.errno == errno.EACCES
    assert "cannot open" in str(ei.value) and "x.bin" in str(ei.value)


def test_missing_directory(engine, tmp_path):
    path = str(tmp_path / "nope" / "x.bin")
    with pytest.raises(AioError) as ei:
        engine.open(path, "w+")
    e = ei.value
    assert e.errno == errno.ENOENT and e.filename == path and path in str(e) and "ENOENT" in str(e)
    assert isinstance(e, FileNotFoundError) or isinstance(e, OSError)


@pytest.mark.parametrize("mode", ["r", "r+", "w+"])
def test_symlink_at_path_is_refused(engine, tmp_path, mode):
    target = tmp_path / "victim.bin"
    target.write_bytes(b"precious")
    link = tmp_path / "swap.bin"
    link.symlink_to(target)
    with pytest.raises(AioError) as ei:
        engine.open(link, mode)
    assert ei.value.errno == errno.ELOOP and "symbolic link" in str(ei.value)
    assert target.read_bytes() == b"precious"  # not truncated through the link


def test_filesystem_without_o_direct_falls_back_to_buffered(tmp_path):
    """ramfs (and tmpfs before Linux 6.6) refuse O_DIRECT: the engine reopens buffered and warns once."""
    probe = f"/dev/shm/offload-odirect-probe-{os.getpid()}"  # its own: runs side by side do not share it
    shm_refuses = False
    if os.path.isdir("/dev/shm"):
        try:
            os.close(os.open(probe, os.O_CREAT | os.O_RDWR | os.O_DIRECT, 0o600))
        except OSError as exc:
            shm_refuses = exc.errno == errno.EINVAL
        finally:
            if os.path.exists(probe):
                os.unlink(probe)
    if shm_refuses:
        _check_buffered_fallback("/dev/shm")
    else:  # this kernel's tmpfs takes O_DIRECT; ramfs never does
        with mounted(tmp_path / "ram", "ramfs") as mnt:
            _check_buffered_fallback(mnt)


def _check_buffered_fallback(directory: str) -> None:
    aio_mod._warned_dirs.discard(os.path.abspath(directory))
    paths = [os.path.join(directory, f"offload-fallback-{os.getpid()}-{i}.bin") for i in range(2)]
    try:
        for backend in BACKENDS:
            with AioEngine(block_size="64KiB", queue_depth=4, backend=backend) as eng:
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    files = [eng.open(p, "w+") for p in paths]
                msgs = [str(w.message) for w in caught if "O_DIRECT" in str(w.message)]
                if backend == BACKENDS[0]:
                    assert len(msgs) == 1 and paths[0] in msgs[0], msgs  # once, naming the path
                else:
                    assert msgs == []
                for f in files:
                    assert not f.direct
                    data = random_bytes(100_003, seed=6, aligned=False)
                    eng.write(f, 7, data).wait()  # odd size and offset are fine buffered
                    out = torch.empty(100_003, dtype=torch.uint8)
                    eng.read(f, 7, out).wait()
                    assert torch.equal(out, data)
                    f.close()
    finally:
        for p in paths:
            if os.path.exists(p):
                os.unlink(p)


def test_closed_engine_and_file_are_refused(tmp_path):
    eng = AioEngine(backend=BACKENDS[0])
    f = eng.open(tmp_path / "c.bin", "w+")
    f.close()
    f.close()  # idempotent
    with pytest.raises(ValueError, match="closed file"):
        eng.write(f, 0, aligned_empty(4096))
    g = eng.open(tmp_path / "d.bin", "w+")
    eng.close()
    eng.close()  # idempotent
    assert g.closed, "closing the engine closes the files it opened"
    with pytest.raises(ValueError, match="engine is closed"):
        eng.open(tmp_path / "e.bin", "w+")


def test_close_with_io_queued_cancels_or_completes_without_hanging(engine, tmp_path):
    with engine.open(tmp_path / "q.bin", "w+") as f:
        handles = [engine.write(f, i * MiB, random_bytes(MiB, seed=i)) for i in range(16)]
        engine.close()
        assert all(h.done() for h in handles)
        for h in handles:
            exc = h.exception()
            assert exc is None or exc.errno == errno.ECANCELED, exc


def test_wait_timeout_raises_timeout_error(tmp_path):
    with AioEngine(block_size="4KiB", queue_depth=1, backend=BACKENDS[0]) as eng:
        with eng.open(tmp_path / "t.bin", "w+") as f:
            h = eng.write(f, 0, random_bytes(16 * MiB, seed=8))
            if h.done():
                pytest.skip("the 4096-piece write finished before wait() was called")
            with pytest.raises(AioTimeoutError) as ei:
                h.wait(timeout=0)
            assert isinstance(ei.value, TimeoutError) and ei.value.errno == errno.ETIMEDOUT
            h.wait()


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="block_size"):
        AioEngine(block_size="1000")
    with pytest.raises(ValueError, match="backend"):
        AioEngine(backend="libaio")
    with pytest.raises(ValueError, match="block_size"):
        AioEngine(block_size="1 furlong")
    with pytest.raises(ValueError, match="queue_depth"):
        AioEngine(queue_depth=0, backend=BACKENDS[0])


def test_non_contiguous_tensor_is_refused(engine, tmp_path):
    with engine.open(tmp_path / "n.bin", "w+", direct=False) as f:
        t = torch.zeros(64, 64)[:, ::2]
        with pytest.raises(ValueError, match="contiguous"):
            engine.write(f, 0, t)


def test_a_python_engine_worker_whose_piece_raises_finishes_it(tmp_path, monkeypatch):
    """The python engine (no C++ extension) ran each piece outside any handler: an exception in it (an fstat after a
    short read, say) killed the worker with the piece unfinished, and wait() never returned. The piece now
    finishes with EIO naming the exception. (The fault is injected into the piece's run.)"""
    from offload.store import _aio_py

    def breaks(piece):
        raise RuntimeError("injected: the piece's run failed")

    with AioEngine(block_size="64KiB", queue_depth=2, backend="python") as eng:
        with eng.open(tmp_path / "f.bin", "w+") as f:
            monkeypatch.setattr(_aio_py, "_run_piece", breaks)
            h = eng.write(f, 0, random_bytes(MiB, seed=1))
            with pytest.raises(AioError, match="injected: the piece's run failed") as ei:
                h.wait(timeout=60)
            assert ei.value.errno == errno.EIO
