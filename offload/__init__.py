"""offload: heterogeneous-memory offload runtime for PyTorch training."""
__version__ = "0.1.0"
