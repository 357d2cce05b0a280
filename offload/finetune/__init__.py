"""`offload finetune`: a Hugging Face causal-LM fine-tune with states paged through the offload runtime."""
from .job import FinetuneConfig, FinetuneResult, finetune

__all__ = ["FinetuneConfig", "FinetuneResult", "finetune"]
