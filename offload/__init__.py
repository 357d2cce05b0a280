"""offload: heterogeneous-memory offload runtime for PyTorch training."""
__version__ = "0.1.0"


def __getattr__(name: str):
    # Lazy: `import offload` (the CLI's --version) must not pay for importing torch.
    if name == "AdamW":
        from .optim import AdamW

        return AdamW
    raise AttributeError(f"module 'offload' has no attribute {name!r}")
