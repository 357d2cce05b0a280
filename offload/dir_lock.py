"""Which live process owns a directory: an exclusive flock on DIR/.offload-lock, held for the owner's life.

    with DirLock.acquire(out, "offload finetune --output"):   # DirectoryInUse if a live run holds it
        ...
    run = make_locked_dir(parent, "offload-123-rank0-", "offload swap")   # a new directory, locked before it shows
    owner_of(out)           # the live owner, or None
    remove_stale(parent, "offload-", "offload swap")   # those a dead owner locked as swap: removed, said so

The kernel drops a flock when its process dies, however it dies (kill -9 included), so "is the owner alive"
is answered by trying the lock, never by a pid (pids are reused). A lock says something only within one
kernel: the record names the owner's boot (/proc/sys/kernel/random/boot_id) beside its pid and host, and a
dead-looking directory locked under another boot (another node on a shared drive, whose flocks this kernel
may not see) is reported, not removed. Filesystems without flock (NFS without lockd, some FUSE and Lustre
mounts) raise LockUnavailable: the caller goes on without the lock, and says so.
Used for the fine-tune's output and checkpoint directories (a second run refused with the first one's pid)
and for every swap directory the runtime creates (a dead run's swap is found and removed at the next start).
"""
from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import json
import logging
import os
import shutil
import socket
import stat
import tempfile
from pathlib import Path

from .store.sizes import format_bytes

LOCK_NAME = ".offload-lock"
_NEW = ".offload-new-"  # a directory being made: not matched by any scan until it is locked and renamed
_NO_FLOCK = (errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL)

log = logging.getLogger("offload")


def boot_id() -> str:
    """This kernel's boot: flocks are only seen by processes of one kernel."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return socket.gethostname()  # no /proc: the host name is the best stand-in


@dataclasses.dataclass(frozen=True)
class Owner:
    pid: int
    host: str
    what: str  # the purpose the owner gave, e.g. "offload finetune --output"
    boot: str = ""  # boot_id() of the owner's kernel

    def describe(self) -> str:
        return f"pid {self.pid} on {self.host} ({self.what})"


class DirectoryInUse(RuntimeError):
    def __init__(self, directory: Path, owner: Owner | None):
        who = owner.describe() if owner else "a process that has not written its pid yet"
        super().__init__(f"{directory} is in use by a live run: {who}")
        self.directory, self.owner = directory, owner


class LockUnavailable(OSError):
    """The filesystem has no flock: nobody's ownership can be known there."""


def _read_owner(fd: int) -> Owner | None:
    try:
        data = json.loads(os.pread(fd, 4096, 0) or b"null")
        return Owner(int(data["pid"]), str(data["host"]), str(data["what"]), str(data.get("boot", "")))
    except (OSError, ValueError, TypeError, KeyError):
        return None  # the owner is between taking the lock and writing its record


def _same_file(fd: int, path: Path) -> bool:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    mine = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino)


# See [Note: swap directories are locked] in docs/zero-runtime.md
class DirLock:
    """An exclusive flock on `directory`/.offload-lock for this process. acquire() makes the directory (and
    the lock file) if missing; release() removes the file while still holding the lock, and the directories
    acquire() made if they are left empty. acquire() re-checks after locking that the path still names the
    file it locked, so an acquirer never holds a lock on a removed file."""

    def __init__(self, directory: Path, fd: int, previous: Owner | None, created: list[Path]):
        self.directory, self._fd = directory, fd
        self.previous = previous  # the record a dead owner left in the file (None: none, or a fresh file)
        self._created = created  # directories acquire() made, deepest first: removed again if left empty

    @classmethod
    def acquire(cls, directory: str | os.PathLike, what: str, create: bool = True) -> "DirLock":
        """create=False: only an existing lock file is taken (FileNotFoundError otherwise): a look into a
        directory never makes a lock file that a run making it could find taken."""
        d = Path(directory)
        created = []
        if create:
            missing = d
            while not missing.exists():
                created.append(missing)
                missing = missing.parent
            d.mkdir(parents=True, exist_ok=True)
        path = d / LOCK_NAME
        while True:
            # O_NOFOLLOW: a lock "file" planted as a symlink (in a directory another user made, say under /tmp)
            # would have us truncate and write whatever file it points at
            fd = os.open(path, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW | (os.O_CREAT if create else 0), 0o644)
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
                os.close(fd)
                _remove_empty(created)
                raise PermissionError(errno.EPERM, f"{path}: the lock file is not a regular file of this user (uid "
                                      f"{st.st_uid}); remove it, or use a directory of your own", str(path))
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                owner = _read_owner(fd)
                os.close(fd)
                raise DirectoryInUse(d.absolute(), owner) from None
            except OSError as exc:
                os.close(fd)
                _remove_empty(created)
                if exc.errno in _NO_FLOCK:
                    raise LockUnavailable(exc.errno, f"{d}: this filesystem has no flock ({exc.strerror})") from None
                raise
            except BaseException:
                os.close(fd)
                raise
            if _same_file(fd, path):
                break
            os.close(fd)  # its owner released (and removed) it between our open and our flock: try the new one
            if not create:
                raise FileNotFoundError(errno.ENOENT, "lock file removed meanwhile", str(path))
        previous = _read_owner(fd)
        record = json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "what": what, "boot": boot_id()})
        os.ftruncate(fd, 0)
        os.pwrite(fd, record.encode(), 0)
        return cls(d, fd, previous, created)

    def release(self, keep_file: bool = False) -> None:
        """Drop the lock. keep_file: leave the lock file, with the previous owner's record put back (a look
        that changes nothing); otherwise remove it, and the directories acquire() made if now empty."""
        if self._fd is None:
            return
        try:
            if keep_file:
                os.ftruncate(self._fd, 0)
                if self.previous is not None:
                    os.pwrite(self._fd, json.dumps(dataclasses.asdict(self.previous)).encode(), 0)
            else:
                (self.directory / LOCK_NAME).unlink(missing_ok=True)  # while held: see the class docstring
        except OSError:
            pass  # a directory removed or made read-only under us: the lock still goes with the fd
        os.close(self._fd)
        self._fd = None
        if not keep_file:
            _remove_empty(self._created)  # a run refused before writing anything leaves no trace

    @property
    def held(self) -> bool:
        return self._fd is not None

    def __enter__(self) -> "DirLock":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def _remove_empty(directories: list[Path]) -> None:
    for d in directories:  # deepest first
        with contextlib.suppress(OSError):
            d.rmdir()  # only if empty


def make_locked_dir(parent: str | os.PathLike, prefix: str, what: str) -> tuple[Path, DirLock | None]:
    """A new directory parent/prefix<random> (mode 0700, never a planted one), locked for `what` before it
    shows under its name: made under a hidden name, locked, then renamed (the lock follows the inode), so no
    scan ever sees it unlocked. The lock is None where the filesystem has no flock (a warning says so)."""
    hidden = Path(tempfile.mkdtemp(prefix=_NEW, dir=parent))
    try:
        lock = DirLock.acquire(hidden, what)
    except LockUnavailable as exc:
        log.warning("offload: %s; a directory left by a run that dies cannot be found and removed later", exc)
        lock = None
    except BaseException:
        shutil.rmtree(hidden, ignore_errors=True)
        raise
    final = Path(parent) / (prefix + hidden.name[len(_NEW):])
    os.rename(hidden, final)
    if lock is not None:
        lock.directory = final
    return final, lock


def owner_of(directory: str | os.PathLike) -> Owner | None:
    """The live owner of `directory`, or None when no live process holds its lock (or it has none)."""
    try:
        lock = DirLock.acquire(directory, "probe", create=False)
    except DirectoryInUse as busy:
        return busy.owner or Owner(-1, "?", "?")
    except OSError:
        return None
    lock.release(keep_file=True)  # a look changes nothing
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
    removed: bool  # False: reported only (locked under another boot: another node's, perhaps alive)


def remove_stale(parent: str | os.PathLike, prefix: str, what: str) -> list[StaleDir]:
    """Subdirectories of `parent` named `prefix`* that a now dead owner locked for `what` (say, a swap
    directory): removed when the owner ran under this kernel, else reported. Left alone: directories this
    process cannot look into (another user's), those without a lock file or record, those locked for another
    purpose (a fine-tune's output is never swap), and live ones."""
    found = []
    try:
        entries = sorted(Path(parent).iterdir())
    except OSError:
        return found
    for d in entries:
        if not d.name.startswith(prefix):
            continue
        try:
            if d.is_symlink() or not d.is_dir():
                continue
            lock = DirLock.acquire(d, "removing a dead run's directory", create=False)
        except (DirectoryInUse, OSError):
            continue  # alive, not ours to look into (permissions), no lock file, or no flock there
        dead = lock.previous
        if dead is None or dead.what != what:
            lock.release(keep_file=True)
            continue
        nbytes = _tree_bytes(d)
        here = dead.boot == boot_id()
        if here:
            shutil.rmtree(d, ignore_errors=True)  # held while removed: no other cleaner works on it meanwhile
            lock.release()
            log.warning("offload: removed %s, left by a run that died (%s): %s freed", d, dead.describe(),
                        format_bytes(nbytes))
        else:
            lock.release(keep_file=True)
            log.warning("offload: %s belongs to a run of another machine or boot (%s) that holds no lock seen from "
                        "here (%s); remove it if that run is over", d, dead.describe(), format_bytes(nbytes))
        found.append(StaleDir(d, nbytes, dead, here))
    return found
