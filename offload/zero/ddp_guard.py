"""DistributedDataParallel over a wrapped model, refused at once with the recipe that works.

A wrapped model's parameters are placeholders (meta tensors: the values live in the runtime's shards) and the
runtime reduces the gradients over the ranks itself (ZeRO-3). DDP over such a model died inside its __init__ with
"Tensor.item() cannot be called on meta tensors" (its parameter-shape check reads them), most often from
`accelerator.prepare(model)` in a custom Accelerate loop on several processes. While a runtime is open (one handle
per open runtime, installed by Runtime.open and removed by its close, counted over runtimes)
`torch.nn.parallel.DistributedDataParallel.__init__` refuses a module holding a parameter a runtime owns (a wrapped
model's, or one built inside `offload.init` and not used yet), naming the fix: no DDP; with Accelerate, leave the
model out of `prepare` (docs/zero-runtime.md, "A custom Accelerate loop"). Any other module goes to DDP as before.
"""
from __future__ import annotations

import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel

from .units.init_record import Placeholder
from .torch_patches import _runtime_of

REFUSAL = ("offload: DistributedDataParallel over a wrapped model is refused: its parameters are placeholders (the "
           "runtime holds their shards) and the runtime already reduces the gradients over the ranks (ZeRO-3); use "
           "the model without DDP, and with Accelerate leave it out of prepare: opt, loader = "
           "accelerator.prepare(offload.AdamW(model.parameters()), loader) (docs/zero-runtime.md, 'A custom "
           "Accelerate loop')")


def _owned(module) -> bool:
    if not isinstance(module, nn.Module):
        return False
    return any(_runtime_of(p) is not None or isinstance(p, Placeholder) for p in module.parameters())


# See [Note: what is patched, and for how long] in docs/zero-runtime.md
class DDPGuard:
    """The module docstring's guard; one handle per open runtime (`remove()` at its close)."""

    _live = 0
    _original = None

    def __init__(self):
        cls = DDPGuard
        if cls._live == 0:
            cls._original = original = DistributedDataParallel.__init__

            def __init__(self, module, *args, **kwargs):
                if _owned(module):
                    raise RuntimeError(REFUSAL)
                original(self, module, *args, **kwargs)

            __init__.__wrapped__ = original
            DistributedDataParallel.__init__ = __init__
        cls._live += 1
        self._removed = False

    def remove(self) -> None:
        cls = DDPGuard
        if self._removed:
            return
        self._removed = True
        cls._live -= 1
        if cls._live == 0:
            DistributedDataParallel.__init__ = cls._original
            cls._original = None
