"""Host memory with params and optimizer on nvme: a model whose states are ~5x the cpu budget trains with
peak RSS under the cpu budget plus a stated overhead.

Stated overhead (CPU machine, where the device tier is host memory):
  gathered_bound (the device-tier region: root + two blocks)           ~6.3 MiB here
  + the device tier's peak bytes in use (the gradient shards: with the    ~24 MiB here
    optimizer states on nvme and a device budget given, they stay there)
  + 6 x largest shard (one unit's master, exp_avg, exp_avg_sq, grad     ~18 MiB here
    and the zero-init of the moments, staged while the optimizer steps it)
  + 16 MiB (activations, autograd graph, allocator slack)
Measured on the 2-core dev box: peak RSS - baseline = 76 MiB for a 20 MiB cpu budget and 97 MiB of states
(limit 20 + 6.3 + 24.4 + 18 + 16 = 85 MiB). The baseline is taken after a warm-up that loads torch's lazily
imported machinery (~90 MiB any torch program pays), in a fresh subprocess; the peak is VmHWM reset at the
baseline.

That bound holds with OFFLOAD_MALLOC_TUNE=frugal (freed buffers go back to the OS: the default on GPU). On a
CPU-only run the default is "pool" (offload/store/host_pool.py): it keeps freed blocks for reuse but maps at most
its headroom (128 MiB) beyond its peak in use, so the bound is the same plus the headroom. With "fast" glibc keeps
freed blocks below 32 MiB in heaps that fragment (58-75 MiB here, from materialization and the step's
transients), which no formula of ours bounds; there the assertion is a regression guard, 3 x the overhead
(measured 127 MiB against 20 + 3 x 65 = 214 MiB).
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import rank_launch
from offload.store import host_pool
from offload.store.sizes import parse_size

MiB = 2**20


@pytest.mark.parametrize("malloc", ["pool", "frugal", "fast"])
def test_nvme_states_4x_cpu_budget_train_within_budget_plus_overhead(tmp_path, malloc):
    cpu_budget = 20 * MiB
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(Path(__file__).resolve().parent.parent),
               OFFLOAD_MALLOC_TUNE=malloc, OFFLOAD_HOST_POOL_HEADROOM=host_pool.DEFAULT_HEADROOM)
    probe = Path(__file__).with_name("zero_rss_probe.py")
    proc = subprocess.run([sys.executable, str(probe), str(tmp_path), "256", "8", f"{cpu_budget}B", "64MiB"],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    assert r["states"] >= 4 * cpu_budget, r  # the states do not fit the cpu budget 4 times over
    assert r["nvme_read"] > 2 * r["states"] // 4, r  # they really were paged from disk
    assert r["losses"][-1] < r["losses"][0], r  # and it trained
    assert r["grads_tier"] == "device", r  # "auto" with a given device budget: no gradient round trip via disk
    overhead = r["gathered_bound"] + r["device_tier_peak"] + 6 * r["largest_shard"] + 16 * MiB
    if malloc == "pool":
        overhead += parse_size(host_pool.DEFAULT_HEADROOM)  # what the pool may keep mapped beyond its peak
    if malloc == "fast":
        overhead *= 3  # glibc's free lists on top (see the module docstring): a guard, not a derived bound
    grown = r["peak"] - r["rss0"]
    assert grown <= cpu_budget + overhead, (grown / MiB, (cpu_budget + overhead) / MiB, r)
    assert list(tmp_path.iterdir()) == []  # swap files removed


SLACK = {"pool": 256 * MiB,  # issue 21's rule: budgets + 256 MiB (activations, autograd, the pool's headroom)
         "frugal": 256 * MiB,
         "fast": 512 * MiB}  # glibc's heaps keep and fragment freed 128 KiB-4 MiB blocks: a guard, not the rule


@pytest.mark.parametrize("malloc", ["pool", "frugal", "fast"])
def test_a_transformers_llama_at_5x_the_cpu_budget_stays_within_the_budgets_every_step(tmp_path, malloc):
    """A transformers Llama (19.4M params, 333 MiB of states on nvme, 5x the cpu budget): after every step, the peak
    resident set since the warm-up is within the cpu budget + the device budget (host memory here) + the slack,
    and with pool and frugal, 7 steps, flat from the third on apart from one step's rise (nothing accumulates; a
    leak of one layer's fp32 gradient a step, 6.3 MiB, rises 19 over the other three, measured). Flat it is not,
    by chance: the peak is a high-water mark of transients the lanes overlap in ways that vary with timing, and it
    reaches its plateau at the second to fifth step (one rise of up to 12 MiB), or once rose 8 above it. Measured
    fp32 (AVX2 cap), under load: pool 256-268, 292-308, then 305-316 MiB, against 368 (5 steps flat from the
    third, bound 16: 12.2 once; 7 steps from the fourth: 13.6 once); the other rises 0.2-2.8 in all; frugal 190,
    249, 250-257; fast (5 steps, not flat: it creeps) 265-290, up to 461."""
    cpu_budget, device_budget = 64 * MiB, 48 * MiB  # 48: a step of the embedding in fp32 (wrap refuses less)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(Path(__file__).resolve().parent.parent),
               OFFLOAD_MALLOC_TUNE=malloc, OFFLOAD_HOST_POOL_HEADROOM=host_pool.DEFAULT_HEADROOM)
    probe = Path(__file__).with_name("llama_rss_probe.py")
    steps = 5 if malloc == "fast" else 7
    proc = subprocess.run([sys.executable, str(probe), str(tmp_path), f"{cpu_budget}B", f"{device_budget}B",
                           str(steps)], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    assert r["params"] * 16 >= 4 * cpu_budget and r["nvme_read"] > r["params"] * 4, r  # it pages, every step
    grown = [(s["peak"] - r["rss0"]) / MiB for s in r["steps"]]
    limit = (cpu_budget + device_budget + SLACK[malloc]) / MiB
    assert all(g <= limit for g in grown), (malloc, grown, limit)
    if malloc != "fast":
        rises = [b - a for a, b in zip(grown[2:], grown[3:])]
        assert sum(rises) - max(rises) <= 12, grown  # flat but for one rise (a late plateau); a leak rises each step
    assert list(tmp_path.iterdir()) == []  # swap files removed


def test_the_llama_on_two_ranks_stays_within_each_ranks_budgets_every_step(tmp_path):
    """The same Llama on 2 ranks (each rank's shards half the states, still 2.6x its cpu budget),
    8 steps in the dtype the CPU computes fast ("auto": bf16 with bf16 instructions, else fp32, where emulated bf16
    took 80 of this test's seconds), the CPU default (the host pool): each rank's peak resident set after every
    step within its own budgets + 256 MiB, and flat from the fourth step. Flat from the second it is not, by
    chance: the peak is a high-water mark of transients that two ranks' lanes overlap in ways that vary with their
    timing, and it reaches its plateau at the second to sixth step. Measured, 6 steps: bf16 (AVX512_BF16) 314-329
    MiB at the end, at most 6.4 MiB higher over the last steps of 8 and once 16.5 between steps 2 and 4; fp32
    (AVX2 cap) 362-364 MiB at the end of each of 4 rank-runs, once 14.5 MiB higher at step 6 than at step 5. A
    leak of one layer's fp32 gradient a step (7 MiB) grows 28 MiB over the last four steps."""
    # 72 MiB: a step of the embedding on 2 ranks in fp32 needs 64.5 (wrap refuses less; bf16 half of it)
    cpu_budget, device_budget = 64 * MiB, 72 * MiB
    swap, out = tmp_path / "swap", tmp_path / "out"
    swap.mkdir()
    out.mkdir()
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(Path(__file__).resolve().parent.parent),
               OFFLOAD_MALLOC_TUNE="pool", OFFLOAD_HOST_POOL_HEADROOM=host_pool.DEFAULT_HEADROOM,
               RSS_PROBE_OUT=str(out))  # a file per rank: two ranks' lines on one stdout once ran together
    probe = Path(__file__).with_name("llama_rss_probe.py")
    proc = rank_launch.launch([str(probe), str(swap), f"{cpu_budget}B", f"{device_budget}B", "8"], 2, env=env,
                              timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    limit = (cpu_budget + device_budget + SLACK["pool"]) / MiB
    for r in ranks:
        assert r["params"] * 16 // 2 >= 2 * cpu_budget and r["nvme_read"] > r["params"] * 2, r  # it pages
        grown = [(s["peak"] - r["rss0"]) / MiB for s in r["steps"]]
        assert all(g <= limit for g in grown), (grown, limit)
        assert grown[-1] - grown[3] <= 20, grown  # flat once the overlaps have been seen: nothing accumulates
        assert r["memory"]["malloc_mode"] == "pool", r["memory"]
    assert list(swap.iterdir()) == []


def test_the_first_step_of_a_model_whose_embedding_and_head_dominate_stays_within_its_working_set(tmp_path):
    """Issue 42's first step at a small shape of the same structure: a Llama whose 32000 x 256 embedding and LM head
    (15.6 MiB each in bf16) dwarf its two layers, params and AdamW8bit states on nvme. On a CPU the device is host
    memory: the step's peak there (the host pool's window: the gathered units, autograd's gradients, the reduce's
    copies) stays within the largest unit's working set as offload.plan.memory.unit_working_set_bytes estimates it
    (what the runtime refuses a device budget below), and within 4 units + the logits: the gathered unit, its
    gradient and the fp32 copy of its piece the reduce takes the norm from (two units' worth). Measured: 51 MiB
    against 78 (working set) and 66.5; before piece_norms copied the spanning parameter once, 83 MiB (its parts
    cloned, then concatenated: the LM head's fp32 gradient twice)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(Path(__file__).resolve().parent.parent),
               OFFLOAD_MALLOC_TUNE="pool", OFFLOAD_HOST_POOL_HEADROOM=host_pool.DEFAULT_HEADROOM)
    probe = Path(__file__).with_name("first_step_probe.py")
    proc = subprocess.run([sys.executable, str(probe), str(tmp_path), "64MiB", "88MiB", "32000", "256"],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    assert r["unit_bytes"] == 32000 * 256 * 2, r  # the embedding (or the head) is the largest unit
    assert r["step_device_peak"] <= r["working_set"], (r["step_device_peak"] / MiB, r["working_set"] / MiB)
    limit = 4 * r["unit_bytes"] + 2 * r["logits_bytes"]
    assert r["step_device_peak"] <= limit, (r["step_device_peak"] / MiB, limit / MiB)
    assert list(tmp_path.iterdir()) == []


def test_a_unit_that_is_one_parameter_gets_its_gradient_without_a_full_size_copy():
    """An embedding as a unit of its own: its backward allocates one full-size gradient (the embedding's own), not a
    second one for the flat gradient (a split's backward concatenates its pieces into a new buffer)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    import offload

    class FullSize(TorchDispatchMode):
        def __init__(self, numel):
            super().__init__()
            self.numel, self.ops = numel, []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            ins = {a.untyped_storage().data_ptr() for a in torch.utils._pytree.tree_leaves((args, kwargs))
                   if isinstance(a, torch.Tensor)}
            for t in out if isinstance(out, (tuple, list)) else [out]:
                fresh = isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in ins
                if fresh and t.numel() >= self.numel:
                    self.ops.append(str(func))
            return out

    torch.manual_seed(0)
    vocab, dim = 4096, 64  # 262144 elements: a multiple of the layout's alignment, no padding
    model = torch.nn.Sequential(torch.nn.Embedding(vocab, dim), torch.nn.Linear(dim, 8))
    with offload.init(offload.Config(params="cpu", optimizer="cpu", unit_min_bytes="256KiB")) as rt:
        rt.wrap(model)
        opt = offload.AdamW(model.parameters(), lr=1e-3)
        ids = torch.randint(0, vocab, (4, 8))
        loss = model(ids).sum()
        with FullSize(vocab * dim) as seen:
            loss.backward()
        opt.step()
    assert seen.ops == ["aten.embedding_dense_backward.default"], seen.ops
