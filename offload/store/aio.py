"""Async file I/O for the NVMe tier: O_DIRECT reads and writes of CPU tensors, many in flight.

    eng = AioEngine(block_size="1MiB", queue_depth=32, workers=2, backend="auto")
    with eng.open("/nvme/swap.bin", "w+") as f:
        eng.fallocate(f, 64 << 20)
        eng.write(f, 0, tensor).wait()
        h = eng.read(f, 0, out)      # returns at once; the GIL is free while the I/O runs
        h.wait()                     # raises AioError (an OSError) naming file, operation, offset, errno

Each request is cut into `block_size` pieces that the engine keeps `queue_depth` deep in flight,
on io_uring rings (one per worker thread) or, where io_uring is missing, on `queue_depth` threads
calling pread/pwrite. The handle holds the tensors until the I/O is over, even if dropped early.

O_DIRECT needs buffer address, file offset and length to be multiples of the file's alignment
(4096 or the device's own): misaligned requests raise AioError(EINVAL) before anything is queued.
Files on filesystems that refuse O_DIRECT are reopened buffered, with one warning naming the path.
"""
from __future__ import annotations

import errno as _errno
import math
import os
import shutil
import threading
import warnings
import weakref
from typing import Iterable, Sequence

import torch

from .. import _ext
from ..ops.copy import aligned_empty
from .sizes import parse_size

__all__ = ["AioEngine", "AioFile", "AioHandle", "AioError", "AioTimeoutError", "aio_backends", "aligned_empty",
           "parse_size"]


class AioError(OSError):
    """An I/O failure of the aio engine. `.errno`, `.filename` as for OSError; str() is the full message
    (file, operation, offset, length, errno name and text)."""

    def __init__(self, err: int, message: str, filename: str | None = None):
        super().__init__(err, message, filename)
        self.message = message

    def __str__(self) -> str:
        return self.message


class AioTimeoutError(AioError, TimeoutError):
    """`AioHandle.wait(timeout)` ran out of time; the I/O is still in flight."""


# Timeouts above this (about 3 years) mean "forever": the cores' clocks overflow on inf or 1e300.
_FOREVER_S = 1e8


def _errname(err: int) -> str:
    return _errno.errorcode.get(err, f"errno {err}")


_HINTS = {
    _errno.ENOSPC: "the filesystem is full: free space or point the swap directory at a larger disk",
    _errno.EFBIG: "the file would exceed the size limit (RLIMIT_FSIZE or the filesystem's maximum file size)",
    _errno.EBADF: "the file is not open for this operation (opened read-only?) or was closed",
    _errno.EROFS: "the filesystem is mounted read-only",
    _errno.EACCES: "permission denied on the path or its directory",
    _errno.ELOOP: "the path is a symbolic link; offload opens swap files with O_NOFOLLOW and refuses links",
    _errno.ENOENT: "the file or its directory does not exist",
    _errno.EIO: "the device reported an I/O error (check dmesg)",
}


def _hint(err: int) -> str:
    return f" [{_HINTS[err]}]" if err in _HINTS else ""


def aio_backends() -> dict[str, str]:
    """Each backend and whether it is usable here ("usable" or the reason it is not)."""
    mod = _ext.get()
    if mod is None:
        reason = f"C++ extension unavailable ({_ext.error()})"
        return {"threads": reason, "io_uring": reason, "python": "usable"}
    out = dict(mod.aio_backends())
    out["python"] = "usable"
    return out


_warned_dirs: set[str] = set()
_warn_lock = threading.Lock()


def _warn_buffered(path: str) -> None:
    directory = os.path.dirname(os.path.abspath(path))
    with _warn_lock:
        if directory in _warned_dirs:
            return
        _warned_dirs.add(directory)
    warnings.warn(
        f"offload aio: the filesystem of '{path}' refuses O_DIRECT (EINVAL); using buffered I/O for files in "
        f"{directory} (correct, but goes through the page cache; put swap files on a local disk for direct I/O)",
        RuntimeWarning,
        stacklevel=3,
    )


_MODES = {
    "r": os.O_RDONLY,
    "r+": os.O_RDWR,
    "w+": os.O_RDWR | os.O_CREAT | os.O_TRUNC,
    "x+": os.O_RDWR | os.O_CREAT | os.O_EXCL,
}


class AioFile:
    """A file opened by `AioEngine.open` (O_NOFOLLOW, O_CLOEXEC, O_DIRECT unless refused or direct=False)."""

    def __init__(self, path: str, fd: int, mode: str, direct: bool, alignment: int):
        self.path = path
        self.fd = fd
        self.mode = mode
        self.direct = direct
        self.alignment = alignment  # bytes; 1 for buffered files
        self._inflight: list = []   # batches that may still touch this fd (pruned as they finish)
        self._lock = threading.Lock()
        self._pid = os.getpid()     # a forked child holds a copy of the fd but none of the I/O on it
        self._engine = None         # weakref to the opening engine: takes over the fd if dropped mid-I/O

    @property
    def closed(self) -> bool:
        return self.fd < 0

    @property
    def size(self) -> int:
        self._check_open()
        return os.fstat(self.fd).st_size

    def fileno(self) -> int:
        self._check_open()
        return self.fd

    def _check_open(self) -> None:
        if self.fd < 0:
            raise ValueError(f"offload aio: I/O on closed file '{self.path}'")

    def _track_locked(self, batch) -> None:
        """Records a batch that may touch the fd; the caller holds self._lock (see AioEngine._submit)."""
        self._inflight = [b for b in self._inflight if not b.done()]
        self._inflight.append(batch)

    def close(self) -> None:
        """Waits for this file's in-flight I/O (the fd must outlive it), then closes. Idempotent."""
        with self._lock:
            if self.fd < 0:
                return
            pending, self._inflight = self._inflight, []
            if os.getpid() != self._pid:
                pending = []  # forked child: the I/O runs in the parent on the parent's fd; ours is a copy
            for b in pending:
                b.wait(-1.0)  # closing the fd under a queued piece would read or write a reused fd
            fd, self.fd = self.fd, -1
        os.close(fd)

    def __enter__(self) -> "AioFile":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        # Dropped without close(): the engine only holds files weakly, so the fd would leak. Close it
        # now, or, while I/O still uses it, hand it to the engine to close once that I/O is over.
        try:
            fd = self.fd
            if fd < 0:
                return
            self.fd = -1
            pending = [b for b in self._inflight if not b.done()] if os.getpid() == self._pid else []
            engine = self._engine() if self._engine is not None else None
            if pending and engine is not None:
                engine._adopt_fd(fd, pending)
                return
            for b in pending:
                b.wait(-1.0)  # no engine left to hand the fd to; the kernel may still be using it
            os.close(fd)
        except Exception:
            pass

    def __repr__(self) -> str:
        state = "closed" if self.fd < 0 else f"fd={self.fd}"
        return f"AioFile({self.path!r}, mode={self.mode!r}, direct={self.direct}, {state})"


# Buffers of batches the engine had to abandon while the kernel may still own them (a broken io_uring
# ring): kept referenced for the life of the process, so late kernel I/O can never land in reused memory.
_ABANDONED: list = []


def _release(batch, tensors: list) -> None:
    """Drops the references a finished batch held, unless the kernel may still use the buffers."""
    if tensors and batch.abandoned():
        _ABANDONED.append(tensors)


class AioHandle:
    """One submitted read/write (or batch). Keeps its tensors alive until the I/O is over."""

    def __init__(self, engine: "AioEngine", batch, tensors: list[torch.Tensor]):
        self._engine = engine
        self._batch = batch
        self._tensors = tensors

    @property
    def nbytes(self) -> int:
        return self._batch.bytes()

    def done(self) -> bool:
        """True once every piece has finished (successfully or not); never blocks."""
        if self._batch.done():
            _release(self._batch, self._tensors)
            self._tensors = []
            return True
        return False

    def wait(self, timeout: float | None = None) -> None:
        """Blocks (GIL released) until done; raises AioError on failure, AioTimeoutError on timeout.
        timeout: seconds; None, inf or more than 1e8 wait forever."""
        limit = -1.0
        if timeout is not None:
            limit = float(timeout)
            if math.isnan(limit):
                raise ValueError("offload aio: wait(timeout) must be a number of seconds or None, got nan")
            limit = -1.0 if limit > _FOREVER_S else max(0.0, limit)  # inf included; see _FOREVER_S
        if not self._batch.wait(limit):
            raise AioTimeoutError(_errno.ETIMEDOUT, f"offload aio: I/O of {self.nbytes} bytes still in flight "
                                  f"after {timeout} s")
        _release(self._batch, self._tensors)
        self._tensors = []
        exc = self.exception()
        if exc is not None:
            raise exc

    def exception(self) -> AioError | None:
        """The failure of a finished handle as an AioError, or None (also None while still running)."""
        if not self._batch.done() or not self._batch.failed():
            return None
        err, write, path, req_off, req_len, off, length, detail = self._batch.error()
        op = "write" if write else "read"
        where = f"at offset {off} ({length} bytes"
        if (off, length) != (req_off, req_len):
            where += f"; request: offset {req_off}, length {req_len}"
        msg = (f"offload aio: {op} of '{path}' failed {where}): {_errname(err)} ({os.strerror(err)})"
               + (f"; {detail}" if detail else "") + _hint(err))
        return AioError(err, msg, path)

    def __del__(self):
        # Dropped before completion: the engine keeps the tensors until the kernel is done with them.
        try:
            if self._tensors and not self._batch.done():
                self._engine._adopt(self._batch, self._tensors)
            elif self._tensors:
                _release(self._batch, self._tensors)
        except Exception:
            pass


class AioEngine:
    """The async I/O engine. See the module docstring.

    block_size:  pieces each request is cut into ("1MiB"); a multiple of 4096.
    queue_depth: most pieces in flight at once, engine-wide.
    workers:     io_uring submitting threads, each with its share of queue_depth (threads backend:
                 queue_depth blocking threads, one piece each).
    backend:     "auto" (io_uring when built with liburing and the kernel allows it, else threads),
                 "io_uring", "threads", or "python" (no C++ extension; used by "auto" when it is missing).
    """

    def __init__(self, block_size: int | str = "1MiB", queue_depth: int = 32, workers: int = 2,
                 backend: str = "auto"):
        bs = parse_size(block_size, "block_size", counts=True)
        if bs <= 0 or bs % 4096:
            raise ValueError(f"offload aio: block_size must be a positive multiple of 4096 bytes (O_DIRECT), "
                             f"got {block_size!r} = {bs}")
        if backend not in ("auto", "io_uring", "threads", "python"):
            raise ValueError(f"offload aio: backend must be 'auto', 'io_uring', 'threads' or 'python', got {backend!r}")
        if not isinstance(queue_depth, int) or not isinstance(workers, int):
            raise TypeError("offload aio: queue_depth and workers must be integers")
        mod = None if backend == "python" else _ext.get()
        if mod is None and backend in ("io_uring", "threads"):
            _ext.require()  # raises with the reason and the fix
        if mod is None:
            from ._aio_py import PyEngineCore

            if backend == "auto":
                _ext.warn_fallback("the async NVMe engine")
            self._core = PyEngineCore(backend, bs, queue_depth, workers)
        else:
            self._core = mod.AioEngineCore(backend, bs, queue_depth, workers)
        self._mod = mod
        self._pid = os.getpid()  # the workers exist only in this process (see _submit)
        self._files: "weakref.WeakSet[AioFile]" = weakref.WeakSet()
        self._orphans: list[tuple] = []
        self._orphan_fds: list[tuple] = []  # (fd, batches) of files dropped while their I/O ran
        self._lock = threading.Lock()

    # -- properties ------------------------------------------------------------------------------
    @property
    def backend(self) -> str:
        return self._core.backend

    @property
    def fallback_reason(self) -> str:
        """Why "auto" did not pick io_uring ("" when it did)."""
        return self._core.fallback_reason

    @property
    def block_size(self) -> int:
        return self._core.block_size

    @property
    def queue_depth(self) -> int:
        return self._core.queue_depth

    @property
    def num_threads(self) -> int:
        return self._core.num_threads

    @property
    def closed(self) -> bool:
        return self._core.closed

    # -- files -----------------------------------------------------------------------------------
    def open(self, path: str | os.PathLike, mode: str = "r+", direct: bool = True) -> AioFile:
        """Opens `path` with O_NOFOLLOW|O_CLOEXEC (and O_DIRECT when `direct`), 0600 when created.

        mode: "r" read-only, "r+" read/write existing, "w+" create or truncate, "x+" create, must not exist.
        """
        self._check_open()
        self._reap_orphans()
        path = os.fspath(path)
        if mode not in _MODES:
            raise ValueError(f"offload aio: mode must be one of {sorted(_MODES)}, got {mode!r}")
        flags = _MODES[mode] | os.O_NOFOLLOW | os.O_CLOEXEC
        existed = os.path.lexists(path)
        use_direct = direct
        try:
            fd = self._os_open(path, flags | (os.O_DIRECT if direct else 0), mode, direct)
        except AioError as exc:
            if not (direct and exc.errno == _errno.EINVAL):
                raise
            # The filesystem refuses O_DIRECT. Linux may have created the file before refusing it.
            if mode == "x+" and not existed:
                flags &= ~os.O_EXCL
            fd = self._os_open(path, flags, mode, False)
            use_direct = False
            _warn_buffered(path)
        align = 1
        if use_direct:
            align = int(self._mod.aio_dio_alignment(fd)) if self._mod is not None else 4096
        f = AioFile(path, fd, mode, use_direct, align)
        f._engine = weakref.ref(self)
        with self._lock:
            self._files.add(f)
        return f

    @staticmethod
    def _os_open(path: str, flags: int, mode: str, direct: bool) -> int:
        try:
            return os.open(path, flags, 0o600)
        except OSError as exc:
            err = exc.errno or _errno.EIO
            how = f"mode {mode!r}" + (", O_DIRECT" if direct else "")
            raise AioError(err, f"offload aio: cannot open '{path}' ({how}): {_errname(err)} "
                           f"({os.strerror(err)}){_hint(err)}", path) from None

    def fallocate(self, f: AioFile, nbytes: int | str) -> None:
        """Reserves `nbytes` of disk for `f` (posix_fallocate from 0), so later writes cannot hit ENOSPC."""
        n = parse_size(nbytes, "nbytes", counts=True)
        f._check_open()
        if n <= 0:
            return
        try:
            os.posix_fallocate(f.fd, 0, n)  # releases the GIL
        except OSError as exc:
            err = exc.errno or _errno.EIO
            free = ""
            try:
                free = f"; {shutil.disk_usage(os.path.dirname(os.path.abspath(f.path))).free} bytes free"
            except OSError:
                pass
            raise AioError(err, f"offload aio: fallocate of '{f.path}' to {n} bytes failed: {_errname(err)} "
                           f"({os.strerror(err)}){free}{_hint(err)}", f.path) from None

    # -- I/O -------------------------------------------------------------------------------------
    def read(self, f: AioFile, offset: int, tensor: torch.Tensor) -> AioHandle:
        """Fills `tensor` (contiguous CPU, any dtype) with its nbytes bytes of `f` from `offset`."""
        return self._submit([(f, offset, tensor)], write=False)

    def write(self, f: AioFile, offset: int, tensor: torch.Tensor) -> AioHandle:
        """Writes the bytes of `tensor` to `f` at `offset`."""
        return self._submit([(f, offset, tensor)], write=True)

    def read_many(self, items: Iterable[Sequence]) -> AioHandle:
        """Reads [(f, offset, tensor), ...] as one handle."""
        return self._submit(list(items), write=False)

    def write_many(self, items: Iterable[Sequence]) -> AioHandle:
        """Writes [(f, offset, tensor), ...] as one handle."""
        return self._submit(list(items), write=True)

    def _submit(self, items: list, write: bool) -> AioHandle:
        self._check_open()
        if os.getpid() != self._pid:
            # fork() copies no worker thread: queued pieces would never run and wait() would hang.
            raise RuntimeError(f"offload aio: engine created in pid {self._pid} cannot be used after fork (this "
                               f"is pid {os.getpid()}, where its worker threads do not exist); create a new "
                               f"AioEngine in the child")
        self._reap_orphans()
        op = "write" if write else "read"
        reqs, keep, files = [], [], {}
        for item in items:
            f, offset, t = item
            if not isinstance(f, AioFile):
                raise TypeError(f"offload aio: {op} needs an AioFile from AioEngine.open, got {type(f).__name__}")
            f._check_open()
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"offload aio: {op} of '{f.path}': tensor must be a torch.Tensor, got {type(t).__name__}")
            if t.device.type != "cpu" or not t.is_contiguous():
                raise ValueError(f"offload aio: {op} of '{f.path}': tensor must be a contiguous CPU tensor "
                                 f"(got device={t.device}, contiguous={t.is_contiguous()})")
            offset = int(offset)
            if offset < 0:
                raise ValueError(f"offload aio: {op} of '{f.path}': offset must be >= 0, got {offset}")
            nbytes = t.numel() * t.element_size()
            addr = t.data_ptr()
            if f.direct and nbytes:
                self._check_aligned(f, op, addr, offset, nbytes)
                self._check_pieces_aligned(f, op, nbytes)
            reqs.append((f, write, f.path, offset, addr, nbytes))
            keep.append(t)
            files[id(f)] = f
        # Hold every file's lock (in one global order, so two submits cannot deadlock) from the open
        # check through recording the batch: a close() from another thread then waits for this batch
        # instead of closing the fd while its pieces are queued (EBADF, or bytes written into whatever
        # file reuses the fd number).
        locked = sorted(files.values(), key=id)
        for f in locked:
            f._lock.acquire()
        try:
            for f in locked:
                f._check_open()
            batch = self._core.submit([(r[0].fd,) + r[1:] for r in reqs])  # fds read under the locks
            for f in locked:
                f._track_locked(batch)
        finally:
            for f in reversed(locked):
                f._lock.release()
        return AioHandle(self, batch, keep)

    @staticmethod
    def _check_aligned(f: AioFile, op: str, addr: int, offset: int, nbytes: int) -> None:
        a = f.alignment
        for name, value in (("buffer address", addr), ("offset", offset), ("length", nbytes)):
            if value % a:
                shown = hex(value) if name == "buffer address" else str(value)
                raise AioError(
                    _errno.EINVAL,
                    f"offload aio: {op} of '{f.path}' at offset {offset} ({nbytes} bytes): {name} {shown} is not a "
                    f"multiple of {a} (off by {value % a} bytes): EINVAL; O_DIRECT needs buffer address, offset and "
                    f"length aligned to {a} bytes (allocate buffers from the pinned arena, or open with direct=False)",
                    f.path,
                )

    def _check_pieces_aligned(self, f: AioFile, op: str, nbytes: int) -> None:
        # The engine cuts a request at multiples of block_size: on a device whose O_DIRECT alignment exceeds
        # block_size (8 KiB+ sectors), every piece after the first would start misaligned and fail with EINVAL.
        bs = self.block_size
        if nbytes > bs and bs % f.alignment:
            raise AioError(
                _errno.EINVAL,
                f"offload aio: {op} of '{f.path}' ({nbytes} bytes): this engine cuts requests into block_size = {bs} "
                f"byte pieces, but the file needs O_DIRECT I/O aligned to {f.alignment} bytes; set block_size (the "
                f"store's aio_block_size) to a multiple of {f.alignment}",
                f.path,
            )

    # -- lifetime --------------------------------------------------------------------------------
    def _adopt(self, batch, tensors: list) -> None:
        with self._lock:
            self._orphans.append((batch, tensors))

    def _adopt_fd(self, fd: int, batches: list) -> None:
        with self._lock:
            self._orphan_fds.append((fd, batches))

    def _reap_orphans(self) -> None:
        done_fds = []
        with self._lock:
            if self._orphans:
                for batch, tensors in self._orphans:
                    if batch.done():
                        _release(batch, tensors)
                self._orphans = [o for o in self._orphans if not o[0].done()]
            if self._orphan_fds:
                still = []
                for fd, batches in self._orphan_fds:
                    if all(b.done() for b in batches):
                        done_fds.append(fd)
                    else:
                        still.append((fd, batches))
                self._orphan_fds = still
        for fd in done_fds:
            os.close(fd)

    def _check_open(self) -> None:
        if self._core.closed:
            raise ValueError("offload aio: the engine is closed")

    def close(self) -> None:
        """Cancels queued pieces (their handles fail with ECANCELED), waits for the ones in the
        kernel, joins the workers and closes the files it opened. Idempotent."""
        if self._core.closed:
            return
        self._core.close()  # GIL released while joining
        with self._lock:
            files = list(self._files)
            for batch, tensors in self._orphans:
                _release(batch, tensors)  # every batch is over now: the core has joined its workers
            self._orphans = []
            fds, self._orphan_fds = [fd for fd, _ in self._orphan_fds], []
        for f in files:
            f.close()
        for fd in fds:  # the workers are joined: no I/O can still use these
            os.close(fd)

    def __enter__(self) -> "AioEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    def __repr__(self) -> str:
        return (f"AioEngine(backend={self.backend!r}, block_size={self.block_size}, queue_depth={self.queue_depth}, "
                f"threads={self.num_threads}{', closed' if self.closed else ''})")
