"""Files of a checkpoint: safe paths, streamed safetensors with a checksum, atomic renames.

- Directories are created 0700 and files 0600; every file is opened with O_NOFOLLOW, and a checkpoint root
  that is a symlink, is owned by another user, or is writable by others is refused (a pre-planted link or
  directory in a shared /tmp cannot redirect the writes or the reads).
- `TensorFileWriter` writes a safetensors file whose header is known up front (names, dtypes, shapes), so
  the data streams in piece by piece in the header's order with bounded memory, and a sha256 of the whole
  file is computed on the way. Any safetensors reader (safe_open) reads it.
- `fsync_dir` after a rename makes the rename durable; `atomic_write_text` writes a small file (the
  manifest, the `latest` pointer) under a temporary name, fsyncs it, renames it over the old one.
"""
from __future__ import annotations

import hashlib
import json
import os
import stat
from pathlib import Path

import torch

DIR_MODE = 0o700
FILE_MODE = 0o600
_DTYPE = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.uint8: "U8",
          torch.int64: "I64"}


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be written or trusted; the message names the path and what to do."""


def check_owned_dir(path: Path, what: str) -> None:
    """`path` (if it exists) is a real directory owned by this user, not a symlink."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if stat.S_ISLNK(st.st_mode):
        raise CheckpointError(f"{what} {path} is a symbolic link; refusing to follow it (it could point anywhere). "
                              "Give the real directory")
    if not stat.S_ISDIR(st.st_mode):
        raise CheckpointError(f"{what} {path} exists and is not a directory")
    if hasattr(os, "getuid") and st.st_uid != os.getuid():
        raise CheckpointError(f"{what} {path} is owned by uid {st.st_uid}, not this user ({os.getuid()}); "
                              "refusing to write into or read from it. Use a directory of your own")
    if st.st_mode & 0o022:
        raise CheckpointError(f"{what} {path} is writable by other users (mode {stat.S_IMODE(st.st_mode):o}): "
                              f"they could replace its files. `chmod go-w {path}`, or use a directory of your own")


def make_private_dir(path: Path, what: str) -> None:
    """`path`, created 0700 if missing; an existing one must be ours and not writable by others (its mode is
    left as it is)."""
    check_owned_dir(path, what)
    if not path.exists():
        path.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)
        os.chmod(path, DIR_MODE)  # mkdir's mode is masked by the umask
    check_owned_dir(path, what)


def open_private(path: Path, write: bool):
    """A file object for `path`, never through a symlink; created 0600 when writing."""
    flags = os.O_NOFOLLOW | (os.O_WRONLY | os.O_CREAT | os.O_TRUNC if write else os.O_RDONLY)
    try:
        fd = os.open(path, flags, FILE_MODE)
    except OSError as exc:
        if exc.errno == 40:  # ELOOP: the last component is a symlink
            raise CheckpointError(f"{path} is a symbolic link; refusing to follow it") from None
        raise
    return os.fdopen(fd, "wb" if write else "rb")


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open_private(tmp, write=True) as f:
        f.write(text.encode())
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def safe_member(root: Path, name: str, what: str) -> Path:
    """root/name for a name read from a manifest: a plain relative name, never absolute or with `..`."""
    p = Path(name)
    if not name or p.is_absolute() or ".." in p.parts or len(p.parts) != 1:
        raise CheckpointError(f"{what}: the manifest names {name!r}, which is not a plain file name inside "
                              f"{root}; the checkpoint is corrupt or was tampered with")
    return root / p


def sha256_of(path: Path, block: int = 8 << 20) -> str:
    h = hashlib.sha256()
    with open_private(path, write=False) as f:
        while chunk := f.read(block):
            h.update(chunk)
    return h.hexdigest()


class TensorFileWriter:
    """A safetensors file written in header order, piece by piece: add() every tensor's name, dtype and
    numel first, then open(), write() the data in that order, close() -> (bytes, sha256)."""

    def __init__(self, path: Path, metadata: dict[str, str] | None = None):
        self.path = path
        self.metadata = metadata or {}
        self.entries: list[tuple[str, torch.dtype, int]] = []
        self._f = None
        self._hash = hashlib.sha256()
        self._next = 0  # entry being written
        self._written = 0  # bytes of that entry written so far
        self._size = 0

    def add(self, name: str, dtype: torch.dtype, numel: int) -> None:
        assert self._f is None, "add every tensor before open()"
        self.entries.append((name, dtype, numel))

    def open(self) -> None:
        header, offset = {}, 0
        for name, dtype, numel in self.entries:
            end = offset + numel * dtype.itemsize
            header[name] = {"dtype": _DTYPE[dtype], "shape": [numel], "data_offsets": [offset, end]}
            offset = end
        if self.metadata:
            header["__metadata__"] = self.metadata
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # the format aligns the data to 8 bytes
        self._f = open_private(self.path, write=True)
        self._emit(len(raw).to_bytes(8, "little") + raw)

    def _emit(self, data) -> None:
        self._f.write(data)
        self._hash.update(data)
        self._size += memoryview(data).nbytes

    def write(self, values: torch.Tensor) -> None:
        """The next piece of data: part (or all) of the current tensor, in order."""
        name, dtype, numel = self.entries[self._next]
        if values.dtype != dtype:
            raise TypeError(f"{name}: writing {values.dtype}, declared {dtype}")
        data = memoryview(values.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy())
        self._emit(data)
        self._written += data.nbytes
        if self._written > numel * dtype.itemsize:
            raise ValueError(f"{name}: more data than its declared {numel} elements")
        if self._written == numel * dtype.itemsize:
            self._next, self._written = self._next + 1, 0

    def close(self) -> tuple[int, str]:
        if self._next != len(self.entries) or self._written:
            raise ValueError(f"{self.path}: closed with tensor {self._next} of {len(self.entries)} incomplete")
        self._f.flush()
        os.fsync(self._f.fileno())
        self._f.close()
        return self._size, self._hash.hexdigest()

    def abort(self) -> None:
        if self._f is not None and not self._f.closed:
            self._f.close()
