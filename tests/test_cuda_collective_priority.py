"""The collectives' streams at high priority (issue 44 item 5), on one GPU: the gather and reduce lanes' own streams
(device.Streams) and NCCL's internal streams of the lanes' process groups (comm.lane_process_group), where async
collectives run; the reduce drain's stream (copies to the host) at the default priority. The ordering of launches
and drains is device-generic and checked on the CPU (tests/test_fast_path.py)."""
import json
import os
import subprocess
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cuda_common import REPO, free_port  # noqa: E402

pytestmark = pytest.mark.cuda

# a world of one NCCL rank in its own process (the test process keeps no default group), then a lane's group
_NCCL_LANE_GROUP = r'''
import json, sys, torch, torch.distributed as dist
from offload.zero.collectives import comm
device = torch.device("cuda", 0)
torch.cuda.set_device(device)
dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{sys.argv[1]}", rank=0, world_size=1,
                        device_id=device)
pg = comm.lane_process_group(timeout_s=120)
t = torch.ones(4, device=device)
dist.all_reduce(t, group=pg, async_op=True).wait()  # the communicator and its stream exist and work
torch.cuda.synchronize()
options = pg._get_backend(device).options
print(json.dumps({"high_priority": bool(options.is_high_priority_stream), "sum": t.tolist()}))
dist.destroy_process_group()
'''


def test_the_lanes_nccl_groups_run_their_collectives_on_high_priority_streams():
    out = subprocess.run([sys.executable, "-c", _NCCL_LANE_GROUP, str(free_port())], capture_output=True, text=True,
                         timeout=180, env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["high_priority"] and result["sum"] == [1.0] * 4, result


def test_the_gather_and_reduce_streams_go_before_compute_and_the_drain_does_not():
    import offload
    from offload.telemetry import Lane

    cfg = offload.Config(params="cpu", optimizer="cpu", device_budget="1GiB", cpu_budget="1GiB")
    with offload.init(cfg) as rt:
        streams = rt.ctx.streams
        priority = {lane: streams.get(lane).priority for lane in (Lane.GATHER, Lane.REDUCE, Lane.REDUCE_DRAIN)}
        compute = torch.cuda.current_stream(rt.device).priority
    # lower is sooner; torch maps -1 into the device's range (which has at least two levels on every current GPU)
    assert priority[Lane.GATHER] < compute and priority[Lane.REDUCE] < compute, (priority, compute)
    assert priority[Lane.REDUCE_DRAIN] == compute, (priority, compute)
