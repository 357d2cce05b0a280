"""Integrations with other training stacks: transformers.py (Hugging Face Trainer). Imported on their own
(`from offload.integrations.transformers import OffloadTrainer`): `import offload` does not load them."""
