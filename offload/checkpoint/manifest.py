"""The layout of one checkpoint on disk, shared by the runtime's load (offload/zero/checkpoint.py) and
`offload export`: its directory, the manifest, the per-rank tensor files and their verification.

    ROOT/latest                  the name of the newest complete checkpoint (moved last)
    ROOT/<tag>/manifest.json     what the run was, and the size and sha256 of every file
    ROOT/<tag>/rank-RRRRR-of-WWWWW.safetensors   rank R's shard (of world W) of every unit: "<uid>/master",
                                 "<uid>/exp_avg", "<uid>/exp_avg_sq", and "<uid>/grad" in the middle of a
                                 gradient accumulation (fp32, the flat layout's shard), and "rng/..." (its
                                 torch generator states)
    ROOT/<tag>/<aux files>       config.json, tokenizer files (when the run gave them; export copies them),
                                 fsynced and checksummed like the rank files
"""
from __future__ import annotations

import hashlib
import json
import os
import stat
from pathlib import Path

from .files import CheckpointError, check_owned_dir, open_private, safe_member

FORMAT = "offload-checkpoint/1"
MANIFEST = "manifest.json"
LATEST = "latest"


def rank_file(rank: int, world: int) -> str:
    return f"rank-{rank:05d}-of-{world:05d}.safetensors"


def resolve(root) -> Path:
    """The checkpoint directory for `root`: the one `root/latest` names, or `root` itself."""
    root = Path(root)
    check_owned_dir(root, "checkpoint directory")
    if (root / LATEST).is_file():
        with open_private(root / LATEST, write=False) as f:
            tag = f.read().decode().strip()
        path = safe_member(root, tag, f"{root / LATEST}")
        if not (path / MANIFEST).is_file() and (root / f".old-{tag}" / MANIFEST).is_file():
            path = root / f".old-{tag}"  # a re-save of this tag was killed between its two renames
        check_owned_dir(path, "checkpoint")
        if not (path / MANIFEST).is_file():
            raise CheckpointError(f"{root / LATEST} names {tag!r}, which has no {MANIFEST}; the checkpoint "
                                  "directory was changed by hand")
        return path
    if (root / MANIFEST).is_file():
        return root
    raise CheckpointError(f"{root}: neither a checkpoint ({MANIFEST}) nor a directory of checkpoints ({LATEST}); "
                          "give the directory passed to save_checkpoint")


def read_manifest(path: Path) -> dict:
    try:
        with open_private(path / MANIFEST, write=False) as f:
            manifest = json.loads(f.read().decode())
    except ValueError as exc:
        raise CheckpointError(f"{path / MANIFEST}: not valid JSON ({exc}); the checkpoint is corrupt") from None
    if manifest.get("format") != FORMAT:
        raise CheckpointError(f"{path / MANIFEST}: format {manifest.get('format')!r}, expected {FORMAT!r}")
    for name in manifest["files"]:
        safe_member(path, name, str(path / MANIFEST))
    return manifest


class VerifiedFiles:
    """Checkpoint files opened once (O_NOFOLLOW), their size and sha256 checked through that descriptor, and
    handed to readers by the same descriptor (/proc/self/fd/N on Linux), so a file swapped in after the check
    is never the one read. A context manager: the descriptors close on exit."""

    def __init__(self, path: Path, manifest: dict, names):
        self.fds: dict[str, int] = {}
        self.paths = {name: path / name for name in names}
        try:
            for name in names:
                self.fds[name] = _open_verified(path, manifest, name)
        except BaseException:
            self.close()
            raise

    def reader_path(self, name: str) -> str:
        """A path that opens the verified file itself (the path name only where /proc is missing)."""
        return f"/proc/self/fd/{self.fds[name]}" if os.path.isdir("/proc/self/fd") else str(self.paths[name])

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)
        self.fds.clear()

    def __enter__(self) -> "VerifiedFiles":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _open_verified(path: Path, manifest: dict, name: str) -> int:
    want = manifest["files"][name]
    f = safe_member(path, name, str(path / MANIFEST))
    try:
        fd = os.open(f, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        raise CheckpointError(f"{f}: missing; the checkpoint is incomplete (use an earlier one)") from None
    except OSError as exc:
        raise CheckpointError(f"{f}: cannot be opened safely ({exc.strerror}; a symbolic link is refused)") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise CheckpointError(f"{f}: not a regular file")
        if st.st_size != want["bytes"]:
            raise CheckpointError(f"{f}: {st.st_size} bytes, the manifest says {want['bytes']}: truncated or "
                                  "overwritten; use an earlier checkpoint")
        h, offset = hashlib.sha256(), 0
        while chunk := os.pread(fd, 8 << 20, offset):
            h.update(chunk)
            offset += len(chunk)
        if h.hexdigest() != want["sha256"]:
            raise CheckpointError(f"{f}: sha256 differs from the manifest: the file is corrupt (bit rot, a bad "
                                  "disk or an edit); use an earlier checkpoint")
    except BaseException:
        os.close(fd)
        raise
    return fd


def verify_files(path: Path, manifest: dict, names) -> None:
    """Size and sha256 of each of `names` against the manifest (a truncated or bit-flipped file fails)."""
    with VerifiedFiles(path, manifest, names):
        pass


def verified(root) -> tuple[Path, dict]:
    """(the checkpoint directory for `root`, its manifest) with every rank file's size and checksum checked."""
    path = resolve(root)
    manifest = read_manifest(path)
    names = [rank_file(r, manifest["world_size"]) for r in range(manifest["world_size"])]
    missing = [n for n in names if n not in manifest["files"]]
    if missing:
        raise CheckpointError(f"{path / MANIFEST}: lists no {missing}; the checkpoint is incomplete")
    verify_files(path, manifest, list(manifest["files"]))  # rank files and the aux files (config, tokenizer)
    return path, manifest
