"""One rank issuing every collective through a real process group (Config.collectives_at_world_size_1, issue 44):
gloo here, started in memory by offload.init. Every lane, ticket, pass check and flag goes as at world size 8,
and the training is bit for bit the plain one-rank run's (which copies locally and issues nothing); what it
issues is what each rank of a 2-rank run issues, unit for unit. The GPU suite runs it on NCCL
(tests/test_cuda_one_rank_collectives.py)."""
import collections
import dataclasses
import json
import os
import sys
import textwrap

import pytest
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import rank_sequences  # noqa: E402
from zero_common import Case, _bitwise_mismatches, _data, make_model, offload_run, one_torch_thread  # noqa: E402

from offload.zero.collectives import comm  # noqa: E402

torch_thread = pytest.fixture(autouse=True)(one_torch_thread)

CASES = [
    Case(params="cpu", optimizer="cpu", accum=4, steps=4),  # no_sync's local accumulation, then one reduce
    Case(params="nvme", optimizer="nvme", dtype="bf16", accum=2, no_sync=False, cpu_budget="128KiB", steps=4),
    Case(params="cpu", optimizer="cpu", dtype="fp16", clip_some=True, steps=6),  # overflow flags, speculation
    Case(params="cpu", optimizer="cpu", grads="device", device_tier=True, flow="lateeval", steps=4,
         delay="gather=0.003,reduce=0.003"),  # the eval forward's pass check, slowed lanes
    Case(params="cpu", optimizer="cpu", update_in_backward=True, steps=4),
]


def _run(case: Case, tmp_path, at_one: bool):
    """(losses, snapshots, norms) and what was issued, as (group, op, dtype, what)."""
    import torch

    torch.manual_seed(1234)
    model = make_model(case.model)
    with comm.recording() as issued:
        result = offload_run(dataclasses.replace(case, collectives_at_one=at_one), model, _data(case), str(tmp_path))
    assert not dist.is_initialized()  # the group offload.init started for the switch ended at close
    return result, [(g, op, dtype, what) for (g, op, _, dtype), what in zip(issued.entries, issued.whats)]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_one_rank_through_a_gloo_group_trains_bitwise_as_without(case, tmp_path):
    plain, nothing = _run(case, tmp_path, at_one=False)
    assert nothing == []  # (without the switch one rank issues no collective)
    (losses, snaps, norms, stats), issued = _run(case, tmp_path, at_one=True)
    assert _bitwise_mismatches((losses, snaps, norms), plain[:3]) == 0
    ops = collections.Counter((g, op) for g, op, _, _ in issued)
    # every gather and reduce went over its lane's group, the step's flags and the pass checks over the main one
    assert ops[("gather", "all_gather")] >= 2 * case.steps and ops[("reduce", "reduce_scatter")] >= case.steps, ops
    assert ops[("main", "all_reduce")] >= case.steps and ops[("main", "all_gather")] >= case.steps, ops
    assert stats["communicators_device_bytes_by_group"] == {"main": 0, "gather": 0, "reduce": 0}  # (gloo: host)


def test_one_rank_issues_what_each_of_two_ranks_issues(tmp_path):
    """The same case on 2 gloo ranks (torchrun) and on one rank with the switch: the same collectives, in the same
    order, for the same units (sizes aside: a shard at 2 ranks is half the one rank's)."""
    from zero_common import run_rank_script

    case = Case(params="cpu", optimizer="cpu", accum=2, no_sync=False, flow="eval", steps=3)
    two = dataclasses.replace(case, world=2)
    code = textwrap.dedent(f"""
        import json, torch, torch.distributed as dist
        from zero_common import Case, _data, make_model, offload_run
        dist.init_process_group("gloo")
        torch.set_num_threads(1)
        case = Case(**json.loads({json.dumps(dataclasses.asdict(two))!r}))
        torch.manual_seed(1234)
        offload_run(case, make_model(case.model), _data(case), {str(tmp_path)!r})
        dist.destroy_process_group()
        """)
    run_rank_script(code, tmp_path, timeout=600)  # (asserts the two ranks issued the same)
    rank0 = rank_sequences.load(str(tmp_path / "collectives"), 2)[0]
    at_two = [(g, op, dtype, what) for (g, op, _, dtype), what in zip(rank0["entries"], rank0["whats"])
              if not op.startswith("user:")]  # (the harness sums its loss over ranks itself from 2 ranks on)
    _, at_one = _run(case, tmp_path, at_one=True)
    assert len(at_one) > 20 and at_one == at_two, _first_difference(at_one, at_two)


def _first_difference(a: list, b: list) -> str:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return f"#{i}: one rank {x}, two ranks {y}"
    return f"{len(a)} and {len(b)} collectives"
