"""Ranks whose lanes run at different speeds (tests/skew_worker.py): 20 steps on 2 gloo ranks, params and
optimizer states on nvme, accumulation that reduces every micro-batch, rank 0's gathers and copies slowed and
rank 1's reduces and disk reads: no hang (the launch has a deadline) and bit for bit the synchronous run. The ranks
run under TORCH_DISTRIBUTED_DEBUG=DETAIL: torch wraps every group and checks before each collective that the ranks
call the same op on the same shapes, so a mispaired one raises there instead of pairing silently."""
import json
import os
from pathlib import Path

import rank_launch
import rank_sequences


def test_skewed_lanes_on_two_ranks_finish_bitwise(tmp_path):
    out = tmp_path / "out"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(Path(__file__).resolve().parent.parent),
               TORCH_DISTRIBUTED_DEBUG="DETAIL")
    proc = rank_launch.launch([str(Path(__file__).with_name("skew_worker.py")), str(out), str(tmp_path)], 2, env=env,
                              timeout=400)  # a hang fails here
    assert proc.returncode == 0, proc.stderr[-4000:]
    rank_sequences.assert_same_sequences(f"{out}.collectives")  # the skew changes when, never what
    for r in range(2):
        result = json.loads(Path(f"{out}.{r}").read_text())
        assert result["steps"] == 20 and result["mismatches"] == 0, result
        assert result["debug_level"].endswith("DETAIL"), result
