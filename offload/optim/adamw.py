"""`offload.AdamW`: a drop-in torch.optim.Optimizer running the fused CPU AdamW kernel.

- fp32 params are stepped in place; their state (`step`, `exp_avg`, `exp_avg_sq`) has torch.optim.AdamW's
  keys and layout, so state dicts move between the two.
- bf16/fp16 params keep an fp32 `master` copy in state; the kernel updates master and moments and
  writes the rounded param back into the param's own storage in the same pass (no cast pass).
- `moments_dtype=torch.bfloat16` (opt-in, per group) stores both moments in bf16: 12 -> 8 bytes of
  optimizer state per param, fewer bytes to move when states are offloaded.
- `maximize=True` is the kernel's grad scale of -1; `amsgrad` is not supported.

The per-buffer update is `step_flat`, so a sharded/offloaded optimizer can step flat shards with the
same hyperparameter handling as this class.
"""
from __future__ import annotations

from typing import Any, Callable, Iterable

import torch

from ..ops.adam import adamw_step_
from .base import ShardDispatch, add_checked, check_groups
from .schema import LogicalState, Schema, StoredState, register

__all__ = ["AdamW", "ADAMW", "ADAMW_BF16", "step_flat"]

_MOMENT_DTYPES = (torch.float32, torch.bfloat16)
_PARAM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def step_flat(
    master: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    out: torch.Tensor | None,
    group: dict[str, Any],
    step: int,
    grad_scale: float = 1.0,
) -> None:
    """One AdamW update of a flat (contiguous CPU) buffer with `group`'s hyperparameters.

    master fp32; grad fp32/bf16/fp16; moments fp32 or bf16; `out` (optional) receives the updated
    param as bf16/fp16. `step` is the count after this update. `grad_scale` multiplies the grad in
    the same pass (clipping coefficient, loss-scale unscale); maximize flips its sign.
    """
    beta1, beta2 = group["betas"]
    scale = -float(grad_scale) if group.get("maximize", False) else float(grad_scale)
    adamw_step_(
        master, grad, exp_avg, exp_avg_sq,
        lr=float(group["lr"]), beta1=float(beta1), beta2=float(beta2), eps=float(group["eps"]),
        weight_decay=float(group["weight_decay"]), step=int(step), grad_scale=scale, out=out,
    )


def _adamw_chunk(master, grad, states, out, lo, hi, hyper, step, grad_scale) -> None:
    step_flat(master[lo:hi], grad[lo:hi], states["exp_avg"][lo:hi], states["exp_avg_sq"][lo:hi],
              None if out is None else out[lo:hi], hyper, step, grad_scale)


# fp32 moments, a value per element: 8 bytes per parameter besides the master
ADAMW = register(Schema("adamw", (StoredState("exp_avg", torch.float32), StoredState("exp_avg_sq", torch.float32)),
                        _adamw_chunk))


def _bf16_view(name: str) -> LogicalState:
    return LogicalState(name, (name,), unpack=lambda t: t[name].float(), pack=lambda values, t: t[name].copy_(values))


# AdamW(moments_dtype=torch.bfloat16): bf16 moments (the kernel widens, updates and rounds them), 4 bytes
ADAMW_BF16 = register(Schema("adamw-bf16", (StoredState("exp_avg", torch.bfloat16),
                                            StoredState("exp_avg_sq", torch.bfloat16)),
                             _adamw_chunk, (_bf16_view("exp_avg"), _bf16_view("exp_avg_sq")), update_bytes=20.0))


def _check_hyper(lr, betas, eps, weight_decay, moments_dtype, who: str = "offload.AdamW") -> None:
    """torch.optim.AdamW's checks, in its words (a script's `except ValueError` and its tests see the same), each
    followed by the argument it is about."""
    if isinstance(lr, torch.Tensor) and lr.numel() != 1:
        raise ValueError(f"Tensor lr must be 1-element ({who} lr: got a tensor of {lr.numel()} elements)")
    lr_value = float(lr)
    if not 0.0 <= lr_value:
        raise ValueError(f"Invalid learning rate: {lr_value} ({who} lr)")
    if not 0.0 <= eps:
        raise ValueError(f"Invalid epsilon value: {eps} ({who} eps)")
    try:
        count = len(betas)
    except TypeError:
        count = None
    if count != 2:
        raise ValueError(f"{who} betas={betas!r}: expected two values (beta1, beta2), each in [0, 1)")
    for i, beta in enumerate(betas):
        if isinstance(beta, torch.Tensor) and beta.numel() != 1:
            raise ValueError(f"Tensor betas[{i}] must be 1-element ({who} betas)")
        if not 0.0 <= float(beta) < 1.0:
            raise ValueError(f"Invalid beta parameter at index {i}: {float(beta)} ({who} betas={tuple(betas)}: "
                             "each in [0, 1))")
    if not 0.0 <= weight_decay:
        raise ValueError(f"Invalid weight_decay value: {weight_decay} ({who} weight_decay)")
    if moments_dtype not in _MOMENT_DTYPES:
        raise ValueError(
            f"{who}: moments_dtype must be torch.float32 or torch.bfloat16, got {moments_dtype}"
        )


class AdamW(ShardDispatch, torch.optim.Optimizer):
    """AdamW (decoupled weight decay) on CPU tensors with the fused offload kernel.

    Same arguments and defaults as torch.optim.AdamW (lr=1e-3, betas=(0.9, 0.999), eps=1e-8,
    weight_decay=1e-2, maximize=False; foreach/fused accepted and ignored), and its ValueErrors for bad ones.
    DeepSpeedCPUAdam's weight_decay default is 0: a script moving from it without weight_decay gives
    weight_decay=0 to keep its update. amsgrad, capturable and differentiable are rejected (in the constructor,
    add_param_group, a loaded state dict, and at every step for a group's key set since); `moments_dtype` (float32 by default, bfloat16 opt-in) sets the
    dtype of both moments per param group.
    """

    schema = ADAMW  # what the runtime's sharded variant stores (fp32 moments)

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float | torch.Tensor = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        amsgrad: bool = False,
        *,
        maximize: bool = False,
        foreach: bool | None = None,
        capturable: bool = False,
        differentiable: bool = False,
        fused: bool | None = None,
        moments_dtype: torch.dtype = torch.float32,
    ):
        params = self.__dict__.pop("_offload_params", params)
        # foreach/fused are accepted for drop-in compatibility: this optimizer is always one fused pass.
        del foreach, fused
        if amsgrad:
            raise ValueError("offload.AdamW: amsgrad=True is not supported; use torch.optim.AdamW for AMSGrad")
        if capturable or differentiable:
            raise ValueError("offload.AdamW: capturable=True / differentiable=True are not supported (CPU kernel, "
                             "no autograd through the step)")
        _check_hyper(lr, betas, eps, weight_decay, moments_dtype)
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, amsgrad=False,
                        maximize=maximize, moments_dtype=moments_dtype)
        super().__init__(params, defaults)
        for group in self.param_groups:
            _check_hyper(group["lr"], group["betas"], group["eps"], group["weight_decay"], group["moments_dtype"])
            if group.get("amsgrad", False):
                raise ValueError("offload.AdamW: amsgrad=True is not supported (param group)")
            for p in group["params"]:
                self._check_param(p)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        add_checked(self, super().add_param_group, param_group, getattr(self, "display", "offload.AdamW"))

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        for group in self.param_groups:
            group.setdefault("maximize", False)
            group.setdefault("amsgrad", False)
            group.setdefault("moments_dtype", torch.float32)

    @staticmethod
    def _check_param(p: torch.Tensor) -> None:
        if p.device.type != "cpu":
            raise ValueError(
                f"offload.AdamW: a parameter is on {p.device}; this optimizer steps CPU tensors "
                "(keep params on CPU, or use the offload runtime to shard them)"
            )
        if p.dtype not in _PARAM_DTYPES:
            raise ValueError(f"offload.AdamW: parameter dtype {p.dtype} is not supported (float32, bfloat16, float16)")

    def _init_state(self, p: torch.Tensor, state: dict[str, Any], group: dict[str, Any]) -> None:
        mdt = group["moments_dtype"]
        state["step"] = torch.tensor(0.0, dtype=torch.float32)
        state["exp_avg"] = torch.zeros(p.shape, dtype=mdt)
        state["exp_avg_sq"] = torch.zeros(p.shape, dtype=mdt)
        if p.dtype != torch.float32:
            state["master"] = p.detach().to(torch.float32, memory_format=torch.contiguous_format, copy=True)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None):
        check_groups("offload.AdamW", self.param_groups)  # (a key may have been set since construction)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("offload.AdamW does not support sparse gradients")
                self._check_param(p)
                state = self.state[p]
                if len(state) == 0:
                    self._init_state(p, state, group)
                state["step"] += 1
                self._step_param(p, state, group, int(state["step"].item()))
        return loss

    def _step_param(self, p: torch.Tensor, state: dict[str, Any], group: dict[str, Any], step: int) -> None:
        grad = p.grad if p.grad.is_contiguous() else p.grad.contiguous()
        master = state.get("master")
        if master is None:  # fp32 param: it is its own master
            if p.is_contiguous():
                step_flat(p, grad, state["exp_avg"], state["exp_avg_sq"], None, group, step)
            else:  # rare (strided views as params): step a contiguous copy, write it back
                tmp = p.contiguous()
                step_flat(tmp, grad, state["exp_avg"], state["exp_avg_sq"], None, group, step)
                p.copy_(tmp)
            return
        if p.is_contiguous():
            step_flat(master, grad, state["exp_avg"], state["exp_avg_sq"], p, group, step)
        else:
            step_flat(master, grad, state["exp_avg"], state["exp_avg_sq"], None, group, step)
            p.copy_(master.view(p.shape))

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's loader casts every floating state tensor to the param's dtype, which would round a
        bf16 param's fp32 master (and fp32 moments) to bf16. Restore the saved tensors with this
        optimizer's dtypes (master fp32, moments per group) as private contiguous CPU copies."""
        saved_groups = state_dict["param_groups"]
        saved_state = state_dict["state"]
        check_groups("offload.AdamW", saved_groups, " of the state dict")  # (torch's AMSGrad dict: refused)
        super().load_state_dict(state_dict)
        id_to_param = {}
        for saved, group in zip(saved_groups, self.param_groups):
            for pid, p in zip(saved["params"], group["params"]):
                id_to_param[pid] = (p, group)
        for pid, saved in saved_state.items():
            if pid not in id_to_param:
                continue
            p, group = id_to_param[pid]
            st = self.state[p]
            for key in ("exp_avg", "exp_avg_sq"):
                if key in saved:
                    st[key] = saved[key].detach().to(device="cpu", dtype=group["moments_dtype"], copy=True).contiguous()
            if p.dtype != torch.float32:
                src = saved["master"] if "master" in saved else p.detach()  # no master saved: best effort
                st["master"] = src.detach().to(device="cpu", dtype=torch.float32, copy=True).contiguous()
            else:
                st.pop("master", None)
            if "step" in saved:
                st["step"] = torch.as_tensor(saved["step"], dtype=torch.float32).detach().clone().cpu()
