"""Config.activations on a GPU (offload/zero/activations.py): the saved tensors' copies out run on the activation
lane's stream after an event of the compute stream, and back into fresh device tensors handed to the compute stream
(record_stream); the training bit for bit that without offload, with a slow lane (the forward runs ahead of the
copies out, the backward waits for the copies back), and nothing left in the store. Not yet run on a GPU: written
after this project's first GPU lease had been spent."""
from __future__ import annotations

import os
import sys

import pytest
import torch

pytest.importorskip("transformers")

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cuda_common import record_figure  # noqa: E402
from test_activation_offload import (  # noqa: E402
    BLOCK_INPUT, assert_same, check_device_peaks, measure_device_peaks, train)

from offload import inject  # noqa: E402
from offload.telemetry import Queue  # noqa: E402

pytestmark = pytest.mark.cuda


@pytest.mark.parametrize("home", ["cpu", "nvme"])
@pytest.mark.parametrize("compute_dtype", ["fp32", "bf16"])
def test_offloaded_activations_on_the_gpu_train_bitwise_as_without(tmp_path, home, compute_dtype):
    (tmp_path / "ref").mkdir()
    ref = train(tmp_path / "ref", "none", compute_dtype=compute_dtype)
    with inject.delay(Queue.ACTIVATION, 0.01):
        run = train(tmp_path, home, compute_dtype=compute_dtype)
    assert_same(run, ref)
    acts = run[2]["activations"]
    assert acts["moved_tensors"] > 0 and acts["kept_bytes"] == 0 and acts["in_store"] == 0
    record_figure("activations_gpu", home=home, compute_dtype=compute_dtype, **{k: acts[k] for k in
                  ("moved_bytes", "moved_tensors", "read_ahead_hits", "wait_s")})


def test_the_device_peak_on_the_gpu_holds_whatever_the_depth(tmp_path):
    """The CPU suite's device-peak test (max_memory_allocated against block sizes) on the GPU, where the device
    memory it bounds is what activation offload is for."""
    assert torch.cuda.is_available()
    peaks = measure_device_peaks(tmp_path)
    record_figure("activations_device_peak_gpu", block_input_bytes=BLOCK_INPUT,
                  **{f"{home}_{layers}_layers": list(v) for (home, layers), v in peaks.items()})
    check_device_peaks(peaks)
