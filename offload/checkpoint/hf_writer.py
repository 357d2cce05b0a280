"""Writing weights as a Hugging Face directory: safetensors files of at most `max_shard_bytes` each
(model.safetensors, or model-0000k-of-0000n.safetensors with model.safetensors.index.json, as transformers
names them), filled from an iterator so one file's tensors are in memory at a time. Everything is written
under OUT/.partial-PID, synced, and renamed into OUT at the end (the index last, an earlier save's other weight
files removed after), so a reader never sees a half-written file and a kill never leaves OUT without weights.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Callable, Iterable

import torch

from .files import fsync_dir, fsync_path

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"


def _plain_file_mode(folder: Path) -> int:
    """The mode open(path, "w") gives a new file in `folder` (0666 less the umask, or what a default ACL
    says), read from a probe file: reading the umask means setting it, which races other threads."""
    probe = folder / ".mode-probe"
    fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        return os.fstat(fd).st_mode & 0o7777
    finally:
        os.close(fd)
        probe.unlink()


def write_hf_weights(out_dir: str | os.PathLike, tensors: Iterable[tuple[str, torch.Tensor]], max_shard_bytes: int,
                     add_files: Callable[[Path], None] | None = None) -> Path:
    """Write `tensors` (name, host tensor) into `out_dir`; `add_files(tmp_dir)` writes config.json, tokenizer
    files and the like beside them before the rename. Returns out_dir."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    _remove_dead_partials(out)
    tmp = out / f".partial-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        mode = _plain_file_mode(tmp)
        parts: list[list[str]] = []
        pending: dict[str, torch.Tensor] = {}
        pending_bytes = total = 0

        def flush():
            nonlocal pending, pending_bytes
            if pending:
                part = tmp / f"part-{len(parts)}.safetensors"
                save_file(pending, str(part), metadata={"format": "pt"})
                os.chmod(part, mode)  # safetensors creates its file 0600; the weights are as shareable as config.json
                parts.append(list(pending))
            pending, pending_bytes = {}, 0

        for name, t in tensors:
            t = t.detach().contiguous()
            if pending and pending_bytes + t.nbytes > max_shard_bytes:
                flush()
            pending[name] = t
            pending_bytes += t.nbytes
            total += t.nbytes
        flush()
        n = len(parts)
        finals = [SINGLE_NAME] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
        for i, final in enumerate(finals):
            os.replace(tmp / f"part-{i}.safetensors", tmp / final)
        if n > 1:
            weight_map = {name: final for names, final in zip(parts, finals) for name in names}
            (tmp / INDEX_NAME).write_text(json.dumps({"metadata": {"total_size": total},
                                                      "weight_map": dict(sorted(weight_map.items()))}, indent=2))
        if add_files is not None:
            add_files(tmp)
        written = sorted(tmp.iterdir())
        for f in written:  # on the disk before any name in OUT points at them (a power cut: never an empty file)
            fsync_path(f)
        # the new files take their names first, the index last; only then do an earlier save's other weight files go
        # (removed first, a kill in between left OUT with no weights at all)
        for f in sorted(written, key=lambda f: f.name == INDEX_NAME):
            os.replace(f, out / f.name)
        names = {f.name for f in written}
        for stale in list(out.glob("model*.safetensors")) + [out / INDEX_NAME]:
            if stale.name not in names and stale.exists():
                stale.unlink()
        fsync_dir(out)
    except BaseException:  # (a failed read of the tensors, a full disk, a kill signal): no model-sized leftover
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    tmp.rmdir()
    return out


def _remove_dead_partials(out: Path) -> None:
    """.partial-PID folders of writers that died (a killed save): as large as the model, never used again."""
    for partial in out.glob(".partial-*"):
        try:
            pid = int(partial.name[len(".partial-"):])
            os.kill(pid, 0)  # alive (or another user's process): left alone
        except ProcessLookupError:
            shutil.rmtree(partial, ignore_errors=True)
        except (ValueError, PermissionError):
            continue
