"""Markers: `cuda` tests need a CUDA GPU, `multi_gpu` tests two or more; without them they skip, saying why.
`pytest -m cuda` (what benchmarks/gpu_check.sh runs) selects the GPU suite."""
from __future__ import annotations

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    no_gpu = pytest.mark.skip(reason="needs a CUDA GPU (none here); run on a GPU machine: bash benchmarks/gpu_check.sh")
    one_gpu = pytest.mark.skip(reason=f"needs 2+ CUDA GPUs ({count} here)")
    for item in items:
        if "cuda" in item.keywords and count == 0:
            item.add_marker(no_gpu)
        elif "multi_gpu" in item.keywords and count < 2:
            item.add_marker(one_gpu)
