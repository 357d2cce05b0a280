"""A rank that stalls or dies: the other stops within collective_timeout, saying where everyone was."""
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

import offload
from offload.config import parse_duration

WORKER = Path(__file__).resolve().parent / "watchdog_worker.py"


def _run(tmp_path, mode):
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           str(WORKER), str(tmp_path), mode], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    return proc, time.monotonic() - t0


def _stamp(out: str, pattern: str) -> float:
    m = re.search(pattern + r" at ([0-9.]+)", out)
    assert m, out
    return float(m.group(1))


def test_a_stalled_rank_stops_the_other_with_where_each_was(tmp_path):
    proc, wall = _run(tmp_path, "stall")
    assert proc.returncode != 0
    out = proc.stdout
    # rank 0 gives up 10 s (the timeout) after rank 1 stalls, plus 2.5 s to see whether rank 1 is alive
    waited = _stamp(out, "rank 0 error") - _stamp(out, "rank 1 stalls")
    assert 10.0 <= waited < 60.0, out  # the upper bound only guards against a hang on a busy machine
    assert wall < 120.0  # not the 120 s the stalled rank sleeps, nor torch's 30-minute default
    msg = next(line for line in out.splitlines() if line.startswith("rank 0 error"))
    assert re.search(r"rank 0 gave up after [0-9.]+ s in all_gather #\d+ on the gather group \(gather of unit \d+ "
                     r"\(.+\)\); collective_timeout is 10 s", msg), msg
    assert re.search(r"Rank 1 is behind \(it has entered \d+ of the gather group's collectives, this rank \d+\) "
                     r"alive, in no collective; its last collective was", msg), msg


def test_a_dead_rank_stops_the_other(tmp_path):
    proc, wall = _run(tmp_path, "die")
    assert proc.returncode != 0
    assert "rank 1 dies" in proc.stdout
    assert re.search(r"exitcode\s*: 17", proc.stderr)  # the launcher names the rank that died, and stops the rest
    assert wall < 120.0


def test_a_dead_rank_without_a_launcher_to_stop_the_rest_is_named_by_the_survivor(tmp_path):
    """Ranks started one by one (a scheduler's srun, a hand-made launch: nobody stops the others when one dies):
    rank 1 exits at step 2; rank 0 stops within the timeout, naming the collective it was in and rank 1 as
    silent (dead or frozen)."""
    import rank_launch

    store, joins = rank_launch.hosted_store()  # no free-port race; nothing here stops a rank (no launcher)
    procs = []
    for rank in (0, 1):
        env = dict(os.environ, OMP_NUM_THREADS="1", RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2",
                   LOCAL_WORLD_SIZE="2", **joins)
        procs.append(subprocess.Popen([sys.executable, str(WORKER), str(tmp_path), "die"], env=env, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    t0 = time.monotonic()
    out0, err0 = procs[0].communicate(timeout=300)
    out1, _ = procs[1].communicate(timeout=60)
    assert procs[1].returncode == 17 and "rank 1 dies" in out1
    assert procs[0].returncode != 0 and time.monotonic() - t0 < 120.0, (out0, err0[-2000:])
    msg = next(line for line in out0.splitlines() if line.startswith("rank 0 error"))
    assert re.search(r"rank 0 gave up after [0-9.]+ s in \w+ #\d+ on the \w+ group", msg), msg
    assert re.search(r"Rank 1 is (behind .*)?silent for [0-9.]+ s \(dead or frozen\)", msg), msg


def test_a_rank_has_reported_before_its_first_collective(tmp_path):
    """The first heartbeat is published when the watchdog starts, not a second later: a rank that dies within
    its first second of training (a fast step) is then read by the survivor as silent, not as never started
    (a CI run saw that message when rank 1 reached step 2 before its first beat)."""
    import torch.distributed as dist

    from offload.zero.collectives.watchdog import _KEY, Watchdog

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    try:
        watchdog = Watchdog(rank=0, world_size=2, timeout_s=3.0)  # a world of 2: the heartbeat runs
        try:
            store = dist.distributed_c10d._get_default_store()
            assert store.check([_KEY.format(0)])  # no sleep: published by the constructor itself
        finally:
            watchdog.close()
    finally:
        dist.destroy_process_group()


def test_collective_timeout_setting():
    assert parse_duration("250ms", "x") == 0.25 and parse_duration("10min", "x") == 600.0
    assert parse_duration(30, "x") == 30.0 and parse_duration("1.5h", "x") == 5400.0
    with pytest.raises(ValueError, match=r"offload.Config.collective_timeout: 'soon' is not a duration; give e.g."):
        offload.Config(collective_timeout="soon")
    with pytest.raises(ValueError, match="must be positive"):
        offload.Config(collective_timeout=0)


def test_a_collective_incomplete_past_overdue_is_named_by_the_heartbeat_without_a_host_wait(tmp_path):
    """NCCL's host never blocks in a collective, so no waiting thread times out: the heartbeat sees the issued,
    incomplete collective after overdue_s (on NCCL 90% of the timeout, before NCCL's watchdog aborts), prints
    where each rank is and refuses the next collective. Here over gloo, the collective issued and not waited."""
    worker = Path(__file__).resolve().parent / "watchdog_overdue_worker.py"
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           str(worker)], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    line = next(x for x in out.splitlines() if x.startswith("rank 0 broken"))
    assert re.search(r"rank 0 has waited [0-9.]+ s in all_reduce #1 on the gather group \(gather of unit 3 "
                     r"\(layers\.3\)\); collective_timeout is 60 s\. Rank 1 is behind \(it has entered 0 of the "
                     r"gather group's collectives, this rank 1\) alive, in no collective", line), line
    waited = _stamp(out, "rank 0 broken") - _stamp(out, "rank 1 stalls")
    assert waited >= 2.0, out  # not before overdue_s
    assert "rank 0 next collective: refused" in out, out
    assert "incomplete, seen by the heartbeat" in proc.stderr, proc.stderr  # printed: NCCL may abort before a raise
