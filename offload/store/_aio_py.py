"""Pure-Python stand-in for the C++ aio core (`_C.AioEngineCore`), used when the extension cannot be
built: the same pieces, queue and completion rules, on `queue_depth` threads calling os.preadv /
os.pwritev (which release the GIL). Slower per request, same results and errors."""
from __future__ import annotations

import ctypes
import errno
import math
import os
import queue
import threading
import time

_FOREVER_S = 1e8  # longer (or non-finite) timeouts wait forever: threading's timeouts overflow past ~9e9 s
_MAX_RETRIES = 10000  # EAGAIN/EINTR resubmissions per piece before giving up (never spin forever)


class PyBatch:
    """Completion state of one submit: counts pieces down, keeps the first failure."""

    def __init__(self, requests: list[tuple], pieces: int):
        self._reqs = requests
        self._pending = pieces
        self._error: tuple | None = None
        self._cv = threading.Condition()

    def done(self) -> bool:
        with self._cv:
            return self._pending == 0

    def failed(self) -> bool:
        with self._cv:
            return self._error is not None

    def abandoned(self) -> bool:
        return False  # blocking calls: a piece is only retired once its syscall has returned

    def bytes(self) -> int:
        return sum(r[5] for r in self._reqs)

    def wait(self, timeout_s: float = -1.0) -> bool:
        with self._cv:
            # The caller needs the bytes (or the error) before it may touch the buffer again.
            forever = timeout_s < 0 or not math.isfinite(timeout_s) or timeout_s > _FOREVER_S
            return self._cv.wait_for(lambda: self._pending == 0, None if forever else timeout_s)

    def error(self) -> tuple:
        with self._cv:
            return self._error or (0, False, "", 0, 0, 0, 0, "")

    def piece_finished(self, err: int, req_index: int, offset: int, length: int, detail: str = "") -> None:
        with self._cv:
            if err and self._error is None:
                _fd, write, path, req_off, _addr, req_len = self._reqs[req_index]
                self._error = (err, write, path, req_off, req_len, offset, length, detail)
            self._pending -= 1
            if self._pending == 0:
                self._cv.notify_all()


class _Piece:
    __slots__ = ("batch", "req_index", "fd", "write", "addr", "offset", "length", "done", "retries", "finished")

    def __init__(self, batch, req_index, fd, write, addr, offset, length):
        self.batch, self.req_index, self.fd, self.write = batch, req_index, fd, write
        self.addr, self.offset, self.length, self.done, self.retries = addr, offset, length, 0, 0
        self.finished = False

    def finish(self, err: int, detail: str = "") -> None:
        self.finished = True
        self.batch.piece_finished(err, self.req_index, self.offset + self.done, self.length - self.done, detail)


def _eof_detail(p: _Piece) -> str:
    try:
        size = str(os.fstat(p.fd).st_size)
    except OSError:
        size = "?"
    return (f"unexpected end of file: the file holds {size} bytes but the read needs bytes up to "
            f"{p.offset + p.length} (truncated file?)")


def _run_piece(p: _Piece) -> None:
    while True:
        n = p.length - p.done
        view = memoryview((ctypes.c_char * n).from_address(p.addr + p.done)).cast("B")
        pos = p.offset + p.done
        try:
            res = os.pwritev(p.fd, [view], pos) if p.write else os.preadv(p.fd, [view], pos)
        except OSError as exc:
            if exc.errno in (errno.EAGAIN, errno.EINTR) and p.retries < _MAX_RETRIES:
                p.retries += 1
                if p.retries > 16:
                    time.sleep(1e-4)  # persistent EAGAIN: back off instead of spinning
                continue
            p.finish(exc.errno or errno.EIO, f"after a short transfer of {p.done} bytes" if p.done else "")
            return
        if res == 0:
            if p.write:
                p.finish(errno.EIO, "the write made no progress (0 bytes written)")
            else:
                p.finish(errno.ENODATA, _eof_detail(p))
            return
        p.done += res
        if p.done >= p.length:
            p.finish(0)
            return
        if not p.write and os.fstat(p.fd).st_size <= p.offset + p.done:
            p.finish(errno.ENODATA, _eof_detail(p))
            return


class PyEngineCore:
    """Same interface as `_C.AioEngineCore`, backend name "python"."""

    backend = "python"

    def __init__(self, backend: str, block_size: int, queue_depth: int, workers: int):
        if not 1 <= queue_depth <= 4096:
            raise ValueError(f"offload aio: queue_depth must be between 1 and 4096, got {queue_depth}")
        if not 1 <= block_size <= 1 << 30:
            raise ValueError(f"offload aio: block_size must be between 1 byte and 1 GiB, got {block_size}")
        self.block_size = block_size
        self.queue_depth = queue_depth
        self.fallback_reason = "the C++ extension is unavailable"
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._closed = False
        self._threads = [threading.Thread(target=self._loop, name=f"offload-aio-py-{i}", daemon=True)
                         for i in range(queue_depth)]
        for t in self._threads:
            t.start()

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def num_threads(self) -> int:
        return len(self._threads)

    def _loop(self) -> None:
        while True:
            p = self._q.get()  # an idle worker sleeps until a piece arrives or close() sends None
            if p is None:
                return
            if self._closed:
                p.finish(errno.ECANCELED, "the engine was closed before this block started")
            elif p.batch.failed():
                p.finish(errno.ECANCELED, "skipped: an earlier block of this batch failed")
            else:
                try:
                    _run_piece(p)
                except BaseException as exc:  # noqa: BLE001 - an unfinished piece would leave its wait() hanging
                    if not p.finished:
                        p.finish(errno.EIO, f"the python engine's worker failed: {exc!r}")

    def submit(self, requests: list[tuple]) -> PyBatch:
        bs = self.block_size
        pieces = sum(-(-r[5] // bs) for r in requests)
        batch = PyBatch(list(requests), pieces)
        with self._lock:
            if self._closed:
                raise ValueError("offload aio: submit on a closed engine")
            for i, (fd, write, _path, offset, addr, nbytes) in enumerate(requests):
                for o in range(0, nbytes, bs):
                    self._q.put(_Piece(batch, i, fd, write, addr + o, offset + o, min(bs, nbytes - o)))
        return batch

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for _ in self._threads:
                self._q.put(None)
        for t in self._threads:
            t.join()  # queued pieces are cancelled by the loop; in-flight ones finish first
        self._threads = []
