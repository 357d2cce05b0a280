"""Copy / cast / flatten kernels (csrc/copy) against torch: every ISA path, thread counts, edge values."""
import pytest
import torch

from offload import _ext
from _fallback import run_without_extension
from offload.ops import copy as oc

_C = _ext.get()
needs_ext = pytest.mark.skipif(_C is None, reason=f"C++ extension unavailable: {_ext.error()}")

SIZES = [0, 1, 7, 4097, 1_000_003]


def _isas():
    if _C is None:
        return []
    order = ["scalar", "avx2", "avx512"]
    return order[: order.index(_C.best_isa()) + 1]


@pytest.fixture(params=["store", "stream"])
def isa_and_threads(request):
    # "stream": every output takes the non-temporal-store path (normally only outputs >= 32 MiB)
    if request.param == "stream":
        _C.set_copy_stream_threshold(0)
    yield
    _C.set_isa("auto")
    _C.set_num_threads(0)
    _C.set_copy_stream_threshold(-1)


SPECIAL_F32 = [
    0x00000000, 0x80000000, 0x7F800000, 0xFF800000,  # +-0, +-inf
    0x7FC00000, 0xFFC00000, 0x7F800001, 0xFFBFFFFF, 0x7FA12345,  # quiet / signaling NaNs with payloads
    0x00000001, 0x80000001, 0x007FFFFF, 0x00008000, 0x00018000,  # fp32 denormals, bf16 ties
    0x7F7FFFFF, 0x3F808000, 0x3F818000, 0x3F807FFF,  # max finite (-> inf in bf16), ties to even
    0x33000000, 0x33000001, 0x387FC000, 0x387FFFFF, 0x38800000,  # fp16 subnormal boundaries
    0x477FEFFF, 0x477FF000, 0xC77FF000, 0x3C000000,  # fp16 overflow boundary
]


def f32_input(n: int, seed: int = 0) -> torch.Tensor:
    """Random bit patterns (every class: normals, denormals, NaNs, infs) with the special values
    sprinkled in, plus a band of ordinary magnitudes."""
    g = torch.Generator().manual_seed(seed)
    bits = torch.randint(-(2**31), 2**31, (n,), generator=g, dtype=torch.int64).to(torch.int32)
    x = bits.view(torch.float32)
    if n:
        x[: n // 2] = torch.randn(n // 2, generator=g) * 1e3
        sp = torch.tensor([b - 2**32 if b >= 2**31 else b for b in SPECIAL_F32], dtype=torch.int32).view(torch.float32)
        idx = torch.randint(0, n, (min(n, 64),), generator=g)
        x[idx] = sp[torch.arange(idx.numel()) % sp.numel()]
        x[-1] = sp[n % sp.numel()]  # something special in the tail too
    return x


def u16_input(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-(2**15), 2**15, (n,), generator=g, dtype=torch.int32).to(torch.int16)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32 if t.element_size() == 4 else torch.int16)


def assert_bitwise(ours: torch.Tensor, want: torch.Tensor):
    assert ours.dtype == want.dtype and ours.shape == want.shape
    diff = (bits(ours) != bits(want)).nonzero().flatten()
    assert diff.numel() == 0, (
        f"{diff.numel()} of {ours.numel()} differ, first at {diff[0].item()}: "
        f"ours {hex(bits(ours)[diff[0]].item() & 0xFFFFFFFF)} torch {hex(bits(want)[diff[0]].item() & 0xFFFFFFFF)}"
    )


def fp16_to_f32_want(src: torch.Tensor) -> torch.Tensor:
    """torch's .to(float32) for fp16, except NaNs in torch's scalar tail (last n % 8), which torch turns
    into 0x7FFFFFFF: there the expected value is the NaN with sign and payload kept, quiet bit set
    (what torch's own vector body gives for the same input)."""
    want = src.to(torch.float32)
    h = src.view(torch.int16).to(torch.int32) & 0xFFFF
    nan = ((h & 0x7C00) == 0x7C00) & ((h & 0x3FF) != 0)
    keep = ((h & 0x8000) << 16) | 0x7FC00000 | ((h & 0x3FF) << 13)
    want_bits = torch.where(nan, keep, want.view(torch.int32))
    return want_bits.view(torch.float32)


@needs_ext
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("to", [torch.bfloat16, torch.float16])
def test_cast_from_f32_every_isa_bitwise(n, to, isa_and_threads):
    x = f32_input(n, seed=n)
    want = x.to(to)
    for isa in _isas():
        _C.set_isa(isa)
        out = torch.full((n,), 7, dtype=to)
        oc.copy_(out, x)
        assert_bitwise(out, want)


@needs_ext
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("frm", [torch.bfloat16, torch.float16])
def test_cast_to_f32_every_isa_bitwise(n, frm, isa_and_threads):
    x = u16_input(n, seed=n + 1).view(frm)
    want = x.to(torch.float32) if frm == torch.bfloat16 else fp16_to_f32_want(x)
    for isa in _isas():
        _C.set_isa(isa)
        out = torch.full((n,), 7.0)
        oc.copy_(out, x)
        assert_bitwise(out, want)


@needs_ext
def test_misaligned_outputs_every_path(isa_and_threads):
    # outputs starting 1..3 elements past an aligned address: the streaming head/tail code
    n = 5003
    x = f32_input(n + 3, 11)
    for isa in _isas():
        _C.set_isa(isa)
        for k in range(4):
            for to in (torch.bfloat16, torch.float16, torch.float32):
                out = oc.aligned_empty(n + 3, to)[k : k + n]
                oc.copy_(out, x[k : k + n])
                assert_bitwise(out, x[k : k + n].to(to))
            back = oc.aligned_empty(n + 3, torch.float32)[k : k + n]
            h = x[:n].to(torch.bfloat16)
            assert_bitwise(oc.copy_(back, h), h.to(torch.float32))


@needs_ext
def test_stream_threshold_default():
    assert _C.copy_stream_threshold() == 32 << 20


@needs_ext
def test_fp16_nan_matches_torch_vector_body():
    # Where torch takes its vector path (whole groups of 8) our fp16 -> fp32 equals it bit for bit, NaNs included.
    x = torch.tensor([0x7C01, 0xFC01 - 2**16, 0x7E00, 0x7D55, 0x7FFF, 0x0001, 0x8001 - 2**16, 0x7C00] * 4,
                     dtype=torch.int16).view(torch.float16)
    assert_bitwise(oc.copy_(torch.empty(32), x), x.to(torch.float32))


@needs_ext
@pytest.mark.parametrize("pair", [(torch.float32, torch.bfloat16), (torch.float16, torch.float32),
                                  (torch.float32, torch.float32), (torch.int64, torch.int64)])
def test_threads_identical(pair, isa_and_threads):
    frm, to = pair
    n = 1_000_003
    src = f32_input(n, 3).to(frm) if frm.is_floating_point else torch.arange(n, dtype=frm)
    if frm == torch.float16:
        src = u16_input(n, 4).view(torch.float16)
    outs = []
    for t in range(1, 5):
        _C.set_num_threads(t)
        outs.append(oc.copy_(torch.empty(n, dtype=to), src))
    for o in outs[1:]:
        assert_bitwise(o, outs[0]) if o.element_size() in (2, 4) else torch.testing.assert_close(o, outs[0], rtol=0, atol=0)
    if frm == to:
        assert torch.equal(outs[0].view(torch.uint8), src.view(torch.uint8))


def test_copy_same_dtype_and_shapes():
    src = torch.randn(3, 5, 7)
    dst = torch.empty(105)
    oc.copy_(dst, src)
    assert torch.equal(dst, src.flatten())
    # non-contiguous source is fine (made contiguous), non-contiguous dst is not
    oc.copy_(dst, src.transpose(0, 2))
    assert torch.equal(dst, src.transpose(0, 2).flatten())


def test_copy_errors_name_the_argument():
    with pytest.raises(ValueError, match=r"dst has 4 elements but src has 5"):
        oc.copy_(torch.empty(4), torch.empty(5))
    with pytest.raises(ValueError, match=r"cannot cast src \(torch.float64\) to dst \(torch.bfloat16\)"):
        oc.copy_(torch.empty(4, dtype=torch.bfloat16), torch.empty(4, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"dst must be contiguous"):
        oc.copy_(torch.empty(4, 4).t(), torch.empty(16))


@needs_ext
def test_extension_errors_are_value_errors():
    with pytest.raises(ValueError, match=r"dsts\[0\] has 3 elements but srcs\[0\] has 4"):
        _C.copy_many([torch.empty(3)], [torch.empty(4)])
    with pytest.raises(ValueError, match=r"cannot cast srcs\[0\]"):
        _C.copy_many([torch.empty(3, dtype=torch.float16)], [torch.empty(3, dtype=torch.bfloat16)])


def _tensors(seed=0):
    g = torch.Generator().manual_seed(seed)
    shapes = [(1,), (7,), (4097,), (0,), (33, 65), (1024,), (3, 3, 3), (100_003,)]
    return [torch.randn(*s, generator=g) for s in shapes]


def test_flat_layout_offsets_are_aligned_and_tight():
    ts = _tensors()
    for dtype, item in [(torch.float32, 4), (torch.bfloat16, 2)]:
        offsets, total = oc.flat_layout(ts, dtype=dtype)
        assert offsets[0] == 0
        for i, (off, t) in enumerate(zip(offsets, ts)):
            assert (off * item) % 4096 == 0
            if i:
                prev_end = offsets[i - 1] + ts[i - 1].numel()
                assert off >= prev_end and (off - prev_end) * item < 4096  # no more padding than needed
        assert total == offsets[-1] + ts[-1].numel()
    assert oc.flat_layout([5, 0, 3], align=64, dtype=torch.float32) == ([0, 16, 16], 19)
    with pytest.raises(ValueError, match="align must be a positive power of two"):
        oc.flat_layout(ts, align=3000)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("impl", ["kernel", "reference"])
def test_flatten_unflatten_round_trip(dtype, impl):
    flatten = oc.flatten if impl == "kernel" else oc.flatten_reference
    unflatten = oc.unflatten if impl == "kernel" else oc.unflatten_reference
    ts = _tensors(1)
    flat, offsets = flatten(ts, dtype=dtype)
    assert flat.dtype == dtype and flat.data_ptr() % 4096 == 0
    # padding is zero, contents are each tensor cast like .to()
    mask = torch.ones(flat.numel(), dtype=torch.bool)
    for off, t in zip(offsets, ts):
        assert_bitwise(flat[off : off + t.numel()], t.flatten().to(dtype))
        mask[off : off + t.numel()] = False
    assert torch.count_nonzero(flat[mask].float()) == 0
    outs = [torch.empty_like(t, dtype=dtype) for t in ts]
    unflatten(flat, offsets, outs)
    for o, t in zip(outs, ts):
        assert_bitwise(o, t.to(dtype))
    # unflatten back into fp32 tensors (cast on the way out)
    back = unflatten(flat, offsets, [torch.empty_like(t) for t in ts])
    for b, t in zip(back, ts):
        assert_bitwise(b, t.to(dtype).to(torch.float32))


def test_flatten_kernel_equals_reference_and_out():
    ts = _tensors(2)
    a, oa = oc.flatten(ts, dtype=torch.bfloat16)
    out = oc.aligned_empty(a.numel() + 100, torch.bfloat16)
    b, ob = oc.flatten_reference(ts, out=out)
    assert oa == ob and b.data_ptr() == out.data_ptr()
    assert_bitwise(a, b)


def test_flatten_errors_name_the_argument():
    ts = _tensors()
    _, total = oc.flat_layout(ts)
    good = oc.aligned_empty(total + 8, torch.float32)
    with pytest.raises(ValueError, match=r"out is not 4096-byte aligned"):
        oc.flatten(ts, out=good[1:])
    with pytest.raises(ValueError, match=rf"out has {total - 1} elements but the layout needs {total}"):
        oc.flatten(ts, out=good[: total - 1])
    with pytest.raises(ValueError, match=r"out has dtype torch.float32 but dtype=torch.bfloat16"):
        oc.flatten(ts, out=good, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"flatten: cannot cast tensors\[1\] \(torch.int32\)"):
        oc.flatten([torch.ones(3), torch.ones(3, dtype=torch.int32)])
    flat, offsets = oc.flatten(ts)
    with pytest.raises(ValueError, match=r"offsets has 8 entries but outs has 7"):
        oc.unflatten(flat, offsets, [torch.empty_like(t) for t in ts[:-1]])
    outs = [torch.empty_like(t) for t in ts]
    outs[-1] = torch.empty(ts[-1].numel() + 1)
    with pytest.raises(ValueError, match=r"offsets\[7\] = \d+ with outs\[7\].numel\(\) = 100004 overlaps the previous slice or runs past"):
        oc.unflatten(flat, offsets, outs)


def test_fallback_without_extension_matches(tmp_path):
    # The plain-torch path (no compiler) must give the same bytes; run it in a child with the extension disabled.
    code = (
        "import torch, warnings; from offload.ops import copy as oc\n"
        "x = torch.randn(5000); y = torch.empty(5000, dtype=torch.bfloat16)\n"
        "with warnings.catch_warnings(record=True) as w:\n"
        "    warnings.simplefilter('always'); oc.copy_(y, x)\n"
        "assert any('plain-torch fallback' in str(m.message) for m in w), [str(m.message) for m in w]\n"
        "assert torch.equal(y.view(torch.int16), x.to(torch.bfloat16).view(torch.int16))\n"
        "f, o = oc.flatten([x, x[:7]]); assert o == [0, 5120] and torch.equal(f[5120:], x[:7])\n"
        "print('ok')\n"
    )
    run_without_extension(code)


@pytest.mark.parametrize("impl", ["kernel", "reference"])
def test_overlapping_copies_are_refused(impl):
    copy = oc.copy_ if impl == "kernel" else oc.copy_reference
    y = torch.arange(4096, dtype=torch.float32)
    before = y.clone()
    for dst, src in [(y[1:], y[:-1]), (y[:-1], y[1:]), (y, y), (y[:2048].view(torch.bfloat16)[:1024], y[:1024])]:
        with pytest.raises(ValueError, match=r"dst and src overlap in memory"):
            copy(dst, src)
    assert torch.equal(y, before)  # refused before anything was written
    copy(y[2048:], y[:2048])  # disjoint halves of one buffer are fine
    assert torch.equal(y[2048:], before[:2048])
    z = torch.arange(8.0)
    copy(z[:4], z[::2])  # a strided source is copied first on both paths: no aliasing left
    assert torch.equal(z[:4], torch.tensor([0.0, 2.0, 4.0, 6.0]))


@pytest.mark.parametrize("impl", ["kernel", "reference"])
def test_flatten_unflatten_refuse_aliasing_the_flat_buffer(impl):
    flatten = oc.flatten if impl == "kernel" else oc.flatten_reference
    unflatten = oc.unflatten if impl == "kernel" else oc.unflatten_reference
    ts = [torch.randn(3000), torch.randn(5)]
    offsets, total = oc.flat_layout(ts)
    flat = oc.aligned_empty(total, torch.float32)
    with pytest.raises(ValueError, match=r"out and tensors\[1\] overlap in memory"):
        flatten([ts[0], flat[offsets[1] + 1 : offsets[1] + 6]], out=flat)
    with pytest.raises(ValueError, match=r"outs\[0\] and flat overlap in memory"):
        unflatten(flat, offsets, [flat[10:3010], torch.empty(5)])
    shared = torch.empty(3003)
    with pytest.raises(ValueError, match=r"outs\[0\] and outs\[1\] overlap in memory"):
        unflatten(flat, offsets, [shared[:3000], shared[2998:]])


@needs_ext
def test_extension_refuses_overlap_naming_the_arguments():
    y = torch.zeros(1000)
    other = torch.zeros(10)
    with pytest.raises(ValueError, match=r"copy_many: dsts\[0\] and srcs\[0\] overlap"):
        _C.copy_many([y[1:]], [y[:-1]])
    with pytest.raises(ValueError, match=r"copy_many: dsts\[1\] and srcs\[0\] overlap"):
        _C.copy_many([other, y[500:600]], [y[595:605], torch.zeros(100)])
    with pytest.raises(ValueError, match=r"copy_many: dsts\[0\] and dsts\[1\] overlap"):
        _C.copy_many([y[:100], y[50:150]], [torch.zeros(100), torch.zeros(100)])
    _C.copy_many([y[:100], y[100:200]], [y[200:300], y[200:300]])  # sources may share; outputs disjoint
    flat = oc.aligned_empty(2048, torch.float32)
    with pytest.raises(ValueError, match=r"flatten_into: flat and tensors\[0\] overlap"):
        _C.flatten_into(flat, [flat[1024:1034]], [0])
    with pytest.raises(ValueError, match=r"unflatten_from: tensors\[1\] and flat overlap"):
        _C.unflatten_from(flat, [torch.empty(10), flat[1500:1510]], [0, 1024])
