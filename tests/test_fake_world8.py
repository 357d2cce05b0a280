"""World size 8 without 8 devices (issue 44): Llama-3-70B's real layer shapes laid out for 8 ranks on the meta
device, and the runtime driven by torch's fake process group as each of 8 ranks in turn (tests/fake_rank_worker.py,
two processes playing four ranks each): every simulated rank must shard alike, peak alike and issue the same
collectives."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import rank_sequences

TESTS = Path(__file__).resolve().parent
WORLD = 8


def llama3_70b(layers: int = 2):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_hidden_layers=layers,
                      num_attention_heads=64, num_key_value_heads=8, tie_word_embeddings=False)
    with torch.device("meta"):
        return LlamaForCausalLM(cfg)


def test_llama3_70b_layers_shard_evenly_over_8_ranks():
    pytest.importorskip("transformers")
    import offload
    from offload.zero.units.discover import discover_units
    from offload.zero.units.layout import ALIGN, FlatLayout

    specs = discover_units(llama3_70b(), offload.Config(params="cpu", optimizer="cpu"))
    layouts = {s.name: FlatLayout(s.params, WORLD) for s in specs}
    layer = 2 * 8192 * 8192 + 2 * 8192 * 1024 + 3 * 8192 * 28672 + 2 * 8192  # q, o, k, v, the MLP, two norms
    for name in ("model.layers.0", "model.layers.1"):
        got = layouts[name]
        assert got.numel == layer == 855_654_400
        assert got.padded_numel == layer and got.shard_numel == 106_956_800  # a multiple of 8 x 256: no padding
    for name, got in layouts.items():
        assert got.padded_numel % (WORLD * ALIGN) == 0 and got.padded_numel - got.numel < WORLD * ALIGN, name
        bounds = [got.shard_bounds(r) for r in range(WORLD)]
        assert [hi - lo for lo, hi in bounds] == [got.shard_numel] * WORLD and bounds[-1][1] == got.padded_numel
    assert sum(got.numel for got in layouts.values()) == 2 * layer + 2 * 128256 * 8192 + 8192  # every parameter


def test_eight_fake_ranks_shard_peak_and_issue_alike(tmp_path):
    pytest.importorskip("transformers")
    prefix = str(tmp_path / "fake")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(TESTS.parent))
    # two processes (this machine's two cores), each playing four ranks in turn (fake_rank_worker.py)
    halves = [list(range(WORLD))[i::2] for i in range(2)]
    procs = [subprocess.Popen([sys.executable, str(TESTS / "fake_rank_worker.py"), prefix, *map(str, ranks)],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for ranks in halves]
    for ranks, p in zip(halves, procs):
        _, err = p.communicate(timeout=1200)
        assert p.returncode == 0, f"ranks {ranks}: {err[-3000:]}"
    issued = rank_sequences.assert_same_sequences(prefix, WORLD)
    assert issued > 0
    stats = [json.loads(Path(f"{prefix}.stats{r}.json").read_text()) for r in range(WORLD)]
    assert all(s == stats[0] for s in stats), stats
    assert [u[0] for u in stats[0]["units"]] == ["", "model.layers.0", "model.layers.1"], stats[0]["units"]
    for _, numel, padded, shard in stats[0]["units"]:
        assert padded == WORLD * shard and padded - numel < WORLD * 256, stats[0]["units"]
    assert 0 < stats[0]["peak_gathered"] <= stats[0]["gathered_bound"]
