"""The objects alive at wrap are out of the cyclic GC's generations while the runtime is open (offload/zero/
frozen_heap.py): a full collection every few steps walked all of them (about 300k with torch imported, 12-20 ms)."""
from __future__ import annotations

import gc

import torch

import offload
from zero_common import LinearStack


def _cfg() -> offload.Config:
    return offload.Config(params="cpu", optimizer="cpu", cpu_budget="64MiB", device_budget="64MiB")


def test_a_wrapped_model_leaves_a_full_collection_little_to_walk():
    assert gc.get_freeze_count() == 0
    tracked = len(gc.get_objects())
    with offload.init(_cfg()):
        model = LinearStack(8, 4)
        model(torch.randn(2, 8)).sum().backward()
        walked = len(gc.get_objects())  # what a full collection traverses now
        frozen = gc.get_freeze_count()
    assert walked < tracked / 10 and frozen > tracked / 2, (tracked, walked, frozen)
    assert gc.get_freeze_count() == 0  # back to the collector when the runtime closes


def test_objects_the_process_froze_itself_stay_as_they_were():
    gc.freeze()
    try:
        mine = gc.get_freeze_count()
        with offload.init(_cfg()):
            model = LinearStack(8, 4)
            model(torch.randn(2, 8)).sum().backward()
            assert gc.get_freeze_count() == mine
        assert gc.get_freeze_count() == mine
    finally:
        gc.unfreeze()
