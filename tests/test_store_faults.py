"""Faults of the NVMe tier: each gives a clear error, and nothing already stored is corrupted."""
import errno
import os
import re
import subprocess
import sys
import textwrap

import pytest
import torch

from offload.store import Residency, StoreConfig, SwapCorruptError, SwapSpaceError, TieredStore
from offload.store.aio import AioError

from _aio_support import mounted


def cfg(path, **kw):
    base = dict(device_budget="4MiB", cpu_budget="4MiB", nvme_budget="64MiB", nvme_path=str(path))
    base.update(kw)
    return StoreConfig(**base)


@pytest.mark.filterwarnings("ignore:offload aio.*O_DIRECT:RuntimeWarning")
def test_full_filesystem_is_refused_at_registration(tmp_path):
    with mounted(tmp_path / "mnt", "tmpfs", "size=256k") as mnt:
        with TieredStore(cfg(os.path.join(mnt, "s"))) as st:  # tmpfs: O_DIRECT, or buffered with a warning
            x = torch.randn(10_000)
            st.register("ok", 10_000, init=x).result()
            with pytest.raises(SwapSpaceError, match=r"registering needs 1003520 more bytes .* has \d+ bytes .* free"):
                st.register("big", 250_000, torch.float32, home="nvme")
            with pytest.raises(KeyError):
                st.info("big")  # the failed shard is not half-registered
            st.register("n", 10_000, home="nvme", init=x).result()
            assert torch.equal(st.fetch("n", "cpu").result(), x)  # what was stored before is intact
            assert torch.equal(st.fetch("ok", "device").result(), x)
        assert os.listdir(mnt) == []


def test_file_size_limit_in_a_child(tmp_path):
    # RLIMIT_FSIZE makes fallocate past 1 MiB fail with EFBIG: registration says so, earlier shards survive.
    code = textwrap.dedent(f"""
        import resource, signal, os, torch
        from offload.store import StoreConfig, TieredStore, SwapSpaceError
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)   # get EFBIG instead of being killed
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
        d = {str(tmp_path / 's')!r}
        with TieredStore(StoreConfig(device_budget="4MiB", cpu_budget="4MiB", nvme_budget="64MiB", nvme_path=d)) as st:
            x = torch.randn(100_000)
            st.register("a", 100_000, home="nvme", init=x).result()
            try:
                st.register("b", 300_000, home="nvme")
                raise SystemExit("no error")
            except SwapSpaceError as e:
                assert e.errno == 27 and "cannot grow to" in str(e) and "EFBIG" in str(e), str(e)
            assert torch.equal(st.fetch("a", "cpu").result(), x)
        assert not os.path.exists(d)
        print("ok")
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=os.environ)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stdout + r.stderr


def test_missing_parent_directory(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"parent directory .*/no/such' does not exist"):
        TieredStore(cfg(tmp_path / "no" / "such" / "swap"))


def test_read_only_directory(tmp_path):
    with mounted(tmp_path / "ro", "tmpfs", "ro,size=64k") as mnt:
        with pytest.raises(OSError, match=r"is on a read-only filesystem") as ei:
            TieredStore(cfg(mnt))
        assert ei.value.errno == errno.EROFS
        with pytest.raises(OSError, match=r"cannot create the swap directory: Read-only file system"):
            TieredStore(cfg(os.path.join(mnt, "sub")))


def test_path_is_a_file(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(NotADirectoryError, match="exists and is not a directory"):
        TieredStore(cfg(tmp_path / "f"))


def test_truncated_swap_file(tmp_path):
    with TieredStore(cfg(tmp_path / "s")) as st:
        a, b = torch.randn(5000), torch.randn(5000)
        st.register("a", 5000, home="nvme", init=a).result()
        st.register("b", 5000, home="nvme", init=b).result()
        path = st.swap_paths()[0]
        os.truncate(path, 20480 + 4096)  # cuts b's slot (20480..40960) short
        with pytest.raises(OSError, match=r"is 24576 bytes but a shard's slot ends at 40960 .* truncated from outside") as ei:
            st.fetch("b", "cpu").result()
        assert ei.value.errno == errno.EIO
        assert st.residency("b") is Residency.NVME  # the failed move went back where it started
        assert st.stats()["cpu"]["bytes_in_use"] == 0  # and its staging buffer was returned
        assert torch.equal(st.fetch("a", "cpu").result(), a)  # a is intact
        # the shard stays usable: a new working copy written back restores the slot
        st.register("c", 10, home="cpu").result()
        assert st.fetch("c", "device").result().sum() == 0


def test_bit_flipped_swap_slot_is_detected(tmp_path):
    """A byte changed on disk under a shard's slot: the read raises SwapCorruptError naming the file and the
    offset, the shard stays on nvme, and its neighbour reads back intact."""
    with TieredStore(cfg(tmp_path / "s")) as st:
        a, b = torch.randn(5000), torch.randn(5000)
        st.register("a", 5000, home="nvme", init=a).result()
        st.register("b", 5000, home="nvme", init=b).result()
        path = st.swap_paths()[0]
        fd = os.open(path, os.O_RDWR)
        try:
            byte = os.pread(fd, 1, 20480 + 100)  # inside b's slot (20480..40960)
            os.pwrite(fd, bytes([byte[0] ^ 0x04]), 20480 + 100)
            os.fsync(fd)
        finally:
            os.close(fd)
        with pytest.raises(SwapCorruptError, match=rf"shard 'b': 20480 bytes read back from {re.escape(path)} at "
                                                   r"offset 20480 differ from what was written \(XXH3-64"):
            st.fetch("b", "cpu").result()
        assert st.residency("b") is Residency.NVME
        assert torch.equal(st.fetch("a", "cpu").result(), a)


def test_swap_checksums_can_be_turned_off(tmp_path):
    with TieredStore(cfg(tmp_path / "s", checksums=False)) as st:
        st.register("a", 5000, home="nvme", init=torch.ones(5000)).result()
        path = st.swap_paths()[0]
        fd = os.open(path, os.O_RDWR)
        os.pwrite(fd, b"\0\0\0\0", 0)  # a[0] becomes 0.0: without checksums, read as it is
        os.fsync(fd)
        os.close(fd)
        assert st.fetch("a", "cpu").result()[0].item() == 0.0


@pytest.mark.filterwarnings("ignore:offload aio.*O_DIRECT:RuntimeWarning")
@pytest.mark.parametrize("checksums", [True, False])
def test_a_torn_write_is_never_read_back(tmp_path, checksums):
    """A write-behind fails after its first page landed (EIO, injected into the engine's write): the slot holds
    neither the old bytes nor the new. Reading it back raised SwapCorruptError blaming the drive (the checksum
    was recorded before the write), or, without checksums, returned the torn bytes. Now the working copy is
    kept while the slot is torn: a release retries the write and, while that fails, raises and keeps the copy;
    the neighbour's slot is intact."""
    from offload.store import LeaseMode

    with TieredStore(cfg(tmp_path / "s", checksums=checksums)) as st:
        st.register("m", 4096, home="nvme", init=torch.zeros(4096)).result()
        st.register("n", 4096, home="nvme", init=torch.full((4096,), 2.0)).result()
        engine, write = st._engine, st._engine.write

        def torn(f, offset, buf):
            write(f, offset, buf[:4096]).wait()
            raise AioError(errno.EIO, "injected EIO after one page")

        engine.write = torn
        lease = st.lease("m", "cpu", LeaseMode.UPDATE)
        lease.wait().fill_(1.0)
        assert isinstance(lease.release().exception(), AioError)
        assert isinstance(st.release("m").exception(), AioError)  # retried, failed again: the copy stays
        assert st.residency("m") is Residency.CPU
        assert torch.equal(st.fetch("m", "cpu").result(), torch.ones(4096))  # the working copy, not the slot
        assert torch.equal(st.fetch("n", "cpu").result(), torch.full((4096,), 2.0))
        engine.write = write  # the drive recovers: the next release saves the update
        st.release("m").result()
        assert st.residency("m") is Residency.NVME
        assert torch.equal(st.fetch("m", "cpu").result(), torch.ones(4096))


@pytest.mark.filterwarnings("ignore:offload aio.*O_DIRECT:RuntimeWarning")
@pytest.mark.parametrize("later", ["read lease", "release"])
def test_a_copy_whose_write_behind_failed_is_saved_by_the_next_release(tmp_path, later):
    """An UPDATE lease's write-behind fails (EIO once): the working copy keeps the update. A later READ lease's
    release (or a plain release without writeback) used to drop that copy, losing the update with no error
    until the torn slot was read; now it writes the copy home first, and the update reads back."""
    from offload.store import LeaseMode

    with TieredStore(cfg(tmp_path / "s")) as st:
        st.register("m", 4096, home="nvme", init=torch.zeros(4096)).result()
        engine, write = st._engine, st._engine.write

        def fails_once(f, offset, buf):
            engine.write = write
            raise AioError(errno.EIO, "injected EIO")

        engine.write = fails_once
        lease = st.lease("m", "cpu", LeaseMode.UPDATE)
        lease.wait().fill_(1.0)
        assert isinstance(lease.release().exception(), AioError)
        if later == "read lease":
            reader = st.lease("m", "cpu", LeaseMode.READ)
            assert torch.equal(reader.wait(), torch.ones(4096))  # the working copy, not the torn slot
            reader.release().result()
        else:
            st.release("m").result()
        assert st.residency("m") is Residency.NVME
        assert torch.equal(st.fetch("m", "cpu").result(), torch.ones(4096))  # read from the slot: the update


def test_symlink_planted_at_swap_path(tmp_path):
    d = tmp_path / "s"
    d.mkdir(mode=0o700)
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious" * 1000)
    os.symlink(victim, d / "rank0-params.swap")
    with TieredStore(cfg(d)) as st:
        with pytest.raises(AioError, match=r"symbolic link.*O_NOFOLLOW") as ei:
            st.register("x", 1000, home="nvme", init=torch.ones(1000))
        assert ei.value.errno == errno.ELOOP
        st.register("y", 1000, home="nvme", tier_class="optim", init=torch.ones(1000)).result()  # other files fine
    assert victim.read_bytes() == b"precious" * 1000  # never followed, never truncated, never removed
    assert os.path.islink(d / "rank0-params.swap")  # not ours: left alone
    assert not os.path.exists(d / "rank0-optim.swap")  # ours: removed


def test_swap_files_are_private(tmp_path):
    with TieredStore(cfg(tmp_path / "s", rank=3)) as st:
        st.register("x", 1000, home="nvme", tier_class="optim").result()
        st.register("y", 1000, home="nvme", tier_class="params").result()
        paths = sorted(st.swap_paths())
        assert [os.path.basename(p) for p in paths] == ["rank3-optim.swap", "rank3-params.swap"]
        assert oct(os.stat(tmp_path / "s").st_mode & 0o777) == "0o700"
        for p in paths:
            assert oct(os.stat(p).st_mode & 0o777) == "0o600"
            assert os.stat(p).st_size == 4096  # preallocated to the slots it holds
