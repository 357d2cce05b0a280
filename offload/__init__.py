"""offload: heterogeneous-memory offload runtime for PyTorch training."""
from .version import __version__

# Public names resolve lazily: `import offload` (the CLI's --version) must not pay for importing torch.
_LAZY = {
    "AdamW": ("offload.optim", "AdamW"),
    "AdamW8bit": ("offload.optim.adamw8bit", "AdamW8bit"),
    "Lion": ("offload.optim.lion", "Lion"),
    "Config": ("offload.config", "Config"),
    "GradScaler": ("offload.zero.grad_scaler", "GradScaler"),
    "init": ("offload.zero.runtime", "init"),
    "Runtime": ("offload.zero.runtime", "Runtime"),
    "CollectiveError": ("offload.zero.collectives.watchdog", "CollectiveError"),
    "CheckpointError": ("offload.checkpoint.files", "CheckpointError"),
    "NotOnEveryRank": ("offload.zero.collectives.agree", "NotOnEveryRank"),
    "UpdateFailed": ("offload.zero.update.optimizer_pipeline", "UpdateFailed"),
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        module, attr = _LAZY[name]
        return getattr(importlib.import_module(module), attr)
    if name == "integrations":  # `offload.integrations.lora.load_peft_model(...)` after `import offload` alone
        import importlib

        return importlib.import_module("offload.integrations")
    raise AttributeError(f"module 'offload' has no attribute {name!r}")
