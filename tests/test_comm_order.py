"""The collectives' rules (offload/zero/comm.py): each lane's group issues in program order from one thread,
and every collective tensor lives on the compute device. On NCCL a breach hangs two ranks for ever; here it
raises, so the CPU suite catches a lane that would hang a GPU run."""
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from offload.zero import comm


def test_tickets_must_be_issued_in_order():
    order = comm.ProgramOrder("gather")
    first, second = order.ticket(), order.ticket()
    order.issue(first, "gather of unit 0")
    order.issue(second, "gather of unit 1")
    late = order.ticket()
    order.issue(order.ticket(), "gather of unit 3")
    with pytest.raises(comm.OrderError, match="out of program order"):
        order.issue(late, "gather of unit 2")


def test_a_skipped_ticket_is_fine():
    """A piece of work that failed before its collective leaves a gap, not an error."""
    order = comm.ProgramOrder("reduce")
    order.ticket()
    order.issue(order.ticket(), "gradient of unit 1")


def test_only_the_owning_thread_issues():
    order = comm.ProgramOrder("reduce")
    order.issue(order.ticket(), "gradient of unit 0")
    errors = []

    def other():
        try:
            order.issue(order.ticket(), "gradient of unit 1")
        except comm.OrderError as e:
            errors.append(str(e))

    t = threading.Thread(target=other, name="not-the-lane")
    t.start()
    t.join()
    assert errors and "not-the-lane" in errors[0] and "lane's one thread" in errors[0]


def test_collective_tensors_must_be_on_the_groups_device():
    group = comm.Group(rank=0, world_size=2, device=torch.device("meta"))  # checked before any process group
    with pytest.raises(ValueError, match="one device for every collective"):
        comm.all_gather_into(group, torch.empty(4), torch.empty(2), "gather of unit 0")
    with pytest.raises(ValueError, match="tensors live on meta"):
        comm.reduce_scatter_mean(group, torch.empty(4), "gradient of unit 0")


def test_one_rank_needs_no_group():
    group = comm.Group()
    out = torch.empty(3)
    comm.all_gather_into(group, out, torch.arange(3.0)).wait()
    assert torch.equal(out, torch.arange(3.0))
    shard, pending = comm.reduce_scatter_mean(group, torch.ones(3))
    pending.wait()
    assert torch.equal(shard, torch.ones(3))
    assert torch.equal(comm.all_gather_host(group, torch.arange(2.0)), torch.arange(2.0))


def _run(tmp_path, broken: bool) -> list[dict]:
    out = tmp_path / "out.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(Path(__file__).resolve().parent.parent))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(Path(__file__).with_name("order_worker.py")), str(out), "1" if broken else "0"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [json.loads(Path(f"{out}.{r}").read_text()) for r in range(2)]


def test_two_ranks_gather_in_program_order_with_a_late_lane(tmp_path):
    for r in _run(tmp_path, broken=False):
        assert r["error"] is None and r["values_equal"], r


def test_a_lane_issuing_out_of_order_is_refused_on_every_rank(tmp_path):
    """Unit 1's gather issued before unit 0's by a second lane thread raises instead of hanging: the second
    thread is refused (the ticket order behind it is tested above, without threads)."""
    for r in _run(tmp_path, broken=True):
        assert r["error"] is not None and "gather group" in r["error"], r
        assert "lane's one thread" in r["error"] or "out of program order" in r["error"], r
