"""The fused AdamW kernel (offload.ops.adamw_step_) against torch.optim.AdamW and its plain-torch
reference: every ISA path, grad dtypes, bf16/fp16 out, bf16 moments, thread counts, NaN bits, bad inputs."""
from __future__ import annotations

import textwrap

import pytest
import torch

from offload import _ext
from _fallback import run_without_extension
from offload.ops import adamw_step_, adamw_step_reference

C = _ext.get()
needs_ext = pytest.mark.skipif(C is None, reason=f"C++ extension unavailable: {_ext.error()}")

ORDER = ["scalar", "avx2", "avx512"]
ISAS = ORDER[: ORDER.index(C.best_isa()) + 1] if C is not None else []
MISSING = [i for i in ORDER if i not in ISAS]
# The AVX-512 path has two bf16 roundings: the hardware convert (AVX512_BF16 CPUs) and integer
# rounding; "avx512-intbf16" forces the latter so both are tested where the CPU has the former.
PATHS = ISAS + (["avx512-intbf16"] if "avx512" in ISAS and C.adam_hw_bf16_available() else [])


def _set_path(name):
    C.set_isa(name.split("-")[0])
    C.adam_set_hw_bf16(not name.endswith("-intbf16"))


def _reset_path():
    C.set_isa("auto")
    C.adam_set_hw_bf16(True)

# Hyperparameter sets: default-like, no weight decay, beta1 < 0.5 (torch's other lerp branch) with a
# grad scale, large lr.
HYPERS = [
    dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, grad_scale=1.0),
    dict(lr=1e-2, beta1=0.8, beta2=0.99, eps=1e-6, weight_decay=0.0, grad_scale=1.0),
    dict(lr=3e-4, beta1=0.3, beta2=0.95, eps=1e-8, weight_decay=0.1, grad_scale=0.5),
    dict(lr=5e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, grad_scale=2.0),
]
SIZES = [0, 1, 7, 4097, 1_000_003]
GRAD_DTYPES = [torch.float32, torch.bfloat16, torch.float16]
STEPS = 20

# Tolerance for the param: the kernel folds sqrt(bc2) into its scalars (one division less than torch)
# and uses an IEEE sqrt (torch's vectorized sqrt is ~1 ulp off in ~0.7% of lanes), so each step's
# update differs from torch's by a few ulps of the update (~lr). Hence 1e-5 relative to the value,
# with an absolute floor of 1e-5 * lr for params that pass near zero (relative error is meaningless
# there). The moments do not see these differences and match torch bit for bit.
RTOL = 1e-5


def atol(h):
    return h["lr"] * 1e-5


@pytest.fixture
def isa(request):
    _set_path(request.param)
    yield request.param
    _reset_path()


@pytest.fixture
def threads():
    yield C.set_num_threads
    C.set_num_threads(0)


def _grads(n, dtype, steps, seed, tiny=False):
    gen = torch.Generator().manual_seed(seed)
    grads = [torch.randn(n, generator=gen) for _ in range(steps)]
    if tiny:
        # Every 7th grad ~3e-19: exp_avg_sq ~1e-39 is an fp32/bf16 denormal, which the hardware bf16
        # convert would flush; the kernel must round it like everything else.
        for g in grads:
            g[::7] *= 3e-19
    return [g.to(dtype) for g in grads]


def _torch_adamw(p0, grads, h):
    """torch.optim.AdamW fed the upcast, scaled grads: what the kernel must reproduce."""
    p = p0.clone().requires_grad_(True)
    opt = torch.optim.AdamW([p], lr=h["lr"], betas=(h["beta1"], h["beta2"]), eps=h["eps"],
                            weight_decay=h["weight_decay"])
    for g in grads:
        p.grad = g.float() * h["grad_scale"]
        opt.step()
    st = opt.state[p] if p.numel() else {"exp_avg": torch.zeros(0), "exp_avg_sq": torch.zeros(0)}
    return p.detach(), st["exp_avg"], st["exp_avg_sq"]


def _run_kernel(fn, p0, grads, h, out_dtype=None, moments=torch.float32, check_out=True):
    n = p0.numel()
    master, m, v = p0.clone(), torch.zeros(n, dtype=moments), torch.zeros(n, dtype=moments)
    out = torch.empty(n, dtype=out_dtype) if out_dtype is not None else None
    for step, g in enumerate(grads, start=1):
        fn(master, g, m, v, step=step, out=out, **h)
        if out is not None and check_out:
            # Bitwise: the param copy is master rounded to nearest-even, written in the same pass.
            assert torch.equal(out.view(torch.int16), master.to(out_dtype).view(torch.int16)), f"step {step}"
    return master, m, v


@needs_ext
@pytest.mark.parametrize("isa", ISAS, indirect=True)
@pytest.mark.parametrize("gdtype", GRAD_DTYPES, ids=str)
@pytest.mark.parametrize("size", SIZES)
def test_parity_with_torch_adamw(isa, gdtype, size):
    # Large size: one hyperparameter set per ISA/dtype (runtime); small sizes: all of them.
    hypers = HYPERS if size < 100_000 else [HYPERS[(ISAS.index(isa) + GRAD_DTYPES.index(gdtype)) % len(HYPERS)]]
    out_dtype = {torch.float32: torch.bfloat16, torch.bfloat16: torch.bfloat16, torch.float16: torch.float16}[gdtype]
    for k, h in enumerate(hypers):
        p0 = torch.randn(size, generator=torch.Generator().manual_seed(k))
        grads = _grads(size, gdtype, STEPS, seed=100 + k)
        master, m, v = _run_kernel(adamw_step_, p0, grads, h, out_dtype=out_dtype)
        tp, tm, tv = _torch_adamw(p0, grads, h)
        torch.testing.assert_close(master, tp, rtol=RTOL, atol=atol(h))
        torch.testing.assert_close(m, tm, rtol=RTOL, atol=0)
        torch.testing.assert_close(v, tv, rtol=RTOL, atol=0)


@needs_ext
@pytest.mark.parametrize("gdtype", GRAD_DTYPES, ids=str)
def test_isa_paths_agree_bitwise(gdtype):
    # Every path computes the same roundings (explicit FMAs, IEEE sqrt/div), tails included.
    n = 4097 + 33
    p0 = torch.randn(n)
    grads = _grads(n, gdtype, 5, seed=7, tiny=gdtype != torch.float16)
    results = {}
    for name in PATHS:
        _set_path(name)
        try:
            for moments in (torch.float32, torch.bfloat16):
                results[name, moments] = _run_kernel(adamw_step_, p0, grads, HYPERS[2], torch.bfloat16, moments)
        finally:
            _reset_path()
    for (name, moments), got in results.items():
        for a, b in zip(got, results["scalar", moments]):
            assert torch.equal(a, b), (name, moments)


@needs_ext
def test_missing_isas_are_refused():
    if not MISSING:
        pytest.skip("this CPU has every path (nothing to refuse)")
    before = C.active_isa()
    for name in MISSING:
        with pytest.raises(ValueError, match=name):
            C.set_isa(name)
    assert C.active_isa() == before


@needs_ext
@pytest.mark.parametrize("isa", ISAS, indirect=True)
def test_thread_counts_agree_bitwise(isa, threads):
    n = 300_007  # 10 chunks of the kernel's grain, the last one partial
    p0 = torch.randn(n)
    grads = _grads(n, torch.bfloat16, 3, seed=3)
    ref = None
    for t in (1, 2, 3, 4):
        threads(t)
        got = _run_kernel(adamw_step_, p0, grads, HYPERS[0], torch.bfloat16, check_out=False)
        if ref is None:
            ref = got
        else:
            for a, b in zip(got, ref):
                assert torch.equal(a, b), f"{t} threads"


@needs_ext
@pytest.mark.parametrize("isa", PATHS, indirect=True)
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16], ids=str)
def test_out_cast_is_bitwise_torch_for_all_finite_values(isa, out_dtype):
    # lr=0, wd=0 leaves master untouched, so `out` must be exactly master.to(dtype) for arbitrary bit
    # patterns: denormals, exact ties, overflow to inf (fp16), signed zeros.
    gen = torch.Generator().manual_seed(11)
    bits = torch.randint(-(2**31), 2**31 - 1, (300_001,), generator=gen, dtype=torch.int64).to(torch.int32)
    special = torch.tensor([0.0, -0.0, 1e-45, -1e-45, 1e-39, 6e-8, 65504.0, 65520.0, 1e30, -1e30,
                            float("inf"), -float("inf"), 1.00390625, 1.01171875, 2.0**-14, 2.0**-24])
    master = torch.cat([bits.view(torch.float32), special])
    master = master[torch.isfinite(master) | torch.isinf(master)].contiguous()
    n = master.numel()
    expect = master.to(out_dtype)
    out = torch.empty(n, dtype=out_dtype)
    m, v = torch.zeros(n), torch.zeros(n)
    adamw_step_(master, torch.zeros(n), m, v, lr=0.0, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0,
                step=1, out=out)
    assert torch.equal(out.view(torch.int16), expect.view(torch.int16))


# fp32 NaN bit patterns: +NaN, -NaN, signaling with payloads (both signs), quiet with payloads, all ones.
NAN_BITS = [0x7FC00000, 0xFFC00000, 0x7F800001, 0xFF812345, 0x7FA12345, 0x7FC0ABCD, 0xFFFFFFFF, 0x7FFFFFFF]


def _nans(k):
    """k fp32 NaNs cycling through NAN_BITS."""
    bits = torch.tensor(NAN_BITS, dtype=torch.int64).to(torch.int32)
    return bits[torch.arange(k) % len(NAN_BITS)].view(torch.float32)


def _with_nans(n, seed):
    """n random params with the NaN patterns sprinkled in: whole NaN vectors, NaNs beside normals and
    denormals in one vector (the hardware bf16 convert's fallback), and NaNs in the last partial vector."""
    gen = torch.Generator().manual_seed(seed)
    master = torch.randn(n, generator=gen)
    master[1::97] = 1e-39  # denormals, some sharing a vector with a NaN
    idx = torch.cat([torch.arange(0, 16), torch.randint(0, n, (n // 50,), generator=gen), torch.arange(n - 5, n)])
    master[idx] = _nans(idx.numel())
    return master


@needs_ext
@pytest.mark.parametrize("isa", PATHS, indirect=True)
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16], ids=str)
def test_nan_params_give_torch_bits_in_out(isa, out_dtype, threads):
    # A NaN master must come out as master.to(dtype) writes it (bf16: 0xFFFF for every NaN; fp16: quiet,
    # sign and payload kept), on every path and thread count. 70_005 elements: three chunks, a tail.
    n = 70_005
    for t in (1, 3):
        threads(t)
        master = _with_nans(n, seed=t)
        out = torch.empty(n, dtype=out_dtype)
        m, v = torch.zeros(n), torch.zeros(n)
        grad = torch.randn(n, generator=torch.Generator().manual_seed(5))
        for step in (1, 2):
            adamw_step_(master, grad, m, v, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01,
                        step=step, out=out)
            nan = torch.isnan(master)
            assert nan.sum() >= n // 60  # the NaNs stay NaN (the check below is not vacuous)
            want = master.to(out_dtype).view(torch.int16)
            got = out.view(torch.int16)
            diff = (got != want).nonzero().flatten()
            assert diff.numel() == 0, (
                f"{isa}, {t} threads, step {step}: {diff.numel()} differ, first master "
                f"{hex(master.view(torch.int32)[diff[0]].item() & 0xFFFFFFFF)} -> ours "
                f"{hex(got[diff[0]].item() & 0xFFFF)}, torch {hex(want[diff[0]].item() & 0xFFFF)}")
            if out_dtype == torch.bfloat16:
                assert (got[nan] == -1).all()  # 0xFFFF, what torch writes for any NaN


@needs_ext
@pytest.mark.parametrize("isa", PATHS, indirect=True)
def test_nan_grads_give_torch_bits_in_bf16_moments(isa):
    # NaN grads make NaN moments; stored as bf16 they must be what torch's copy_ writes (the reference
    # rounds its fp32 moments with copy_): 0xFFFF, whatever NaN the arithmetic produced.
    n = 4097
    p0 = torch.randn(n)
    grads = _grads(n, torch.float32, 2, seed=9)
    for g in grads:
        g[3::41] = _nans(g[3::41].numel())
    got = _run_kernel(adamw_step_, p0, grads, HYPERS[0], torch.bfloat16, torch.bfloat16)
    ref = _run_kernel(adamw_step_reference, p0, grads, HYPERS[0], torch.bfloat16, torch.bfloat16)
    for a, b in zip(got[1:], ref[1:]):
        assert torch.isnan(a.float()).sum() >= n // 41
        assert torch.equal(a.view(torch.int16), b.view(torch.int16))


@needs_ext
@pytest.mark.parametrize("isa", PATHS, indirect=True)
def test_bf16_moments_match_reference(isa):
    # Moments never see the master, so the kernel's bf16 moments equal the reference's bit for bit;
    # the master differs by a few ulps of its update (see RTOL).
    n = 4097 * 3
    p0 = torch.randn(n)
    grads = _grads(n, torch.bfloat16, STEPS, seed=5, tiny=True)
    got = _run_kernel(adamw_step_, p0, grads, HYPERS[0], torch.bfloat16, torch.bfloat16)
    ref = _run_kernel(adamw_step_reference, p0, grads, HYPERS[0], torch.bfloat16, torch.bfloat16)
    assert got[1].dtype == torch.bfloat16
    tiny = got[2][::7].float()
    assert ((tiny > 0) & (tiny < 1.17e-38)).float().mean() > 0.5  # most of these moments are denormal
    assert torch.equal(got[1], ref[1]) and torch.equal(got[2], ref[2])
    torch.testing.assert_close(got[0], ref[0], rtol=RTOL, atol=atol(HYPERS[0]))


@pytest.mark.parametrize("gdtype", GRAD_DTYPES, ids=str)
@pytest.mark.parametrize("size", [0, 7, 4097])
def test_reference_matches_torch_adamw(gdtype, size):
    # The fallback path: same op sequence as torch's single-tensor AdamW, so bitwise equal.
    for k, h in enumerate(HYPERS):
        p0 = torch.randn(size)
        grads = _grads(size, gdtype, STEPS, seed=k)
        master, m, v = _run_kernel(adamw_step_reference, p0, grads, h, out_dtype=torch.bfloat16)
        tp, tm, tv = _torch_adamw(p0, grads, h)
        assert torch.equal(master, tp) and torch.equal(m, tm) and torch.equal(v, tv)


def test_fallback_without_extension_warns_and_matches_torch(tmp_path):
    script = textwrap.dedent(
        """
        import warnings, torch
        from offload.ops import adamw_step_
        torch.manual_seed(0)
        p = torch.randn(4097); ref = p.clone().requires_grad_(True)
        m, v = torch.zeros(4097), torch.zeros(4097); out = torch.empty(4097, dtype=torch.bfloat16)
        opt = torch.optim.AdamW([ref], lr=1e-2, weight_decay=0.1)
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            for step in range(1, 21):
                g = torch.randn(4097).to(torch.bfloat16)
                adamw_step_(p, g, m, v, lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1,
                            step=step, out=out)
                ref.grad = g.float(); opt.step()
        assert sum("plain-torch fallback" in str(x.message) for x in w) == 1, [str(x.message) for x in w]
        assert torch.equal(p, ref.detach()) and torch.equal(out, p.to(torch.bfloat16))
        print("ok")
        """
    )
    run_without_extension(script)


def _bad_cases():
    n = 64
    f32 = lambda k=n: torch.zeros(k)  # noqa: E731
    good = dict(master=f32(), grad=f32(), exp_avg=f32(), exp_avg_sq=f32(), out=None)
    big = torch.zeros(2 * n)
    cases = [
        ("master", dict(master=torch.zeros(n, dtype=torch.bfloat16))),
        ("master", dict(master=torch.zeros(n, device="meta"))),
        ("grad", dict(grad=torch.zeros(n, dtype=torch.int32))),
        ("grad", dict(grad=f32(n + 1))),
        ("grad", dict(grad=torch.zeros(2, n)[:, 0])),
        ("exp_avg", dict(exp_avg=torch.zeros(n, dtype=torch.float16))),
        ("exp_avg_sq", dict(exp_avg_sq=torch.zeros(n, dtype=torch.bfloat16))),
        ("exp_avg_sq", dict(exp_avg_sq=torch.zeros(n, 2)[:, 1])),
        ("exp_avg_sq", dict(exp_avg_sq=f32(n - 1))),
        ("out", dict(out=torch.zeros(n, dtype=torch.int16))),
        ("out", dict(out=torch.zeros(n + 3, dtype=torch.bfloat16))),
        ("overlap", dict(master=big[:n], exp_avg=big[n // 2: n // 2 + n])),
        # grad is only read, but a written buffer sharing its bytes makes the result depend on chunk order
        ("master and grad overlap", dict(master=big[:n], grad=big[n // 2: n // 2 + n])),
        ("exp_avg_sq and grad overlap", dict(grad=big[:n], exp_avg_sq=big[n // 2: n // 2 + n])),
        ("out and grad overlap", dict(grad=big[:n], out=big[n // 2: n // 2 + n])),
    ]
    hyper_cases = [("lr", dict(lr=-1.0)), ("beta1", dict(beta1=1.0)), ("beta2", dict(beta2=-0.1)),
                   ("eps", dict(eps=-1e-8)), ("weight_decay", dict(weight_decay=-0.1)),
                   ("step", dict(step=0)), ("grad_scale", dict(grad_scale=float("inf")))]
    return good, cases, hyper_cases


@pytest.mark.parametrize("impl", ["kernel", "reference"])
def test_bad_inputs_raise_value_error_naming_the_argument(impl):
    if impl == "kernel" and C is None:
        pytest.skip(f"C++ extension unavailable: {_ext.error()}")
    fn = adamw_step_ if impl == "kernel" else adamw_step_reference
    good, cases, hyper_cases = _bad_cases()
    hyper = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, step=1)
    for name, change in cases:
        if impl == "reference" and "overlap" in name:
            continue  # the reference runs op by op and has no aliasing hazard to check
        args = {**good, **change}
        with pytest.raises(ValueError, match=name):
            fn(args["master"], args["grad"], args["exp_avg"], args["exp_avg_sq"], out=args["out"], **hyper)
    for name, change in hyper_cases:
        with pytest.raises(ValueError, match=name):
            fn(good["master"], good["grad"], good["exp_avg"], good["exp_avg_sq"], **{**hyper, **change})


@pytest.mark.parametrize("isa", ISAS, indirect=True)
def test_roofline_kernels_compute_their_formulas(isa):
    # benchmarks/bench_adam.py's memory roofline: each ISA path (the AVX2 build runs only where the CPU has it)
    # must do the arithmetic its byte count assumes. 3 * 2**15 + 5 elements: several chunks and a ragged tail.
    n = 3 * 2**15 + 5
    a, b, c, d = (torch.randn(n) for _ in range(4))
    s = 0.375
    want = {"copy": b.clone(), "triad": b + s * c, "axpy": a + s * b, "adam": [a + s * d, b + s * d, c + s * d]}
    dst = torch.empty(n)
    C.membw_copy_(dst, b)
    assert torch.equal(dst, want["copy"])
    C.membw_triad_(dst, b, c, s)
    assert torch.allclose(dst, want["triad"], rtol=1e-6, atol=1e-6)
    x = a.clone()
    C.membw_axpy_(x, b, s)
    assert torch.allclose(x, want["axpy"], rtol=1e-6, atol=1e-6)
    x, y, z = a.clone(), b.clone(), c.clone()
    C.membw_adam_shaped_(x, y, z, d, s)
    assert all(torch.allclose(got, ref, rtol=1e-6, atol=1e-6) for got, ref in zip((x, y, z), want["adam"]))


@needs_ext
def test_grad_is_not_written_and_versions_bump():
    n = 1000
    master, grad, m, v = torch.randn(n), torch.randn(n).to(torch.bfloat16), torch.zeros(n), torch.zeros(n)
    g0 = grad.clone()
    out = torch.empty(n, dtype=torch.bfloat16)
    before = [t._version for t in (master, m, v, out)]
    adamw_step_(master, grad, m, v, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, step=1, out=out)
    assert torch.equal(grad, g0)
    assert all(t._version > b for t, b in zip((master, m, v, out), before))
