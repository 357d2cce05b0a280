"""AdamW with 8-bit block-quantized moments ("AdamW8bit"): the fused CPU kernel (csrc/adam/adam8bit.cpp)
and its plain-torch reference.

State per param: the fp32 master (4 B) plus, per moment, one uint8 code and 4/256 B of block absmax,
about 6.03 B/param in all against the fp32 AdamW's 12.

Format (the kernel and this module agree bit for bit; other code depends on it):
  - BLOCK = 256 elements, anchored at element 0 of the tensors passed (a caller passes one chunk of a
    flat shard); the last block may be partial;
  - a quantized moment is `codes` (uint8, n elements: indices into a 256-entry codebook) and `absmax`
    (fp32, ceil(n / 256) elements: each block's max |value|);
  - CODEBOOK_SIGNED (exp_avg): 0, r^k (k = 0..127), -r^k (k = 0..126), r = 1e-7 ** (1/127);
    CODEBOOK_UNSIGNED (exp_avg_sq): 0, r^k (k = 0..254), r = 1e-14 ** (1/254); built in float64,
    rounded to fp32, ascending. Midpoints (c[i] + c[i+1]) * 0.5 in fp32;
  - quantize a block: a = max |x|; a == 0: every code is the index of 0.0, absmax 0; a not finite
    (inf/NaN in the block): every code is the index of 0.0 and absmax NaN, so the block reads back as
    NaN (loud, not silently zeroed); else code = the number of midpoints strictly below x / a (fp32);
  - dequantize: x = c[code] * absmax (fp32).

Neighbouring levels are a factor 1/r = 1.135 apart (the same ratio in both codebooks), so a value at
or above the smallest level of its block is read back within (1 - r) / (1 + r) = 6.34% of itself;
values below it (under 1e-7 of the block's absmax for exp_avg, 1e-14 for exp_avg_sq) may read back as 0.

`adamw8bit_step_` updates the elements [lo, hi): every block meeting that range is dequantized, its
elements inside the range get exactly the fp32 kernel's AdamW (offload.ops.adamw_step_), and the whole
block is quantized again (a new absmax over all its elements). Blocks outside the range are untouched.
"""
from __future__ import annotations

import math

import torch

from .. import _ext
from .adam import adamw_step_reference, check_step_hyper

__all__ = [
    "BLOCK",
    "CODEBOOK_SIGNED",
    "CODEBOOK_UNSIGNED",
    "blocks",
    "quantize_blocks_",
    "dequantize_blocks",
    "adamw8bit_step_",
    "adamw8bit_step_reference",
]

BLOCK = 256


def _codebook(signed: bool) -> torch.Tensor:
    # float ** int is libm's pow on doubles, as the C++ side computes it; one rounding to fp32.
    if signed:
        r = 1e-7 ** (1 / 127)
        levels = [r**k for k in range(128)] + [-(r**k) for k in range(127)] + [0.0]
    else:
        r = 1e-14 ** (1 / 254)
        levels = [r**k for k in range(255)] + [0.0]
    return torch.tensor(sorted(levels), dtype=torch.float64).to(torch.float32)


CODEBOOK_SIGNED = _codebook(True)
CODEBOOK_UNSIGNED = _codebook(False)
_MIDS = {s: (c[:-1] + c[1:]) * 0.5 for s, c in ((True, CODEBOOK_SIGNED), (False, CODEBOOK_UNSIGNED))}
_ZERO = {True: int((CODEBOOK_SIGNED == 0).nonzero()), False: int((CODEBOOK_UNSIGNED == 0).nonzero())}


def blocks(n: int) -> int:
    """Blocks (absmax entries) of an n-element moment: ceil(n / 256)."""
    return (int(n) + BLOCK - 1) // BLOCK


def _codebook_of(signed: bool) -> torch.Tensor:
    return CODEBOOK_SIGNED if signed else CODEBOOK_UNSIGNED


def _check_q(fn: str, codes: torch.Tensor, absmax: torch.Tensor, n: int) -> None:
    def bad(msg: str):
        raise ValueError(f"offload.ops.{fn}: {msg}")

    if codes.dtype != torch.uint8:
        bad(f"codes has dtype {codes.dtype}; expected torch.uint8")
    if codes.numel() != n:
        bad(f"codes has {codes.numel()} elements but expected {n}")
    if absmax.dtype != torch.float32:
        bad(f"absmax has dtype {absmax.dtype}; expected torch.float32")
    if absmax.numel() != blocks(n):
        bad(f"absmax has {absmax.numel()} elements but expected {blocks(n)} (ceil(numel / 256) blocks)")


@torch.no_grad()
def quantize_blocks_(values: torch.Tensor, codes: torch.Tensor, absmax: torch.Tensor, signed: bool) -> None:
    """Quantize fp32 `values` (n elements) into `codes` (uint8, n) and `absmax` (fp32, blocks(n)), in place.
    Plain torch: the reference statement of the format."""
    n = values.numel()
    if values.dtype != torch.float32:
        raise ValueError(f"offload.ops.quantize_blocks_: values has dtype {values.dtype}; expected torch.float32")
    _check_q("quantize_blocks_", codes, absmax, n)
    if n == 0:
        return
    nb = blocks(n)
    x = values.reshape(-1)
    if nb * BLOCK != n:
        x = torch.nn.functional.pad(x, (0, nb * BLOCK - n))  # zeros: neutral for the max, trimmed below
    xb = x.view(nb, BLOCK)
    a = xb.abs().amax(dim=1)
    bad = ~torch.isfinite(a) | xb.isnan().any(dim=1)
    zero = a == 0
    special = bad | zero
    y = xb / torch.where(special, torch.ones_like(a), a)[:, None]  # fp32 division, as the kernel
    c = torch.bucketize(y, _MIDS[bool(signed)], right=False)  # = #{mids < y}
    c[special] = _ZERO[bool(signed)]
    codes.view(-1).copy_(c.view(-1)[:n])
    absmax.view(-1).copy_(torch.where(bad, torch.full_like(a, math.nan), torch.where(zero, torch.zeros_like(a), a)))


@torch.no_grad()
def dequantize_blocks(codes: torch.Tensor, absmax: torch.Tensor, signed: bool) -> torch.Tensor:
    """fp32 values (flat, codes.numel() elements) of a quantized moment: codebook[code] * absmax."""
    n = codes.numel()
    _check_q("dequantize_blocks", codes, absmax, n)
    levels = _codebook_of(bool(signed))[codes.reshape(-1).long()]
    return levels * absmax.reshape(-1).repeat_interleave(BLOCK)[:n]


def _hyper(lr, beta1, beta2, eps, weight_decay, step, grad_scale) -> dict:
    return dict(lr=float(lr), beta1=float(beta1), beta2=float(beta2), eps=float(eps),
                weight_decay=float(weight_decay), step=int(step), grad_scale=float(grad_scale))


def adamw8bit_step_(
    master: torch.Tensor,
    grad: torch.Tensor,
    exp_avg_codes: torch.Tensor,
    exp_avg_absmax: torch.Tensor,
    exp_avg_sq_codes: torch.Tensor,
    exp_avg_sq_absmax: torch.Tensor,
    *,
    lo: int,
    hi: int,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    step: int,
    grad_scale: float = 1.0,
    out: torch.Tensor | None = None,
) -> None:
    """One AdamW step on elements [lo, hi) with 8-bit block-quantized moments, in place.

    master fp32 (n elements); grad fp32/bf16/fp16 (n); *_codes uint8 (n); *_absmax fp32 (ceil(n/256));
    out: optional bf16/fp16/fp32 (n), written for [lo, hi) only. All contiguous CPU; `step` is the count
    after this update (>= 1); 0 <= lo <= hi <= n. Bad arguments raise ValueError naming the argument.
    Every block meeting [lo, hi) is re-quantized as a whole; the others are untouched. Without the C++
    extension this runs `adamw8bit_step_reference` (warned once).
    """
    h = _hyper(lr, beta1, beta2, eps, weight_decay, step, grad_scale)
    ext = _ext.get()
    if ext is None or not hasattr(ext, "adamw8bit_step_"):
        _ext.warn_fallback("adamw8bit_step_")
        return adamw8bit_step_reference(master, grad, exp_avg_codes, exp_avg_absmax, exp_avg_sq_codes,
                                        exp_avg_sq_absmax, lo=lo, hi=hi, out=out, **h)
    ext.adamw8bit_step_(master, grad, exp_avg_codes, exp_avg_absmax, exp_avg_sq_codes, exp_avg_sq_absmax,
                        lo=int(lo), hi=int(hi), out=out, **h)


def _check_step_args(master, grad, mc, ma, vc, va, out, lo, hi, lr, beta1, beta2, eps, weight_decay, step,
                     grad_scale) -> None:
    # The C++ bindings' contract and wording, so the fallback is a drop-in.
    def bad(msg: str):
        raise ValueError(f"offload.ops.adamw8bit_step_: {msg}")

    check_step_hyper(bad, lr, beta1, beta2, eps, weight_decay, step, grad_scale, master)
    n = master.numel()
    nb = blocks(n)

    def tensor(name, t, size, of):
        if t.device.type != "cpu":
            bad(f"{name} is on {t.device}; this kernel runs on CPU tensors only")
        if not t.is_contiguous():
            bad(f"{name} must be contiguous")
        if t.numel() != size:
            bad(f"{name} has {t.numel()} elements but expected {size} ({of})")

    def exact(name, t, dtype):
        if t.dtype != dtype:
            bad(f"{name} has dtype {t.dtype}; expected {dtype}")

    tensor("master", master, n, "master's numel")
    tensor("grad", grad, n, "master's numel")
    for name, t, dtype, size, of in (
        ("exp_avg_codes", mc, torch.uint8, n, "master's numel"),
        ("exp_avg_sq_codes", vc, torch.uint8, n, "master's numel"),
        ("exp_avg_absmax", ma, torch.float32, nb, "ceil(numel / 256) blocks"),
        ("exp_avg_sq_absmax", va, torch.float32, nb, "ceil(numel / 256) blocks"),
    ):
        exact(name, t, dtype)
        tensor(name, t, size, of)
    if not 0 <= lo <= n:
        bad(f"lo must be in [0, {n}], got {lo}")
    if not lo <= hi <= n:
        bad(f"hi must be in [lo, numel] = [{lo}, {n}], got {hi}")
    if grad.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        bad(f"grad has dtype {grad.dtype}; expected one of: float32, bfloat16, float16")
    if out is not None:
        tensor("out", out, n, "master's numel")
        if out.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            bad(f"out has dtype {out.dtype}; expected one of: float32, bfloat16, float16")


@torch.no_grad()
def adamw8bit_step_reference(
    master: torch.Tensor,
    grad: torch.Tensor,
    exp_avg_codes: torch.Tensor,
    exp_avg_absmax: torch.Tensor,
    exp_avg_sq_codes: torch.Tensor,
    exp_avg_sq_absmax: torch.Tensor,
    *,
    lo: int,
    hi: int,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    step: int,
    grad_scale: float = 1.0,
    out: torch.Tensor | None = None,
) -> None:
    """Plain torch, the kernel's contract: dequantize the blocks meeting [lo, hi), run
    `adamw_step_reference` on the [lo, hi) slices of the fp32 copies, quantize the blocks back."""
    lo, hi = int(lo), int(hi)
    h = _hyper(lr, beta1, beta2, eps, weight_decay, step, grad_scale)
    _check_step_args(master, grad, exp_avg_codes, exp_avg_absmax, exp_avg_sq_codes, exp_avg_sq_absmax, out,
                     lo, hi, **h)
    if hi <= lo:
        return
    n = master.numel()
    b0, b1 = lo // BLOCK, blocks(hi)
    s, e = b0 * BLOCK, min(b1 * BLOCK, n)
    mc, vc = exp_avg_codes.view(-1)[s:e], exp_avg_sq_codes.view(-1)[s:e]
    ma, va = exp_avg_absmax.view(-1)[b0:b1], exp_avg_sq_absmax.view(-1)[b0:b1]
    m = dequantize_blocks(mc, ma, True)
    v = dequantize_blocks(vc, va, False)
    adamw_step_reference(master.view(-1)[lo:hi], grad.reshape(-1)[lo:hi], m[lo - s:hi - s], v[lo - s:hi - s],
                         out=None if out is None else out.view(-1)[lo:hi], **h)
    quantize_blocks_(m, mc, ma, True)
    quantize_blocks_(v, vc, va, False)
