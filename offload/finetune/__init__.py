"""`offload finetune`: a Hugging Face causal-LM fine-tune with states paged through the offload runtime."""
from .config import FinetuneConfig
from .job import FinetuneResult, finetune

__all__ = ["FinetuneConfig", "FinetuneResult", "finetune"]
