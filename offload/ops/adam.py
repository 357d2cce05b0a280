"""Fused CPU AdamW kernel (csrc/adam) and its plain-torch reference.

`adamw_step_` updates an fp32 master and its moments in place in one pass over memory, reading the
grad as fp32, bf16 or fp16 (scaled by `grad_scale` in the same pass), and optionally writes the
updated param rounded to bf16/fp16 into `out`. The math is torch.optim.AdamW's:

    p  = p * (1 - lr * weight_decay)
    m  = lerp(m, g, 1 - beta1);   v = beta2 * v + (1 - beta2) * g * g
    p  = p - lr / (1 - beta1**step) * m / (sqrt(v) / sqrt(1 - beta2**step) + eps)

Moments may be bf16 (opt-in): they are widened to fp32, updated, and rounded back (nearest-even).
"""
from __future__ import annotations

import math

import torch

from .. import _ext

__all__ = ["adamw_step_", "adamw_step_reference"]


def adamw_step_(
    master: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    step: int,
    grad_scale: float = 1.0,
    out: torch.Tensor | None = None,
) -> None:
    """One AdamW step in place on `master` (fp32), `exp_avg`/`exp_avg_sq` (fp32 or bf16).

    grad: fp32/bf16/fp16 with master's numel; `step` is the count after this update (>= 1).
    out: optional bf16/fp16/fp32 tensor that receives the updated master, rounded to nearest-even
    (bitwise equal to `master.to(out.dtype)`). All tensors contiguous CPU; bad ones raise ValueError
    naming the argument. Falls back to `adamw_step_reference` (warned once) without the extension.
    """
    ext = _ext.get()
    if ext is None:
        _ext.warn_fallback("adamw_step_")
        return adamw_step_reference(
            master, grad, exp_avg, exp_avg_sq, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
            weight_decay=weight_decay, step=step, grad_scale=grad_scale, out=out,
        )
    ext.adamw_step_(
        master, grad, exp_avg, exp_avg_sq, lr=float(lr), beta1=float(beta1), beta2=float(beta2), eps=float(eps),
        weight_decay=float(weight_decay), step=int(step), grad_scale=float(grad_scale), out=out,
    )


def check_step_hyper(bad, lr, beta1, beta2, eps, weight_decay, step, grad_scale, master) -> None:
    """The AdamW kernels' hyperparameter contract (the C++ bindings' wording): `bad(message)` raises."""
    if not (math.isfinite(lr) and lr >= 0):
        bad(f"lr must be finite and >= 0, got {lr}")
    if not 0 <= beta1 < 1:
        bad(f"beta1 must be in [0, 1), got {beta1}")
    if not 0 <= beta2 < 1:
        bad(f"beta2 must be in [0, 1), got {beta2}")
    if not (math.isfinite(eps) and eps >= 0):
        bad(f"eps must be finite and >= 0, got {eps}")
    if not (math.isfinite(weight_decay) and weight_decay >= 0):
        bad(f"weight_decay must be finite and >= 0, got {weight_decay}")
    if not math.isfinite(grad_scale):
        bad(f"grad_scale must be finite, got {grad_scale}")
    if int(step) < 1:
        bad(f"step must be >= 1 (the count after this update), got {step}")
    if master.dtype != torch.float32:
        bad(f"master has dtype {master.dtype}; expected float32")


def _check_reference_args(master, grad, exp_avg, exp_avg_sq, out, lr, beta1, beta2, eps, weight_decay, step,
                          grad_scale) -> None:
    # Same contract (and the same ValueError wording) as the C++ bindings, so the fallback is a drop-in.
    def bad(msg: str):
        raise ValueError(f"offload.ops.adamw_step_: {msg}")

    check_step_hyper(bad, lr, beta1, beta2, eps, weight_decay, step, grad_scale, master)
    n = master.numel()
    named = [("master", master), ("grad", grad), ("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)]
    if out is not None:
        named.append(("out", out))
    for name, t in named:
        if t.device.type != "cpu":
            bad(f"{name} is on {t.device}; this kernel runs on CPU tensors only")
        if not t.is_contiguous():
            bad(f"{name} must be contiguous")
        if t.numel() != n:
            bad(f"{name} has {t.numel()} elements but master has {n}")
    if grad.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        bad(f"grad has dtype {grad.dtype}; expected one of: float32, bfloat16, float16")
    for name, t in (("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)):
        if t.dtype not in (torch.float32, torch.bfloat16):
            bad(f"{name} has dtype {t.dtype}; expected one of: float32, bfloat16")
    if exp_avg.dtype != exp_avg_sq.dtype:
        bad(f"exp_avg_sq has dtype {exp_avg_sq.dtype} but exp_avg has {exp_avg.dtype}; both moments need the same dtype")
    if out is not None and out.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        bad(f"out has dtype {out.dtype}; expected one of: float32, bfloat16, float16")


@torch.no_grad()
def adamw_step_reference(
    master: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    step: int,
    grad_scale: float = 1.0,
    out: torch.Tensor | None = None,
) -> None:
    """Plain-torch AdamW with the kernel's contract: the same op sequence as torch.optim.AdamW's
    single-tensor path, so fp32 results match torch's; bf16 moments are computed in fp32 and
    rounded back."""
    _check_reference_args(master, grad, exp_avg, exp_avg_sq, out, lr, beta1, beta2, eps, weight_decay, step,
                          grad_scale)
    if master.numel() == 0:
        return
    g = grad.float()
    if grad_scale != 1.0:
        g = g * grad_scale
    m = exp_avg.float() if exp_avg.dtype != torch.float32 else exp_avg
    v = exp_avg_sq.float() if exp_avg_sq.dtype != torch.float32 else exp_avg_sq
    bc1 = 1.0 - beta1 ** int(step)
    bc2 = 1.0 - beta2 ** int(step)
    master.mul_(1.0 - lr * weight_decay)
    m.lerp_(g, 1.0 - beta1)
    v.mul_(beta2).addcmul_(g, g, value=1.0 - beta2)
    denom = (v.sqrt() / (bc2**0.5)).add_(eps)
    master.addcdiv_(m, denom, value=-(lr / bc1))
    if m is not exp_avg:
        exp_avg.copy_(m)  # rounds to nearest-even
        exp_avg_sq.copy_(v)
    if out is not None:
        out.copy_(master)
