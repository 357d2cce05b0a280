"""offload.GradScaler: dynamic loss scaling for fp16 compute (Config.compute_dtype="fp16"), with the API and the
arithmetic of torch.amp.GradScaler, over an offload runtime's sharded gradients (FSDP's ShardedGradScaler's role).

    scaler = offload.GradScaler()
    scaler.scale(loss).backward()      # the loss times the scale S: small fp16 gradients stay representable
    scaler.unscale_(opt)               # optional, before clipping: the step's factor takes 1/S; overflow checked
    rt.clip_grad_norm_(1.0)            # then clips the norm of the unscaled gradients
    scaler.step(opt)                   # opt.step(), unless some gradient on some rank was inf or NaN
    scaler.update()                    # S halves after an overflow, doubles after growth_interval clean steps

Nothing rewrites the gradient shards. Unscaling is a factor of the fused update (the kernel's grad_scale, times the
clip coefficient), and the overflow check reads the per-parameter norms the reduce already took (an inf or NaN
element makes its parameter's norm non-finite): one all-reduce of a flag. A skipped step takes its speculative
updates back (update/speculation.py). The check is over the whole runtime: an overflow anywhere skips every
offload optimizer's step. With a power-of-two scale (the default factors keep it one) results are bitwise those of
torch.amp.GradScaler over plain PyTorch with the same casts: multiplying by 2^-k changes no rounding.
"""
from __future__ import annotations

import enum
import math

import torch

from .active import current
from .update.loss_scale import fp32 as _fp32


class OptimizerStage(enum.Enum):
    """Where one optimizer is in the scaler's step (torch's OptState)."""

    READY = "ready"
    UNSCALED = "unscaled"
    STEPPED = "stepped"




class GradScaler:
    """Dynamic loss scaling over offload optimizers (offload.AdamW, AdamW8bit, Lion over a runtime's params).

    init_scale: the first S (2**16). growth_factor / backoff_factor: S's factor after growth_interval steps in a
    row without overflow / after one with it. enabled=False: every call passes through (scale returns the loss).
    runtime: the offload runtime whose gradients it scales (default: the one open when scale() is first called,
    or the optimizer's at its first step).
    """

    def __init__(self, init_scale: float = 2.0 ** 16, growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000, enabled: bool = True, runtime=None):
        if not (isinstance(init_scale, (int, float)) and math.isfinite(init_scale) and init_scale > 0):
            raise ValueError(f"offload.GradScaler: init_scale must be a finite number > 0, got {init_scale!r}")
        if not growth_factor > 1.0:
            raise ValueError(f"offload.GradScaler: growth_factor must be > 1, got {growth_factor!r}")
        if not 0.0 < backoff_factor < 1.0:
            raise ValueError(f"offload.GradScaler: backoff_factor must be in (0, 1), got {backoff_factor!r}")
        if not isinstance(growth_interval, int) or growth_interval < 1:
            raise ValueError(f"offload.GradScaler: growth_interval must be an int >= 1, got {growth_interval!r}")
        self._enabled = bool(enabled)
        self._scale = _fp32(float(init_scale))
        self._growth_factor = float(growth_factor)
        self._backoff_factor = float(backoff_factor)
        self._growth_interval = growth_interval
        self._growth_tracker = 0  # steps in a row without overflow since S last changed
        self._stages: dict[int, OptimizerStage] = {}  # id(optimizer) -> its stage since the last update()
        self._found_inf: bool | None = None  # this step's overflow (over the runtime, every rank); None: unchecked
        # the update path (update/step.py) of the runtime whose gradients it scales: the given runtime's (taken at
        # the first call: it may be given before its block opened), else the first one it meets
        self._runtime = runtime
        self._path = None

    # ---- the training loop ------------------------------------------------------------------
    def scale(self, outputs):
        """`outputs` (a tensor, or a list / tuple of them) times S. The runtime open now learns S: its next
        backward's gradients carry it."""
        if not self._enabled:
            return outputs
        rt = self._runtime or current()
        path = self._path or (rt.updates if rt is not None else None)
        if path is None:
            raise RuntimeError("offload.GradScaler.scale: no offload runtime is open; call it inside "
                               "`with offload.init(config):` or give GradScaler(runtime=rt) (for a model without "
                               "offload, use torch.amp.GradScaler)")
        self._path = path
        path.set_loss_scale(self._scale)
        return _times(outputs, self._scale)

    def unscale_(self, optimizer) -> None:
        """Take S out of the step's factor and check every gradient on every rank for inf / NaN: call it before
        rt.clip_grad_norm_ (the norm is then the unscaled gradients')."""
        if not self._enabled:
            return
        optimizer = _offload_optimizer(optimizer, "unscale_")
        path = self._bound(optimizer.path)
        stage = self._stages.get(id(optimizer), OptimizerStage.READY)
        if stage is OptimizerStage.UNSCALED:
            raise RuntimeError("offload.GradScaler.unscale_ has already been called on this optimizer since the "
                               "last update()")
        if stage is OptimizerStage.STEPPED:
            raise RuntimeError("offload.GradScaler.unscale_ is being called after step(); call update() first")
        self._found_inf = path.unscale_grads()
        self._stages[id(optimizer)] = OptimizerStage.UNSCALED

    def step(self, optimizer, *args, **kwargs):
        """optimizer.step(*args, **kwargs) unless the gradients overflowed (unscales first if unscale_ was not
        called); returns what step returned, or None for a skipped step."""
        if not self._enabled:
            return optimizer.step(*args, **kwargs)
        if kwargs.get("closure") is not None or any(callable(a) for a in args):
            raise RuntimeError("offload.GradScaler.step: closures are not supported (as with torch's GradScaler)")
        optimizer = _offload_optimizer(optimizer, "step")
        path = self._bound(optimizer.path)
        stage = self._stages.get(id(optimizer), OptimizerStage.READY)
        if stage is OptimizerStage.STEPPED:
            raise RuntimeError("offload.GradScaler.step has already been called since the last update()")
        if stage is OptimizerStage.READY:
            self.unscale_(optimizer)
        out = None
        if self._found_inf:
            path.skip_step()  # nothing steps; updates the backward speculated are taken back
        else:
            out = optimizer.step(*args, **kwargs)
        self._stages[id(optimizer)] = OptimizerStage.STEPPED
        return out

    def _bound(self, path):
        """The update path this scaler serves: its runtime's (given, scale(), or an optimizer's first). One scaler's
        overflow check and scale are one runtime's: an optimizer over another runtime's parameters (nested
        offload.init blocks) is refused rather than stepped on gradients whose scale that runtime never learned."""
        if self._path is None:
            self._path = self._runtime.updates if self._runtime is not None else path
        if path is not self._path:
            raise RuntimeError("offload.GradScaler: this optimizer's parameters belong to another offload runtime "
                               "than the one this scaler scales (nested offload.init blocks); give each runtime its "
                               "own offload.GradScaler(runtime=rt) and scale each runtime's loss with its own")
        return path

    def update(self, new_scale: float | None = None) -> None:
        """The next S: `new_scale` if given, else S * backoff_factor after an overflow, S * growth_factor after
        growth_interval steps in a row without one (torch's rule)."""
        if not self._enabled:
            return
        if new_scale is not None:
            value = float(new_scale.item() if isinstance(new_scale, torch.Tensor) else new_scale)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"offload.GradScaler.update: new_scale must be a finite number > 0, got {value!r}")
            self._scale = _fp32(value)
        elif self._found_inf is None:
            raise RuntimeError("offload.GradScaler.update: no overflow check was recorded since the last update(); "
                               "call step(optimizer) (or unscale_) first")
        elif self._found_inf:
            self._scale = _fp32(self._scale * self._backoff_factor)
            self._growth_tracker = 0
            if self._scale < _SMALLEST_SCALE:  # (1 / S would overflow fp32: the next unscale would be inf)
                raise RuntimeError(
                    f"offload.GradScaler.update: the loss scale fell to {self._scale:.3g}, below fp32's normal "
                    "range, because step after step overflowed: the loss or its gradients are inf or NaN whatever "
                    "the scale (a diverged run, or bad input). Check the loss for inf / NaN, lower the learning "
                    "rate, or resume from a checkpoint")
        else:
            self._growth_tracker += 1
            if self._growth_tracker == self._growth_interval:
                grown = _fp32(self._scale * self._growth_factor)
                if math.isfinite(grown):  # (torch keeps S where growing it would overflow fp32)
                    self._scale = grown
                self._growth_tracker = 0
        self._stages.clear()
        self._found_inf = None

    # ---- queries and state ------------------------------------------------------------------
    def get_scale(self) -> float:
        return self._scale if self._enabled else 1.0

    def get_growth_factor(self) -> float:
        return self._growth_factor

    def get_backoff_factor(self) -> float:
        return self._backoff_factor

    def get_growth_interval(self) -> int:
        return self._growth_interval

    def is_enabled(self) -> bool:
        return self._enabled

    def state_dict(self) -> dict:
        """What a checkpoint keeps (torch's keys): pass it as rt.save_checkpoint(extra={"scaler": ...})."""
        if not self._enabled:
            return {}
        return {"scale": self._scale, "growth_factor": self._growth_factor, "backoff_factor": self._backoff_factor,
                "growth_interval": self._growth_interval, "_growth_tracker": self._growth_tracker}

    def load_state_dict(self, state: dict) -> None:
        if not self._enabled:
            return
        if not state:
            raise RuntimeError("offload.GradScaler.load_state_dict: the state dict is empty (saved by a disabled "
                               "scaler?)")
        self._scale = _fp32(float(state["scale"]))
        self._growth_factor = float(state["growth_factor"])
        self._backoff_factor = float(state["backoff_factor"])
        self._growth_interval = int(state["growth_interval"])
        self._growth_tracker = int(state["_growth_tracker"])


_SMALLEST_SCALE = 2.0 ** -126  # fp32's smallest normal number: below it 1 / S is not a finite fp32


def _offload_optimizer(optimizer, what: str):
    """The offload optimizer `optimizer` is, or wraps (Accelerate's AcceleratedOptimizer: .optimizer)."""
    given = optimizer
    while getattr(optimizer, "path", None) is None and hasattr(optimizer, "optimizer"):
        optimizer = optimizer.optimizer
    if not hasattr(getattr(optimizer, "path", None), "unscale_grads"):
        raise TypeError(f"offload.GradScaler.{what}: {type(given).__name__} is not an offload optimizer over a "
                        "runtime's parameters (offload.AdamW, AdamW8bit, Lion); use torch.amp.GradScaler for others")
    return optimizer


def _times(outputs, scale: float):
    if isinstance(outputs, torch.Tensor):
        return outputs * scale
    if isinstance(outputs, (list, tuple)):
        return type(outputs)(_times(o, scale) for o in outputs)
    raise TypeError(f"offload.GradScaler.scale: expected a tensor or a list / tuple of them, got "
                    f"{type(outputs).__name__}")
