"""offload: heterogeneous-memory offload runtime for PyTorch training."""
__version__ = "0.1.0"

# Public names resolve lazily so `import offload` (and the CLI) stays light.
_LAZY = {
    "Config": ("offload.config", "Config"),
    "init": ("offload.zero.runtime", "init"),
    "Runtime": ("offload.zero.runtime", "Runtime"),
}


def __getattr__(name):
    if name == "AdamW":
        try:
            from .optim import AdamW  # the fused-kernel optimizer (delegates runtime-owned params)
        except ImportError:
            from .zero.optimizer import ShardedAdamW as AdamW
        return AdamW
    if name in _LAZY:
        import importlib

        module, attr = _LAZY[name]
        return getattr(importlib.import_module(module), attr)
    raise AttributeError(f"module 'offload' has no attribute {name!r}")
