"""Shared helpers of the tests/test_aio_*.py files: backends to run, aligned random data, mounts."""
from __future__ import annotations

import contextlib
import os
import subprocess

import pytest
import torch

from offload.store.aio import aio_backends, aligned_empty


def usable_backends() -> list[str]:
    """Every backend this machine can run: the C++ ones when built and allowed, and the Python one."""
    return [name for name, state in aio_backends().items() if state == "usable"]


BACKENDS = usable_backends()


def random_bytes(nbytes: int, seed: int, aligned: bool = True) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    t = aligned_empty(nbytes) if aligned else torch.empty(nbytes, dtype=torch.uint8)
    t.copy_(torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g))
    return t


def file_bytes(path: str, offset: int, nbytes: int) -> bytes:
    """The bytes on disk, read with plain buffered os.pread: the reference the engine is checked against."""
    fd = os.open(path, os.O_RDONLY)
    try:
        out = bytearray()
        while len(out) < nbytes:
            chunk = os.pread(fd, nbytes - len(out), offset + len(out))
            if not chunk:
                break
            out += chunk
        return bytes(out)
    finally:
        os.close(fd)


@contextlib.contextmanager
def mounted(where, fstype: str, options: str = ""):
    """Mounts a fresh `fstype` at `where` for the block (needs root and CAP_SYS_ADMIN) or skips the test."""
    os.makedirs(where, exist_ok=True)
    if os.geteuid() != 0:
        pytest.skip(f"needs root to mount a {fstype} filesystem (running as uid {os.geteuid()})")
    cmd = ["mount", "-t", fstype] + (["-o", options] if options else []) + [fstype, str(where)]
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        pytest.skip(f"cannot run mount: {exc}")
    if res.returncode != 0:
        pytest.skip(f"cannot mount {fstype} here: {res.stderr.strip() or res.returncode}")
    try:
        yield str(where)
    finally:
        subprocess.run(["umount", "-l", str(where)], capture_output=True, timeout=30)


def _comm(tid: str) -> str:
    try:
        with open(f"/proc/self/task/{tid}/comm") as f:
            return f.read().strip()
    except OSError:  # the thread exited between listdir and open
        return "iou-gone"


def thread_count() -> int:
    """Threads this process created (catches C++ threads that Python's threading module cannot see).

    io_uring's kernel helpers (iou-wrk-*, iou-sqp-*) are left out: the kernel owns them and retires them
    on its own schedule, possibly during a later test, so counting them made leak checks fail by chance
    (a helper of an earlier test exiting mid-test dropped the count below the baseline). A leaked ring is
    still caught, by its file descriptor (fd_count)."""
    return sum(1 for tid in os.listdir("/proc/self/task") if not _comm(tid).startswith("iou-"))


def fd_count() -> int:
    return len(os.listdir("/proc/self/fd"))
