"""`offload plan`'s host staging for nvme-homed states is the runtime's own floor (offload.plan.host_staging): the
chunks its lanes hold at once, not four copies of the largest unit's every state; and the plan takes the two
fallbacks the runtime takes rather than refuse a run (no gathering ahead, no speculative spare slots)."""
import json

from offload.cli import main
from offload.plan.memory import Placement, Workload, tier_bytes
from offload.plan.model_spec import ModelSpec

GiB = 1 << 30
# Llama-3-70B's embedding, LM head and two decoder layers (benchmarks/bench_scale_load.py): units of 1.05B params
L70 = dict(vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_hidden_layers=2, num_attention_heads=64,
           num_key_value_heads=8, head_dim=128, tie_word_embeddings=False, max_position_embeddings=256,
           model_type="llama")
L70_SPEC = ModelSpec("l70", vocab=128256, hidden=8192, intermediate=28672, layers=2, heads=64, kv_heads=8)
ADAMW8BIT = Workload(seq_len=16, optimizer_states="adamw8bit")


def test_staging_of_a_huge_unit_is_its_param_chunks_and_one_chunk_of_each_state():
    """The embedding (1,050,673,152 params) with a 5 GiB cpu budget: chunks of at most 64 MiB of fp32 cut it into
    63 equal ones of 16,678,912 elements (aligned to 2048); each working copy takes a slot of that many fp32 bytes.
    The gather lane holds the 63 param chunks, the optimizer lane one chunk each of master, the 4 AdamW8bit tensors,
    the gradient and the param, the reduce lane one gradient chunk: 71 slots, 4.41 GiB (it was counted as 50.6 GB)."""
    slot = 4 * 16_678_912
    staging = tier_bytes(L70_SPEC, ADAMW8BIT, 1, Placement("nvme", "nvme"), cpu_budget=5 * GiB)["cpu"]["staging"]
    assert staging == (63 + 7 + 1) * slot
    assert 4.4 * GiB < staging < 4.42 * GiB
    # gradients on the device: no gradient chunk in the step, none reduced into the cpu tier
    on_device = tier_bytes(L70_SPEC, ADAMW8BIT, 1, Placement("nvme", "nvme", "device"), cpu_budget=5 * GiB)
    assert on_device["cpu"]["staging"] == (63 + 6) * slot
    # params on the device: nothing gathered from nvme; one chunk of each state being stepped (no param chunk)
    params_on_device = tier_bytes(L70_SPEC, ADAMW8BIT, 1, Placement("device", "nvme"), cpu_budget=5 * GiB)
    assert params_on_device["cpu"]["staging"] == (5 + 1 + 1) * slot


def test_staging_follows_the_chunk_size_as_the_runtime_cuts_it():
    """A smaller cpu budget (or Config.chunk_size) cuts smaller chunks: the step's and reduce's few chunks shrink,
    the gather lane's chunks of the largest unit still add up to its params in fp32 slots."""
    small = tier_bytes(L70_SPEC, ADAMW8BIT, 1, Placement("nvme", "nvme"), cpu_budget=256 << 20)["cpu"]["staging"]
    assert small == (1002 + 7 + 1) * (4 << 20)  # 4 MiB chunks: 1,050,673,152 = 1002 x 1 Mi elements
    given = tier_bytes(L70_SPEC, Workload(seq_len=16, optimizer_states="adamw8bit", chunk_size=1 << 20), 1,
                       Placement("device", "nvme"), cpu_budget=5 * GiB)["cpu"]["staging"]
    assert given == 7 * (1 << 20)  # master, 4 AdamW8bit tensors, gradient chunk stepped, gradient chunk reduced
    # the runtime's refusal at wrap counts with the same function
    from offload.plan import host_staging
    from offload.zero import placement
    assert placement.host_working_set is host_staging.host_working_set


def _plan(tmp_path, cpu_mem: str, capsys) -> tuple[str, dict]:
    (tmp_path / "config.json").write_text(json.dumps(L70))
    assert main(["plan", "--model", str(tmp_path / "config.json"), "--gpus", "1", "--gpu", "cpu", "--gpu-mem", "12GiB",
                 "--cpu-mem", cpu_mem, "--optimizer-states", "adamw8bit", "--nvme-size", "60GiB", "--seq-len", "16",
                 "--micro-batch", "1", "--json", str(tmp_path / "p.json")]) == 0
    return capsys.readouterr().out, json.loads((tmp_path / "p.json").read_text())


def test_the_70b_slice_bench_scale_load_ran_is_planned_as_it_ran(tmp_path, capsys):
    """bench_scale_load ran this with cpu_budget 5GiB, device_budget 12GiB, params and states on nvme. The plan
    counted 50.6 GB of staging and refused every placement; now params=nvme, optimizer=nvme lacks only the 0.4 GiB
    between the 4.41 GiB the lanes hold and the 80% of 5 GiB the plan counts on in host RAM (--cpu-mem is the host's
    RAM, the runtime's budget was the whole 5 GiB), and 6 GiB of RAM fits it."""
    out, plan = _plan(tmp_path, "5GiB", capsys)
    assert "closest is params=nvme, optimizer=nvme, short on cpu by 0.4 GiB" in out, out
    out, plan = _plan(tmp_path, "6GiB", capsys)
    assert "fits: placement params=nvme, optimizer=nvme\n" in out, out
    chosen = plan["chosen"]
    # 90% of 12 GiB holds the embedding's working set (9.79 GiB, what the runtime refuses a budget below), not the
    # next unit gathered ahead too (11.74 GiB): the runtime then gathers each unit when needed, as the plan counts
    assert not chosen["gather_ahead"] and 9.78 * GiB < chosen["tiers"]["device"]["gathered"] < 9.8 * GiB
    # 60 GiB holds the states (42.7 GiB) but not their spare slots again: the runtime turns speculation off
    assert not chosen["speculative_updates"] and "spares" not in chosen["tiers"]["nvme"]
    assert "speculative_updates=False" in out


def test_the_runtimes_fallbacks_are_taken_only_where_a_budget_lacks_room(tmp_path, capsys):
    from offload.plan.sizing import as_the_runtime_runs, capacity
    from offload.plan.step_time import Machine

    mc = Machine(gpus_per_node=1)
    roomy = capacity(64 * GiB, 64 * GiB, None)
    w = as_the_runtime_runs(L70_SPEC, ADAMW8BIT, mc, roomy, Placement("nvme", "nvme"))
    assert w.gather_ahead and w.speculative_updates
    tight = capacity(12 * GiB, 64 * GiB, 60 * GiB)
    w = as_the_runtime_runs(L70_SPEC, ADAMW8BIT, mc, tight, Placement("nvme", "nvme"))
    assert not w.gather_ahead and not w.speculative_updates
