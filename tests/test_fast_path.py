"""The collectives' fast path (issue 44 item 5), on 2 gloo ranks (tests/fast_path_worker.py):

- a reduce's launch is apart from its drain (the wait for its sum, the copy into the gradient chunks, their
  norms): with every drain slowed by a second, a gather whose ticket follows the next reduce's is launched
  before the slowed reduce's gradient is stored. Before, the reduce lane ran each launch after the previous
  reduce's drain, and the tickets held every later gather behind it;
- a shard of several chunks is gathered in place (written into its place in the flat buffer, which the
  collective sends from): one copy of it per gather, where a send buffer made two;
- both pipelined (slowed) and synchronous runs alike bit for bit, the ranks' collective sequences equal.
The streams' priorities are CUDA-only: tests/test_cuda_collective_priority.py.
"""
import json
import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import rank_launch  # noqa: E402
import rank_sequences  # noqa: E402

from offload.zero.collectives import comm  # noqa: E402

DRAIN_DELAY_S = 1.0  # per drain of the recorded step; the next launches need milliseconds


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    tmp = tmp_path_factory.mktemp("fast_path")
    out = tmp / "out"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(Path(__file__).resolve().parent.parent))
    proc = rank_launch.launch([str(Path(__file__).with_name("fast_path_worker.py")), str(out), str(DRAIN_DELAY_S)], 2,
                              env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rank_sequences.assert_same_sequences(f"{out}.collectives")
    return [json.loads(Path(f"{out}.{r}").read_text()) for r in range(2)]


def _unit(what: str) -> str:
    """'gather of unit 3 (layers.2)' -> 'layers.2' (a span's name ends with the unit's id)."""
    return what[what.index("(") + 1:-1]


def test_a_slow_drain_does_not_hold_the_next_gathers_launch(ranks):
    for r in ranks:
        lane_ops = [(op, _unit(what)) for op, what in r["launches"] if what.startswith(("gather of", "gradient of"))]
        reduces = [i for i, (op, _) in enumerate(lane_ops) if op == "reduce_scatter"]
        first, second = reduces[0], reduces[1]
        after = [i for i, (op, _) in enumerate(lane_ops) if op == "all_gather" and i > second]
        assert after, f"rank {r['rank']}: no gather is ticketed after the second reduce: {lane_ops}"
        slowed, then, gather = lane_ops[first][1], lane_ops[second][1], lane_ops[after[0]][1]
        spans = r["spans"]
        # the slowed reduce's gradient is stored when its work ends (launch and drain, wherever each runs)
        stored = max(end for name, _, _, end in spans if name in (f"reduce:{slowed}", f"reduce drain:{slowed}"))
        then_starts = min(start for name, _, start, _ in spans if name == f"reduce:{then}")
        launched = min(end for name, lane, _, end in spans if name == f"gather:{gather}" and end >= then_starts)
        assert launched < stored, (
            f"rank {r['rank']}: the gather of {gather} (ticketed after the reduce of {then}) was launched "
            f"{(launched - stored) / 1e3:.1f} ms after the reduce of {slowed} had drained: launches wait for a "
            f"drain's host work")


def test_pipelined_with_slow_drains_equals_synchronous_bitwise(ranks):
    assert all(r["bitwise_equal"] for r in ranks), [r["bitwise_equal"] for r in ranks]


def test_a_shard_of_several_chunks_is_gathered_in_place(ranks):
    for r in ranks:
        assert max(r["chunks"].values()) > 1, r["chunks"]  # the path that used a send buffer
        for run, c in r["copies"].items():
            # one copy of this rank's shard per gather (allgather_bytes counts the full buffer: world x shard)
            assert c["gather_copy_bytes"] * r["world"] == c["allgather_bytes"] > 0, (run, c)


def test_own_place_is_this_ranks_slice_of_the_gathered_buffer():
    out = torch.arange(12.0)
    group = comm.Group(rank=1, world_size=3)
    mine = comm.own_place(group, out)
    assert torch.equal(mine, torch.arange(4.0, 8.0)) and mine.data_ptr() == out[4:].data_ptr()
    assert comm.in_place(group, out, mine)
    assert not comm.in_place(group, out, mine.clone())
    assert not comm.in_place(comm.Group(rank=0, world_size=3), out, mine)
