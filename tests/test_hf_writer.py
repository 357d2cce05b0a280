"""Writing weights as a Hugging Face directory (offload/checkpoint/hf_writer.py): a save over an earlier one, a
save that fails halfway, and what killed writers left."""
import os

import pytest
import torch
from safetensors.torch import load_file

from offload.checkpoint import hf_writer
from offload.checkpoint.hf_writer import INDEX_NAME, SINGLE_NAME, write_hf_weights


def _tensors(value: float):
    return [(f"layer{i}.weight", torch.full((64, 64), value + i)) for i in range(5)]  # 16 KiB each


def _weights(out) -> dict:
    names = sorted(p.name for p in out.iterdir() if p.name.endswith(".safetensors"))
    return {k: v for n in names for k, v in load_file(str(out / n)).items()}


def test_a_save_replaces_an_earlier_one_of_another_layout(tmp_path):
    out = tmp_path / "out"
    write_hf_weights(out, _tensors(1.0), max_shard_bytes=20 << 10)  # 5 files and an index
    assert (out / INDEX_NAME).exists() and len(list(out.glob("model-*.safetensors"))) == 5
    write_hf_weights(out, _tensors(2.0), max_shard_bytes=1 << 30)  # one file
    assert sorted(p.name for p in out.iterdir()) == [SINGLE_NAME]
    assert torch.equal(_weights(out)["layer4.weight"], torch.full((64, 64), 6.0))


def test_a_save_that_fails_halfway_leaves_the_earlier_weights(tmp_path, monkeypatch):
    """The earlier save's weight files were removed before the new ones were renamed in: a failure (or a kill)
    in between left OUT with no weights at all."""
    out = tmp_path / "out"
    write_hf_weights(out, _tensors(1.0), max_shard_bytes=1 << 30)
    real = os.replace
    calls = []

    def failing_replace(src, dst):
        calls.append(dst)
        if len(calls) > 6:  # the 5 parts' renames inside .partial-PID, one new file into OUT, then the fault
            raise OSError(28, "injected: no space left")
        return real(src, dst)

    monkeypatch.setattr(hf_writer.os, "replace", failing_replace)
    with pytest.raises(OSError, match="injected"):
        write_hf_weights(out, _tensors(2.0), max_shard_bytes=20 << 10)
    monkeypatch.undo()
    earlier = load_file(str(out / SINGLE_NAME))  # the earlier save, whole (transformers reads it: no index came)
    assert not (out / INDEX_NAME).exists() and len(earlier) == 5
    assert all(torch.equal(earlier[f"layer{i}.weight"], torch.full((64, 64), 1.0 + i)) for i in range(5))
    assert list(out.glob(".partial-*")) == []  # the failed save's folder went with it (it waited for another save)


def test_a_save_whose_tensors_fail_leaves_no_partial_folder(tmp_path):
    """A tensor that cannot be read (an I/O error, a collective that failed) stopped the save; its folder, as
    large as what was written so far, stayed in OUT until another process saved there."""
    def failing():
        yield from list(_tensors(1.0))[:3]
        raise OSError(5, "injected: reading a tensor failed")

    out = tmp_path / "out"
    with pytest.raises(OSError, match="injected"):
        write_hf_weights(out, failing(), max_shard_bytes=20 << 10)
    assert list(out.iterdir()) == []


def test_a_killed_writers_partial_folder_is_removed(tmp_path):
    out = tmp_path / "out"
    dead = out / ".partial-999999999"  # no such process
    dead.mkdir(parents=True)
    (dead / "part-0.safetensors").write_bytes(b"x" * 1000)
    alive = out / f".partial-{os.getppid()}"
    alive.mkdir()
    write_hf_weights(out, _tensors(1.0), max_shard_bytes=1 << 30)
    assert not dead.exists() and alive.exists()
