"""Swap files of the NVMe tier: one preallocated file per (rank, tier class), shards at 4096-aligned slots.

    d = SwapDir("/nvme/run1")            # creates the directory 0700 if missing (its parent must exist)
    f = SwapFile(engine, d, "params", rank=0)   # <dir>/rank0-params.swap, 0600, O_NOFOLLOW, O_DIRECT
    off = f.reserve(nbytes)              # a slot: freed space first (best fit), else the file grows (fallocate)
    f.free(off, nbytes)                  # given back: merged with its free neighbours, reused by later slots
    f.close(); d.close()                 # removes the file, and the directory if SwapDir created it

A symlink planted at a swap path is refused (O_NOFOLLOW: ELOOP); an existing regular file there is
truncated (it is ours: a leftover of a run that crashed).
"""
from __future__ import annotations

import errno
import os
import shutil
import stat

from .aio import AioEngine, AioError, AioFile
from .sizes import SLOT_ALIGN, format_bytes, page_bytes

__all__ = ["SwapDir", "SwapFile", "SwapSpaceError", "SLOT_ALIGN", "page_bytes"]


class SwapSpaceError(OSError):
    """The swap directory's filesystem (or the nvme budget) cannot hold the registered shards."""


class SwapDir:
    def __init__(self, path: str | os.PathLike):
        self.path = os.path.abspath(os.fspath(path))
        self.created = False
        parent = os.path.dirname(self.path)
        if not os.path.lexists(self.path):
            if not os.path.isdir(parent):
                raise FileNotFoundError(
                    errno.ENOENT,
                    f"nvme_path {self.path!r}: its parent directory {parent!r} does not exist; create it or point "
                    "nvme_path at an existing directory on the NVMe drive",
                    self.path,
                )
            try:
                os.mkdir(self.path, 0o700)
            except OSError as e:
                raise type(e)(e.errno, f"nvme_path {self.path!r}: cannot create the swap directory: "
                              f"{os.strerror(e.errno)}", self.path) from None
            os.chmod(self.path, 0o700)  # mkdir's mode is filtered by the umask
            self.created = True
        elif not os.path.isdir(self.path):
            raise NotADirectoryError(errno.ENOTDIR, f"nvme_path {self.path!r} exists and is not a directory", self.path)
        if os.statvfs(self.path).f_flag & os.ST_RDONLY:
            raise OSError(errno.EROFS, f"nvme_path {self.path!r} is on a read-only filesystem; swap files need a "
                          "writable directory", self.path)
        if not os.access(self.path, os.W_OK | os.X_OK):
            raise PermissionError(errno.EACCES, f"nvme_path {self.path!r} is not writable by this process", self.path)

    def free_bytes(self) -> int:
        return shutil.disk_usage(self.path).free

    def close(self) -> None:
        """Removes the directory if this object created it (and it is empty)."""
        if self.created:
            self.created = False
            try:
                os.rmdir(self.path)
            except FileNotFoundError:
                pass


class SwapFile:
    def __init__(self, engine: AioEngine, directory: SwapDir, tier_class: str, rank: int = 0):
        if not tier_class.replace("_", "").isalnum():
            raise ValueError(f"tier_class must be alphanumeric (it names a file), got {tier_class!r}")
        self.engine = engine
        self.dir = directory
        self.tier_class = tier_class
        self.path = os.path.join(directory.path, f"rank{rank}-{tier_class}.swap")
        self.file: AioFile = engine.open(self.path, "w+", direct=True)  # O_NOFOLLOW | O_CREAT | 0600
        st = os.fstat(self.file.fd)
        if not stat.S_ISREG(st.st_mode):
            self.file.close()
            raise OSError(errno.EINVAL, f"swap path {self.path!r} is not a regular file", self.path)
        self._ino = (st.st_dev, st.st_ino)
        self.size = 0  # bytes reserved (file length after fallocate): it never shrinks
        self._free: list[list[int]] = []  # [offset, length] of the space given back, by offset, neighbours merged

    def growth(self, nbytes: int) -> int:
        """Bytes the file grows by for reserve(nbytes): 0 when freed space holds it (what a budget counts)."""
        slot = page_bytes(nbytes)
        if slot == 0 or self._best_fit(slot) is not None:
            return 0
        tail = self._free[-1] if self._free and sum(self._free[-1]) == self.size else None
        return slot - (tail[1] if tail else 0)

    def _best_fit(self, slot: int) -> int | None:
        """Index of the smallest freed extent that holds `slot` (the lowest such), or None."""
        fits = [(length, i) for i, (_, length) in enumerate(self._free) if length >= slot]
        return min(fits)[1] if fits else None

    def reserve(self, nbytes: int) -> int:
        """A 4096-aligned slot of nbytes (rounded up to 4096): in space given back earlier (the smallest extent
        that holds it; short-lived shards, activations, come back each step with the same sizes), else at the
        end of the file (from a freed tail), extended with fallocate so later writes cannot run out of space.
        The caller serializes calls (the store's lock)."""
        slot = page_bytes(nbytes)
        if slot == 0:
            return self.size
        i = self._best_fit(slot)
        if i is not None:
            off, length = self._free[i]
            if length == slot:
                del self._free[i]
            else:
                self._free[i] = [off + slot, length - slot]
            return off
        grow = self.growth(nbytes)
        off = self.size + grow - slot  # (a freed tail is used first)
        free = self.dir.free_bytes()
        if grow > free:
            raise SwapSpaceError(
                errno.ENOSPC,
                f"swap file {self.path!r}: registering needs {grow} more bytes ({format_bytes(grow)}) but its "
                f"filesystem has {free} bytes ({format_bytes(free)}) free; free space or move nvme_path",
                self.path,
            )
        try:
            self.engine.fallocate(self.file, off + slot)
        except AioError as e:
            raise SwapSpaceError(e.errno, f"swap file {self.path!r}: cannot grow to {off + slot} bytes "
                                 f"({format_bytes(off + slot)}, {format_bytes(free)} free): {e}", self.path) from None
        if grow < slot:
            self._free.pop()  # the freed tail is part of the slot now
        self.size = off + slot
        return off

    def free(self, offset: int, nbytes: int) -> None:
        """Give back the slot reserve(nbytes) returned at `offset`, merged with freed neighbours: later slots of
        any size up to the merged extent reuse it (the file does not shrink)."""
        slot = page_bytes(nbytes)
        if not slot:
            return
        k = 0
        while k < len(self._free) and self._free[k][0] < offset:
            k += 1
        self._free.insert(k, [offset, slot])
        if k + 1 < len(self._free) and offset + slot == self._free[k + 1][0]:  # the next extent follows it
            self._free[k][1] += self._free.pop(k + 1)[1]
        if k > 0 and sum(self._free[k - 1]) == offset:  # it follows the previous one
            self._free[k - 1][1] += self._free.pop(k)[1]

    @property
    def free_bytes_in_file(self) -> int:
        return sum(length for _, length in self._free)

    def check_intact(self, end: int) -> None:
        """Raises if the file was cut short of `end` behind the store's back (called before reads)."""
        size = os.fstat(self.file.fd).st_size
        if size < end:
            raise OSError(
                errno.EIO,
                f"swap file {self.path!r} is {size} bytes but a shard's slot ends at {end} (the store allocated "
                f"{self.size}): it was truncated from outside; the shards past its end are lost",
                self.path,
            )

    def close(self, remove: bool = True) -> None:
        if not self.file.closed:
            self.file.close()
        if remove:
            try:
                st = os.lstat(self.path)
                if (st.st_dev, st.st_ino) == self._ino:  # only the file we created, never a replacement
                    os.unlink(self.path)
            except FileNotFoundError:
                pass
