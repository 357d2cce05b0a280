"""`offload.AdamW8bit`: AdamW whose moments are stored as 8-bit codes with an fp32 scale per block of 256.

The update is the fp32 kernel's AdamW: each block is widened to fp32, updated, and re-quantized in the same
pass (offload.ops.adam8bit). exp_avg uses a signed log-spaced codebook, exp_avg_sq an unsigned one reaching
1e-14 of the block's largest value (so a small second moment does not round to zero beside a large one); the
fp32 master stays fp32. State per parameter: 4 (master) + 2 x (1 + 4/256) bytes, about 6 bytes against
AdamW's 12: half the optimizer's traffic when its states live on NVMe. bitsandbytes and torchao name theirs
the same; like theirs this is lossy (each moment within about 7% of its fp32 value) and not bitwise torch's.
"""
from __future__ import annotations

import torch

from ..ops import adam8bit as q
from .adamw import _check_hyper
from .base import SchemaOptimizer
from .schema import LogicalState, Schema, StoredState, register

__all__ = ["AdamW8bit", "ADAMW8BIT"]


def _chunk(master, grad, states, out, lo, hi, hyper, step, grad_scale) -> None:
    beta1, beta2 = hyper["betas"]
    scale = -float(grad_scale) if hyper.get("maximize", False) else float(grad_scale)
    q.adamw8bit_step_(master, grad, states["exp_avg.codes"], states["exp_avg.absmax"], states["exp_avg_sq.codes"],
                      states["exp_avg_sq.absmax"], lo=lo, hi=hi, lr=float(hyper["lr"]), beta1=float(beta1),
                      beta2=float(beta2), eps=float(hyper["eps"]), weight_decay=float(hyper["weight_decay"]),
                      step=int(step), grad_scale=scale, out=out)


def _moment(name: str, signed: bool) -> tuple[tuple[StoredState, StoredState], LogicalState]:
    codebook = q.CODEBOOK_SIGNED if signed else q.CODEBOOK_UNSIGNED
    zero = int((codebook == 0).nonzero()[0])  # the code of 0.0: a fresh moment
    codes, absmax = f"{name}.codes", f"{name}.absmax"

    def unpack(t: dict) -> torch.Tensor:
        return q.dequantize_blocks(t[codes], t[absmax], signed)

    def pack(values: torch.Tensor, t: dict) -> None:
        q.quantize_blocks_(values.float().contiguous(), t[codes], t[absmax], signed)

    stored = (StoredState(codes, torch.uint8, 1, float(zero)), StoredState(absmax, torch.float32, q.BLOCK))
    return stored, LogicalState(name, (codes, absmax), unpack, pack)


_M, _M_VIEW = _moment("exp_avg", signed=True)
_V, _V_VIEW = _moment("exp_avg_sq", signed=False)
# master 8, codes 2 x 2, scales 2 x 2 x 4/256 and the gradient 4 bytes per element; the block search bounds it
# where cores are few: 261-298M elements/s per core (AVX2 / AVX-512, benchmarks/RESULTS.md)
ADAMW8BIT = register(Schema("adamw8bit", _M + _V, _chunk, (_M_VIEW, _V_VIEW), update_bytes=16.06,
                            update_core_rate=2.6e8))


class AdamW8bit(SchemaOptimizer):
    """AdamW with 8-bit block-quantized moments (see the module docstring); torch.optim.AdamW's arguments and
    defaults (lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, maximize=False)."""

    schema = ADAMW8BIT
    display = "offload.AdamW8bit"

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, *, maximize: bool = False):
        _check_hyper(lr, betas, eps, weight_decay, torch.float32, "offload.AdamW8bit")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                                      maximize=maximize))
