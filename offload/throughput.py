"""Training throughput as users and the peers compare it: tokens/s, model TFLOPS and MFU.

    counter = TokenCounter()
    handle = counter.watch(model, n_params)   # a forward pre-hook: counts each training forward's tokens
    tokens, flops = counter.take()            # what was counted since the last take (one step's window)
    figures(tokens, flops, wall_s, device)    # {"tokens", "tokens_per_s", "model_tflops", "mfu", "peak_tflops"}

Model FLOPs are 6 x parameters x tokens (a forward 2, a backward 4 per parameter and token), the figure the
peers publish: attention's sequence-squared term and the forward that activation checkpointing recomputes are
not counted, so MFU is the share of the device's peak spent on the model's own arithmetic.
Tokens are counted at each forward of a watched model run with gradients on (a training forward; evaluation
under torch.no_grad() is not): `input_ids` (its numel), else `inputs_embeds` (all but the last dimension), else
the first positional tensor, integer (numel) or floating (all but the last dimension). A forward with none of
those counts nothing, and the window's figures are None.
MFU is against the device's peak dense bf16 FLOP/s, known by the CUDA device's name (PEAK_BF16_TFLOPS); None on
a CPU or a GPU not in the table.
"""
from __future__ import annotations

import re
import threading

import torch

__all__ = ["PEAK_BF16_TFLOPS", "peak_tflops", "TokenCounter", "count_tokens", "figures", "model_tflops"]

# Peak dense (not sparse) bf16 tensor TFLOP/s by device name, first match wins (the specific before the general)
PEAK_BF16_TFLOPS = (
    (r"\bb200\b", 2250.0),
    (r"\bh100 pcie\b", 756.0),
    (r"\bh100 nvl\b", 835.0),
    (r"\bgh200\b|\bh(100|200|800)\b", 989.0),  # SXM
    (r"\ba(100|800)\b", 312.0),
    (r"\bl40s\b", 362.0),
    (r"\bl40\b", 181.0),
    (r"\bl4\b", 121.0),
    (r"\brtx 4090\b", 165.0),
    (r"\brtx 3090\b", 71.0),
)


def peak_tflops(device: torch.device | str | None = None, name: str | None = None) -> float | None:
    """The peak dense bf16 TFLOP/s of `device` (or of a device called `name`); None on a CPU or when unknown."""
    if name is None:
        device = torch.device(device) if device is not None else None
        if device is None or device.type != "cuda" or not torch.cuda.is_available():
            return None
        name = torch.cuda.get_device_name(device)
    low = name.lower()
    return next((tflops for pattern, tflops in PEAK_BF16_TFLOPS if re.search(pattern, low)), None)


def count_tokens(args: tuple, kwargs: dict) -> int:
    """Tokens in one forward's inputs (module docstring); 0 when none can be told."""
    ids = kwargs.get("input_ids")
    if isinstance(ids, torch.Tensor):
        return ids.numel()
    embeds = kwargs.get("inputs_embeds")
    if isinstance(embeds, torch.Tensor) and embeds.dim() >= 2:
        return embeds.numel() // embeds.shape[-1]
    first = next((a for a in args if isinstance(a, torch.Tensor)), None)
    if first is None:
        return 0
    if first.is_floating_point():
        return first.numel() // first.shape[-1] if first.dim() >= 2 else 0
    return first.numel()


class TokenCounter:
    """Tokens and model FLOPs of the training forwards of the watched models, taken window by window."""

    def __init__(self):
        self._lock = threading.Lock()
        self._tokens = 0
        self._flops = 0.0

    def watch(self, model: torch.nn.Module, n_params: int):
        """Count `model`'s training forwards as n_params-parameter ones; returns the hook's handle."""
        def count(module, args, kwargs):
            if torch.is_grad_enabled():
                n = count_tokens(args, kwargs)
                with self._lock:
                    self._tokens += n
                    self._flops += 6.0 * n_params * n
        hook = torch.compiler.disable(count, reason="offload: tokens are counted eagerly")
        return model.register_forward_pre_hook(hook, with_kwargs=True)

    def take(self) -> tuple[int, float]:
        """(tokens, model FLOPs) since the last take; the window restarts."""
        with self._lock:
            out = (self._tokens, self._flops)
            self._tokens, self._flops = 0, 0.0
        return out


def model_tflops(n_params: int, tokens: float, seconds: float) -> float:
    """6 x params x tokens / seconds, in TFLOP/s."""
    return 6.0 * n_params * tokens / seconds / 1e12


def figures(tokens: int, flops: float, wall_s: float, device=None, peak: float | None = None) -> dict:
    """A window's throughput: tokens, tokens/s, model TFLOPS, the device's peak and MFU (None where unknown:
    no tokens counted, no time passed, or the device's peak not known). `peak`: TFLOP/s, instead of the
    device's own."""
    peak = peak if peak is not None else peak_tflops(device)
    if not tokens or wall_s <= 0:
        return {"tokens": tokens or None, "tokens_per_s": None, "model_tflops": None, "peak_tflops": peak,
                "mfu": None}
    tflops = flops / wall_s / 1e12
    return {"tokens": tokens, "tokens_per_s": tokens / wall_s, "model_tflops": tflops, "peak_tflops": peak,
            "mfu": tflops / peak if peak else None}
