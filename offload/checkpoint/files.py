"""Files of a checkpoint: safe paths, streamed safetensors with a checksum, atomic renames.

- Directories are created 0700 and files 0600; every file is opened with O_NOFOLLOW, and a checkpoint root
  that is a symlink, is owned by another user, or is writable by others is refused (a pre-planted link or
  directory in a shared /tmp cannot redirect the writes or the reads).
- `TensorFileWriter` writes a safetensors file whose header is known up front (names, dtypes, shapes), so
  the data streams in piece by piece in the header's order with bounded memory, and a sha256 of the whole
  file is computed on the way. Any safetensors reader (safe_open) reads it. A piece whose bytes also sit
  page-aligned in another file (a swap slot) can be cloned from there (FICLONERANGE: the two files share
  the blocks, nothing is copied) where the filesystem does reflinks (XFS, btrfs); elsewhere it is written.
  Tensors added `aligned` start on a page (the header is padded with spaces, gaps filled by `__pad__/N`
  tensors of zeros, as the format has no holes), so their page-aligned pieces can be cloned.
- `fsync_dir` after a rename makes the rename durable; `atomic_write_text` writes a small file (the
  manifest, the `latest` pointer) under a temporary name, fsyncs it, renames it over the old one.
"""
from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import stat
import struct
from pathlib import Path

import torch

DIR_MODE = 0o700
FILE_MODE = 0o600
PAGE = 4096  # reflinks share whole filesystem blocks
FICLONERANGE = 0x4020940D  # _IOW(0x94, 13, struct file_clone_range: s64 src_fd; u64 src_offset, length, dest)
# a clone refused with these means the filesystem (or the pair of files) cannot share blocks: write instead
_NO_REFLINK = {errno.EOPNOTSUPP, errno.ENOTTY, errno.EXDEV, errno.EINVAL, errno.ETXTBSY, errno.EPERM}
PAD_PREFIX = "__pad__/"
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


def fsync_path(path: Path, directory: bool = False) -> None:
    """A file's (or a directory's: its entries, after a rename) bytes on the disk."""
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if directory else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: Path) -> None:
    fsync_path(path, directory=True)


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
        self._data_bytes = 0  # of the entries added so far
        self._aligned = False  # some tensor asked to start on a page: the data starts on one too
        self.cloned_bytes = 0  # shared with their source by reflink
        self.written_bytes = 0  # tensor bytes written
        self.no_reflink: str | None = None  # why clone() writes instead (the first refusal), once known

    def add(self, name: str, dtype: torch.dtype, numel: int, aligned: bool = False) -> None:
        """The next tensor; `aligned`: its data starts on a page (after a tensor of zeros filling the gap)."""
        assert self._f is None, "add every tensor before open()"
        gap = -self._data_bytes % PAGE if aligned else 0
        if gap:
            self.entries.append((f"{PAD_PREFIX}{len(self.entries)}", torch.uint8, gap))
        self._aligned |= aligned
        self.entries.append((name, dtype, numel))
        self._data_bytes += gap + numel * dtype.itemsize

    def open(self) -> None:
        header, offset = {}, 0
        for name, dtype, numel in self.entries:
            end = offset + numel * dtype.itemsize
            header[name] = {"dtype": _DTYPE[dtype], "shape": [numel], "data_offsets": [offset, end]}
            offset = end
        if self.metadata:
            header["__metadata__"] = self.metadata
        raw = json.dumps(header, separators=(",", ":")).encode()
        # the format pads the header with spaces: to 8 bytes, or so that the data starts on a page
        raw += b" " * (-(8 + len(raw)) % PAGE if self._aligned else -len(raw) % 8)
        self._f = open_private(self.path, write=True)
        self._emit(len(raw).to_bytes(8, "little") + raw)

    def _emit(self, data) -> None:
        self._f.write(data)
        self._hash.update(data)
        self._size += memoryview(data).nbytes

    def write(self, values: torch.Tensor) -> None:
        """The next piece of data: part (or all) of the current tensor, in order."""
        data = self._piece(values)
        self._emit(data)
        self._advance(data.nbytes)

    def clone(self, values: torch.Tensor, src_fd: int, src_offset: int) -> None:
        """The next piece of data, `values`, whose bytes are also in the file `src_fd` at `src_offset` (a page
        boundary; the source readable up to the next page after them): the file shares those blocks with the
        source where the filesystem clones ranges, else the bytes are written. Hashed from `values` either
        way (the caller read them from there)."""
        data = self._piece(values)
        n, at = data.nbytes, self._size
        if self.no_reflink is None and n and at % PAGE == 0 and src_offset % PAGE == 0:
            self._f.flush()  # the clone lands at the file's position: nothing may be buffered before it
            try:
                whole = -(-n // PAGE) * PAGE
                fcntl.ioctl(self._f.fileno(), FICLONERANGE, struct.pack("qQQQ", src_fd, src_offset, whole, at))
            except OSError as exc:
                if exc.errno not in _NO_REFLINK:
                    raise
                self.no_reflink = f"{errno.errorcode.get(exc.errno, exc.errno)}: {os.strerror(exc.errno)}"
            else:  # whole pages were shared: what lies past `n` is overwritten by what follows (or cut at close)
                self._f.seek(at + n)
                self._hash.update(data)
                self._size += n
                self.cloned_bytes += n
                self._advance(n, counted=True)
                return
        self._emit(data)
        self._advance(n)

    def _piece(self, values: torch.Tensor) -> memoryview:
        self._fill_pads()
        name, dtype, _ = self.entries[self._next]
        if values.dtype != dtype:
            raise TypeError(f"{name}: writing {values.dtype}, declared {dtype}")
        return memoryview(values.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy())

    def _advance(self, nbytes: int, counted: bool = False) -> None:
        name, dtype, numel = self.entries[self._next]
        if not counted and not name.startswith(PAD_PREFIX):
            self.written_bytes += nbytes
        self._written += nbytes
        if self._written > numel * dtype.itemsize:
            raise ValueError(f"{name}: more data than its declared {numel} elements")
        if self._written == numel * dtype.itemsize:
            self._next, self._written = self._next + 1, 0

    def _fill_pads(self) -> None:
        while self._next < len(self.entries) and self.entries[self._next][0].startswith(PAD_PREFIX):
            gap = self.entries[self._next][2]
            self._emit(bytes(gap))
            self._advance(gap)

    def close(self) -> tuple[int, str]:
        self._fill_pads()
        if self._next != len(self.entries) or self._written:
            raise ValueError(f"{self.path}: closed with tensor {self._next} of {len(self.entries)} incomplete")
        self._f.flush()
        self._f.truncate(self._size)  # (a last clone shares whole pages: past the data is not the file's)
        os.fsync(self._f.fileno())
        self._f.close()
        return self._size, self._hash.hexdigest()

    def abort(self) -> None:
        if self._f is not None and not self._f.closed:
            self._f.close()
