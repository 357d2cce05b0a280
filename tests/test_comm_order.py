"""The collectives' rules (offload/zero/collectives/comm.py): the lanes' collectives are issued in one program order (each
lane's own, and across the two lanes), only from a lane's work, and every collective tensor lives on the
compute device. On NCCL a breach hangs two ranks for ever; here it
raises, so the CPU suite catches a lane that would hang a GPU run."""
import json
import os
import threading
from pathlib import Path

import pytest
import torch

import rank_launch
from offload.zero.collectives import comm


def _issue(order, ticket, lane, what="a collective", enqueue=lambda: None):
    with comm.lane_work(lane), order.turn(ticket, lane, what):
        enqueue()  # the call that enqueues the collective


def test_a_lane_issues_its_own_tickets_in_order():
    order = comm.ProgramOrder()
    first, second = order.ticket("gather"), order.ticket("gather")
    _issue(order, first, "gather")
    late, later = order.ticket("gather"), order.ticket("gather")
    with pytest.raises(comm.OrderError, match="#3 was issued before its #1, out of program order"):
        _issue(order, later, "gather", "gather of unit 3")
    _issue(order, second, "gather")


def test_a_skipped_ticket_is_fine():
    """A piece of work that failed before its collective gives its ticket back: nothing waits for it."""
    order = comm.ProgramOrder(wait_s=5)
    failed = order.ticket("reduce")
    mine = order.ticket("gather")
    order.skip(failed)
    _issue(order, mine, "gather")


def test_a_lane_waits_for_the_other_lanes_earlier_collective():
    """NCCL needs one order across the two lanes' communicators: reduce #1 is issued only after gather #0."""
    order = comm.ProgramOrder(wait_s=60)
    gather, reduce = order.ticket("gather"), order.ticket("reduce")
    issued = []

    def reduce_lane():
        _issue(order, reduce, "reduce")
        issued.append("reduce")

    t = threading.Thread(target=reduce_lane)
    t.start()
    t.join(0.2)
    assert t.is_alive() and issued == []  # held back however fast this machine is: gather #0 is not issued yet
    _issue(order, gather, "gather")
    issued.append("gather")
    t.join(30)
    assert not t.is_alive() and issued == ["gather", "reduce"]


def test_a_later_collective_waits_until_the_earlier_one_is_enqueued_not_only_checked():
    """The earlier ticket is held while its collective is being enqueued (a slow enqueue here: 0.3 s), so the other
    lane's later one cannot overtake it between the check and the enqueue (NCCL would see both orders)."""
    order = comm.ProgramOrder(wait_s=60)
    gather, reduce = order.ticket("gather"), order.ticket("reduce")
    enqueued = []
    lanes = [threading.Thread(target=_issue, args=(order, gather, "gather", "gather", lambda: (
                 threading.Event().wait(0.3), enqueued.append("gather")))),
             threading.Thread(target=_issue, args=(order, reduce, "reduce", "reduce", lambda: enqueued.append("reduce")))]
    for t in lanes:
        t.start()
    for t in lanes:
        t.join(30)
    assert enqueued == ["gather", "reduce"]


def test_the_training_threads_own_collectives_wait_for_the_lanes_earlier_ones():
    """The main group's collectives (a flag or norm all-reduced by the training thread) are inline: each takes
    its ticket when issued and goes after every lane collective asked for before it, on every rank alike."""
    order = comm.ProgramOrder(wait_s=60)
    reduce = order.ticket("reduce")  # a gradient's reduce, asked for by the backward, not enqueued yet
    enqueued = []

    def training_thread():
        with order.turn(None, "main", "which parameters got gradients", inline=True):
            enqueued.append("main")

    t = threading.Thread(target=training_thread)
    t.start()
    t.join(0.2)
    assert t.is_alive() and enqueued == []  # held back however fast this machine is
    _issue(order, reduce, "reduce", enqueue=lambda: enqueued.append("reduce"))
    t.join(30)
    assert not t.is_alive() and enqueued == ["reduce", "main"]
    with order.turn(None, "main", "a second one, nothing before it", inline=True):
        pass


def test_a_wait_that_never_ends_raises_naming_the_lane():
    order = comm.ProgramOrder(wait_s=0.2)
    order.ticket("gather")  # asked for, never issued nor skipped
    with pytest.raises(comm.OrderError, match="for the gather lane's collective #0"):
        _issue(order, order.ticket("reduce"), "reduce")


def test_only_the_lanes_work_issues():
    order = comm.ProgramOrder()
    with pytest.raises(comm.OrderError, match="outside the reduce lane's work"):
        with order.turn(order.ticket("reduce"), "reduce", "gradient of unit 1"):
            pass
    with pytest.raises(comm.OrderError, match="has no ticket of its own"):
        _issue(order, None, "reduce")


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
    proc = rank_launch.launch([str(Path(__file__).with_name("order_worker.py")), str(out), "1" if broken else "0"], 2,
                              env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [json.loads(Path(f"{out}.{r}").read_text()) for r in range(2)]


def test_two_ranks_gather_in_program_order_with_a_late_lane(tmp_path):
    for r in _run(tmp_path, broken=False):
        assert r["error"] is None and r["values_equal"], r


def test_a_lane_issuing_out_of_order_is_refused_on_every_rank(tmp_path):
    """Unit 1's gather issued before unit 0's by a second lane thread raises instead of hanging."""
    for r in _run(tmp_path, broken=True):
        assert r["error"] is not None and "gather group's collective" in r["error"], r
        assert "out of program order" in r["error"], r


_RANK_DEPENDENT = r'''
import torch, torch.nn as nn, torch.nn.functional as F, torch.distributed as dist
import offload

class Expert(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(16, 32), nn.Linear(32, 16)
    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))

class Net(nn.Module):  # two experts of one size: a unit each
    def __init__(self):
        super().__init__()
        self.inp, self.head = nn.Linear(8, 16), nn.Linear(16, 8)
        self.experts = nn.ModuleList([Expert(), Expert()])
    def forward(self, x, route):
        h = self.inp(x)
        for e in route:
            h = h + self.experts[e](h)
        return self.head(h)

dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = Net()
cfg = offload.Config(params="cpu", optimizer="cpu", device_budget="64MiB", cpu_budget="64MiB")
with offload.init(cfg) as rt:
    rt.wrap(model)
    assert sorted(u.name for u in rt.units) == ["", "experts.0", "experts.1"], [u.name for u in rt.units]
    opt = offload.AdamW(model.parameters(), lr=1e-2)
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    before = {k: v.clone() for k, v in rt.full_state_dict(model).items()}
    import re
    from offload.zero.collectives.divergence import RanksDiverged
    for routes, says in ((((0,), (1,)), r"\(unit \d \(experts.0\) gathered 2 times on rank 0 and 0 times on rank 1 "
                                        r"and reduced 1 times on rank 0 and 0 times on rank 1"),
                         (((0, 1), (1, 0)), r"\(the same units as often, in another order\)")):
        try:  # expert 0 on one rank met expert 1 on the other: named at the end of the backward that did it
            F.mse_loss(model(x, routes[rank]), y).backward()
            raise SystemExit("a backward with rank-dependent units passed")
        except RanksDiverged as e:
            assert re.search("by the end of this backward " + says, str(e)), str(e)
        try:  # the error caught, the step is refused as well
            opt.step()
            raise SystemExit("a step with rank-dependent units was taken")
        except RuntimeError as e:
            assert "nothing was updated" in str(e), str(e)
        opt.zero_grad()
    F.mse_loss(model(x, (0, 1)), y).backward()  # routed apart in an eval forward: named at its end
    try:
        with torch.no_grad():
            model(x, ((0,), (1,))[rank])
        raise SystemExit("an eval forward with rank-dependent units passed")
    except RanksDiverged as e:
        assert re.search(r"by the end of this eval forward \(unit \d \(experts.0\) gathered 3 times on rank 0 and 2 "
                         r"times on rank 1; unit \d \(experts.1\) gathered 2 times on rank 0 and 3 times on rank 1\)",
                         str(e)), str(e)
    opt.zero_grad()  # the step is left: the next starts level
    after = rt.full_state_dict(model)
    assert all(torch.equal(after[k], before[k]) for k in before)  # nothing was stepped on the wrong numbers
    F.mse_loss(model(x, (0, 1)), y).backward()  # the same units on every rank: steps
    opt.step()
    with torch.no_grad():
        model(x, (1, 0))  # an eval forward alike on every rank: no error
print(f"ok {rank}")  # one write: two ranks print to one pipe, and separate pieces interleave
'''


def test_ranks_that_run_different_units_are_refused_before_any_update(tmp_path):
    """Rank-dependent routing (an expert skipped where it got no tokens) or a forward on one rank only: each
    gather and reduce is a collective, so rank 0's gather of expert 0 paired with rank 1's of expert 1 (the same
    size) and each computed on halves of both, without an error: weights 22% off after 3 steps where DDP was exact.
    The ranks compare what they asked of the lanes at the end of every backward and eval forward (counts per unit,
    and their order) and raise there, naming the units and the ranks; the optimizer step compares them again and
    refuses the step (nothing is updated)."""
    from zero_common import run_rank_script

    out = run_rank_script(_RANK_DEPENDENT, tmp_path, timeout=300)
    assert "ok 0" in out.stdout and "ok 1" in out.stdout, out.stdout + out.stderr[-3000:]
