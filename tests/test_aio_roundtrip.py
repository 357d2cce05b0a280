"""Data integrity of the aio engine on every usable backend: what is written is on disk at the right
offset (checked with plain os.pread), and what is read back equals what was written."""
from __future__ import annotations

import gc
import random
import weakref

import pytest
import torch

from _aio_support import BACKENDS, file_bytes, random_bytes
from offload.store.aio import AioEngine, aligned_empty

MiB = 1 << 20


@pytest.fixture(params=BACKENDS)
def engine(request):
    with AioEngine(block_size="256KiB", queue_depth=8, workers=2, backend=request.param) as eng:
        assert eng.backend == request.param
        yield eng


@pytest.mark.parametrize("nbytes", [4096, 8192, MiB, 3 * MiB + 5 * 4096, 9 * MiB])
def test_direct_roundtrip_sizes(engine, tmp_path, nbytes):
    path = str(tmp_path / "swap.bin")
    src = random_bytes(nbytes, seed=nbytes)
    offset = 3 * 4096
    with engine.open(path, "w+") as f:
        assert f.direct and f.alignment % 4096 == 0
        engine.write(f, offset, src).wait()
        assert f.size == offset + nbytes
        assert file_bytes(path, offset, nbytes) == src.numpy().tobytes()
        out = aligned_empty(nbytes)
        out.fill_(0xAA)
        h = engine.read(f, offset, out)
        h.wait()
        assert h.done() and h.exception() is None
        assert torch.equal(out, src)


@pytest.mark.slow
def test_direct_roundtrip_256mib(tmp_path):
    nbytes = 256 * MiB
    src = random_bytes(nbytes, seed=7)
    with AioEngine(block_size="4MiB", queue_depth=16, backend="auto") as eng:
        with eng.open(tmp_path / "big.bin", "w+") as f:
            eng.fallocate(f, nbytes)
            eng.write(f, 0, src).wait()
            out = aligned_empty(nbytes)
            eng.read(f, 0, out).wait()
    assert torch.equal(out, src)


def test_buffered_odd_sizes_and_offsets(engine, tmp_path):
    """Random writes and reads of odd sizes at odd offsets against an in-memory model of the file."""
    path = str(tmp_path / "odd.bin")
    rng = random.Random(1234)
    size = 3 * MiB + 17
    model = bytearray(size)
    with engine.open(path, "w+", direct=False) as f:
        assert not f.direct
        engine.write(f, 0, torch.zeros(size, dtype=torch.uint8)).wait()
        for i in range(60):
            n = rng.choice([1, 2, 3, 4095, 4097, 65537, 300_001, 1_048_583])
            off = rng.randrange(0, size - n)
            if rng.random() < 0.5:
                data = random_bytes(n, seed=i, aligned=False)[rng.randrange(0, 1):]  # any address
                engine.write(f, off, data).wait()
                model[off:off + n] = data.numpy().tobytes()
            else:
                out = torch.empty(n + 1, dtype=torch.uint8)[1:]  # deliberately unaligned address
                engine.read(f, off, out).wait()
                assert out.numpy().tobytes() == bytes(model[off:off + n]), (off, n)
    assert file_bytes(path, 0, size) == bytes(model)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_dtypes_roundtrip_bit_exact(engine, tmp_path, dtype):
    numel = 3 * MiB // 4 + 2048  # bytes a multiple of 4096 for both dtypes
    g = torch.Generator().manual_seed(3)
    src = aligned_empty(numel, dtype)
    src.copy_(torch.randn(numel, generator=g).to(dtype))
    src[:4] = torch.tensor([float("inf"), float("-inf"), float("nan"), -0.0], dtype=dtype)
    with engine.open(tmp_path / "t.bin", "w+") as f:
        engine.write(f, 4096, src).wait()
        out = aligned_empty(numel, dtype)
        engine.read(f, 4096, out).wait()
        # bytes, not values: NaN payloads and -0.0 must survive
        assert torch.equal(out.view(torch.uint8), src.view(torch.uint8))
        raw = aligned_empty(src.numel() * src.element_size())
        engine.read(f, 4096, raw).wait()
        assert torch.equal(raw, src.view(torch.uint8))


def test_hundreds_in_flight_reads_and_writes_interleaved(engine, tmp_path):
    """400 handles outstanding at once: reads of region A interleaved with writes to region B."""
    chunk, count = 64 * 1024, 200
    region = chunk * count
    a = random_bytes(region, seed=11)
    b = random_bytes(region, seed=12)
    with engine.open(tmp_path / "many.bin", "w+") as f:
        engine.write(f, 0, a).wait()
        outs = [aligned_empty(chunk) for _ in range(count)]
        handles = []
        order = list(range(count))
        random.Random(5).shuffle(order)
        for i in order:
            handles.append(engine.read(f, i * chunk, outs[i]))
            handles.append(engine.write(f, region + i * chunk, b[i * chunk:(i + 1) * chunk]))
        for h in handles:
            h.wait()
        for i in range(count):
            assert torch.equal(outs[i], a[i * chunk:(i + 1) * chunk]), i
        back = aligned_empty(region)
        engine.read(f, region, back).wait()
        assert torch.equal(back, b)


def test_batch_forms(engine, tmp_path):
    parts = [random_bytes(n, seed=n) for n in (4096, 65536, 3 * 4096, MiB)]
    offsets, pos = [], 0
    for p in parts:
        offsets.append(pos)
        pos += p.numel() + 4096  # gaps between the parts
    with engine.open(tmp_path / "batch.bin", "w+") as f:
        h = engine.write_many([(f, o, p) for o, p in zip(offsets, parts)])
        assert h.nbytes == sum(p.numel() for p in parts)
        h.wait()
        outs = [aligned_empty(p.numel()) for p in parts]
        engine.read_many([(f, o, t) for o, t in zip(offsets, outs)]).wait()
    for p, t in zip(parts, outs):
        assert torch.equal(p, t)


def test_zero_length_request_completes(engine, tmp_path):
    with engine.open(tmp_path / "z.bin", "w+") as f:
        h = engine.write(f, 0, torch.empty(0, dtype=torch.uint8))
        assert h.done()
        h.wait()
        assert f.size == 0


def test_dropped_handle_keeps_tensor_alive_until_done(tmp_path):
    """A handle dropped mid-flight must not let its buffer be freed under the I/O."""
    nbytes = 32 * MiB
    with AioEngine(block_size="4KiB", queue_depth=1, backend="threads" if "threads" in BACKENDS else "python") as eng:
        f = eng.open(tmp_path / "drop.bin", "w+")
        eng.write(f, 0, random_bytes(nbytes, seed=1)).wait()
        out = aligned_empty(nbytes)
        h = eng.read(f, 0, out)
        batch = h._batch
        ref = weakref.ref(out)
        del h, out
        gc.collect()
        if batch.done():
            pytest.skip("the 8192-piece read finished before the handle was dropped (machine too fast)")
        assert ref() is not None, "the buffer was freed while the read was still running"
        batch.wait()
    gc.collect()
    assert ref() is None, "the engine kept the buffer after close"
