"""offload/throughput.py and the figures rt.stats()["last_step"] carries from it: tokens counted at each training
forward of a wrapped model, model TFLOPS = 6 x params x tokens / s, MFU against a known device's peak."""
from __future__ import annotations

import pytest
import torch

import offload
from offload.plan.sizing import DEVICES
from offload.throughput import TokenCounter, count_tokens, figures, model_tflops, peak_tflops


def test_tokens_are_read_from_ids_embeddings_or_the_first_tensor():
    ids = torch.zeros(3, 7, dtype=torch.long)
    assert count_tokens((), {"input_ids": ids}) == 21
    assert count_tokens((), {"inputs_embeds": torch.zeros(3, 7, 16)}) == 21
    assert count_tokens((ids,), {}) == 21
    assert count_tokens((torch.zeros(2, 5, 8),), {}) == 10  # activations: every dimension but the features
    assert count_tokens((torch.zeros(8),), {}) == 0 and count_tokens((), {"x": 1}) == 0


def test_peak_is_known_by_device_name_and_agrees_with_the_plan():
    assert peak_tflops(name="NVIDIA H200") == 989.0
    assert peak_tflops(name="NVIDIA H100 80GB HBM3") == 989.0
    assert peak_tflops(name="NVIDIA H100 PCIe") == 756.0
    assert peak_tflops(name="NVIDIA A100-SXM4-80GB") == 312.0
    assert peak_tflops(name="NVIDIA L40S") == 362.0 and peak_tflops(name="NVIDIA L4") == 121.0
    assert peak_tflops(name="NVIDIA GeForce RTX 4090") == 165.0
    assert peak_tflops(name="Some Future Accelerator") is None
    assert peak_tflops("cpu") is None
    for key, name in (("h100", "NVIDIA H100 80GB HBM3"), ("h200", "NVIDIA H200"), ("a100", "NVIDIA A100-PCIE-40GB"),
                      ("l40s", "NVIDIA L40S")):  # `offload plan --gpu` uses the same peaks
        assert peak_tflops(name=name) * 1e12 == DEVICES[key]["device_flops"]


def test_figures_of_a_window():
    f = figures(4096, 6.0 * 1e9 * 4096, 2.0, peak=989.0)
    assert f["tokens_per_s"] == 2048 and f["model_tflops"] == pytest.approx(model_tflops(int(1e9), 4096, 2.0))
    assert f["mfu"] == pytest.approx(f["model_tflops"] / 989.0)
    assert figures(4096, 1.0, 2.0, "cpu")["mfu"] is None  # no known peak on a CPU
    assert figures(0, 0.0, 2.0)["tokens_per_s"] is None  # nothing counted: no figure, not zero


def test_counter_counts_training_forwards_only():
    model = torch.nn.Linear(4, 4)
    counter = TokenCounter()
    handle = counter.watch(model, n_params=20)
    model(torch.zeros(2, 3, 4))
    with torch.no_grad():
        model(torch.zeros(5, 4))  # evaluation: not a training token
    assert counter.take() == (6, 6.0 * 20 * 6)
    assert counter.take() == (0, 0.0)  # each take starts a new window
    handle.remove()
    model(torch.zeros(2, 3, 4))
    assert counter.take() == (0, 0.0)


def test_runtime_last_step_carries_throughput_and_peaks(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2)
    with offload.init(offload.Config(params="cpu", optimizer="cpu", cpu_budget="128MiB",
                                     device_budget="64MiB")) as rt:
        model = LlamaForCausalLM(cfg)
        opt = offload.AdamW(model.parameters(), lr=1e-3)
        n_params = sum(p.numel() for p in model.parameters())
        for _ in range(2):
            for _ in range(2):  # two micro-batches of 3 x 5 tokens, accumulated
                ids = torch.randint(0, 128, (3, 5))
                with rt.accumulating():
                    model(input_ids=ids, labels=ids).loss.backward()
            with torch.no_grad():
                model(input_ids=ids)  # an evaluation forward inside the window: not counted
            opt.step()
            opt.zero_grad()
            last = rt.stats()["last_step"]
            t = last["throughput"]
            assert t["tokens"] == 30
            assert t["tokens_per_s"] == pytest.approx(30 / last["wall_s"], rel=1e-3)
            assert t["model_tflops"] == pytest.approx(6 * n_params * t["tokens_per_s"] / 1e12, rel=1e-3)
            assert t["mfu"] is None and t["peak_tflops"] is None  # on a CPU
            assert last["peak_rss_bytes"] >= rt.stats()["memory"]["rss_at_open_bytes"] > 0
        assert "tok/s" in rt.step_stats.line() and "peak RSS" in rt.step_stats.line()
