"""Integrations with other training stacks: transformers.py (Hugging Face Trainer), lora.py (PEFT), hf_loading.py
(from_pretrained inside offload.init), hf_model_dir.py (a Hugging Face model directory in and out, unit by unit;
checkpoint_layout.py its tensors' layout), deepspeed.py (a DeepSpeed JSON's training sections). `import offload` does
not load them: each is imported when first named, `from offload.integrations.transformers import OffloadTrainer`
or `offload.integrations.lora.load_peft_model(...)` after `import offload` alone."""

_SUBMODULES = ("transformers", "lora", "hf_loading", "deepspeed")


def __getattr__(name: str):
    if name in _SUBMODULES:
        import importlib

        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module 'offload.integrations' has no attribute {name!r}")
