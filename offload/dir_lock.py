"""Which live process owns a directory: an exclusive flock on DIR/.offload-lock, held for the owner's life.

    with DirLock.acquire(out, "offload finetune --output"):   # DirectoryInUse if a live run holds it
        ...
    owner_of(out)           # the live owner (pid, host, what), or None
    remove_stale(parent, "offload-", "offload swap")   # those a dead owner locked for swap: removed, said so

The kernel drops a flock when its process dies, however it dies (kill -9 included), so "is the owner alive"
is answered by trying the lock, never by a pid: pids are reused, and two containers sharing a drive see
each other's pids as dead. The file holds the owner's pid, host and purpose, for the refusal's message.
Used for the fine-tune's output and checkpoint directories (a second run refused with the first one's pid)
and for every swap directory the runtime creates (a dead run's swap is found and removed at the next start).
"""
from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import logging
import os
import shutil
import socket
from pathlib import Path

from .store.sizes import format_bytes

LOCK_NAME = ".offload-lock"

log = logging.getLogger("offload")


@dataclasses.dataclass(frozen=True)
class Owner:
    pid: int
    host: str
    what: str  # the purpose the owner gave, e.g. "offload finetune --output"

    def describe(self) -> str:
        return f"pid {self.pid} on {self.host} ({self.what})"


class DirectoryInUse(RuntimeError):
    def __init__(self, directory: Path, owner: Owner | None):
        who = owner.describe() if owner else "a process that has not written its pid yet"
        super().__init__(f"{directory} is in use by a live run: {who}")
        self.directory, self.owner = directory, owner


def _read_owner(fd: int) -> Owner | None:
    try:
        data = json.loads(os.pread(fd, 4096, 0) or b"null")
        return Owner(int(data["pid"]), str(data["host"]), str(data["what"]))
    except (OSError, ValueError, TypeError, KeyError):
        return None  # the owner is between taking the lock and writing its record


def _same_file(fd: int, path: Path) -> bool:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    mine = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino)


class DirLock:
    """An exclusive flock on `directory`/.offload-lock for this process (directory created if missing).
    release() removes the file while still holding the lock; acquire() re-checks after locking that the
    path still names the file it locked, so an acquirer never holds a lock on a removed file."""

    def __init__(self, directory: Path, fd: int, previous: Owner | None, created: bool):
        self.directory, self._fd = directory, fd
        self.previous = previous  # the record a dead owner left in the file (None: a fresh lock file)
        self._created = created  # acquire() made the directory: release() removes it again if left empty

    @classmethod
    def acquire(cls, directory: str | os.PathLike, what: str) -> "DirLock":
        d = Path(directory)
        created = not d.exists()
        d.mkdir(parents=True, exist_ok=True)
        path = d / LOCK_NAME
        while True:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                owner = _read_owner(fd)
                os.close(fd)
                raise DirectoryInUse(d.absolute(), owner) from None
            except BaseException:
                os.close(fd)
                raise
            if _same_file(fd, path):
                break
            os.close(fd)  # its owner released (and removed) it between our open and our flock: try the new one
        previous = _read_owner(fd)
        record = json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "what": what}).encode()
        os.ftruncate(fd, 0)
        os.pwrite(fd, record, 0)
        return cls(d, fd, previous, created)

    def release(self, restore_previous: bool = False) -> None:
        """Remove the lock file and drop the lock; restore_previous: put the previous owner's record back
        and leave the file (a directory reported, not removed, is found again next time)."""
        if self._fd is None:
            return
        try:
            if restore_previous and self.previous is not None:
                os.ftruncate(self._fd, 0)
                os.pwrite(self._fd, json.dumps(dataclasses.asdict(self.previous)).encode(), 0)
            else:
                (self.directory / LOCK_NAME).unlink(missing_ok=True)  # while held: see the class docstring
        except OSError:
            pass  # a directory removed or made read-only under us: the lock still goes with the fd
        os.close(self._fd)
        if self._created:
            with contextlib.suppress(OSError):
                self.directory.rmdir()  # only if empty: a run refused before writing anything leaves no trace
        self._fd = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def __enter__(self) -> "DirLock":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def owner_of(directory: str | os.PathLike) -> Owner | None:
    """The live owner of `directory`, or None when no live process holds its lock."""
    try:
        lock = DirLock.acquire(directory, "probe") if Path(directory).is_dir() else None
    except DirectoryInUse as busy:
        return busy.owner or Owner(-1, "?", "?")
    if lock is not None:
        lock.release(restore_previous=True)  # a look changes nothing
    return None


def _tree_bytes(path: Path) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_blocks * 512  # what the drive gives back
            except OSError:
                pass
    return total


@dataclasses.dataclass(frozen=True)
class StaleDir:
    path: Path
    nbytes: int
    owner: Owner  # the dead owner's record
    removed: bool  # False: reported only (owned on another host, or without a lock file)


def remove_stale(parent: str | os.PathLike, prefix: str, what: str) -> list[StaleDir]:
    """Subdirectories of `parent` named `prefix`* that a now dead owner locked for `what` (say, a swap
    directory): removed when the owner ran on this host, else reported (a lock on a network drive says
    nothing about another host's processes). Left alone: directories without a lock file (a live run between
    creating one and locking it) and those locked for another purpose (a fine-tune's output is never swap)."""
    found = []
    try:
        entries = sorted(Path(parent).iterdir())
    except OSError:
        return found
    for d in entries:
        if not d.name.startswith(prefix) or d.is_symlink() or not d.is_dir() or not (d / LOCK_NAME).exists():
            continue
        try:
            lock = DirLock.acquire(d, "removing a dead run's directory")
        except DirectoryInUse:
            continue  # its owner is alive
        except OSError:
            continue  # not ours to look into (permissions)
        dead = lock.previous
        if dead is None or dead.what != what:
            lock.release(restore_previous=True)
            continue
        nbytes = _tree_bytes(d)
        here = dead.host == socket.gethostname()
        if here:
            shutil.rmtree(d, ignore_errors=True)  # held while removed: no other cleaner works on it meanwhile
            lock.release()
            log.warning("offload: removed %s, left by a run that died (%s): %s freed", d, dead.describe(),
                        format_bytes(nbytes))
        else:
            lock.release(restore_previous=True)
            log.warning("offload: %s belongs to a run on %s that holds no lock from here (%s); remove it "
                        "if that run is over", d, dead.host, format_bytes(nbytes))
        found.append(StaleDir(d, nbytes, dead, here))
    return found
