"""Two-rank worker for tests/test_comm_order.py, launched by torchrun:

    python -m torch.distributed.run --standalone --nproc_per_node 2 tests/order_worker.py OUT.json BROKEN

Gathers two units ahead (unit 1 asked for after unit 0) while unit 0's lane work starts late. With the
runtime's lane (one thread, program order) both gathers complete in order and the values are right. With
BROKEN=1 the gather lane gets a second thread, so unit 1's all-gather is issued before unit 0's: the
program-order check must refuse unit 0's collective (on NCCL the two ranks could hang) and say so.
"""
import concurrent.futures as cf
import json
import os
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402

import offload  # noqa: E402
import rank_sequences  # noqa: E402
from offload.zero.collectives.comm import OrderError  # noqa: E402


def main() -> int:
    out_path, broken = sys.argv[1], sys.argv[2] == "1"
    rank_sequences.record(out_path + ".collectives")
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    result = {"rank": rank}
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(8, 8)) for _ in range(3)])
    expected = [torch.cat([p.detach().reshape(-1) for p in m.parameters()]) for m in model]
    try:
        run(model, expected, broken, result)
    except OrderError as e:  # the lane's failure, raised again when the block closes (as every lane failure is)
        result["error"] = result.get("error") or str(e)
    with open(f"{out_path}.{rank}", "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()
    return 0


def run(model, expected, broken: bool, result: dict) -> None:
    with offload.init(offload.Config(params="cpu", optimizer="cpu", unit_classes=(nn.Linear,),
                                     device_budget="64MiB", cpu_budget="64MiB")) as rt:
        rt.wrap(model)
        u0, u1 = rt.units[0], rt.units[1]
        lane = rt.ctx.lanes.gather
        if broken:  # the bug the check is for: two threads issuing one group's collectives
            lane._pool = cf.ThreadPoolExecutor(2, thread_name_prefix="offload-gather-broken")
        late, second = u0._gather_now, u1._gather_now
        second_done = threading.Event()

        def slow_gather(*args):  # unit 0's work starts late: a second thread would issue unit 1's collective first
            if broken:
                second_done.wait(60)  # (after unit 1's work ended, however the threads are scheduled)
            else:
                time.sleep(0.3)  # one lane thread: unit 1's work waits behind this one
            return late(*args)

        def marked_gather(*args):
            try:
                return second(*args)
            finally:
                second_done.set()

        u0._gather_now, u1._gather_now = slow_gather, marked_gather
        u0.unshard(async_op=True)
        u1.unshard(async_op=True)
        try:
            u1.wait_for_unshard()
            u0.wait_for_unshard()
            got = [u.flat.detach()[:u.layout.numel].clone() for u in (u0, u1)]
            result["values_equal"] = all(torch.equal(g, e) for g, e in zip(got, expected[:2]))
            result["error"] = None
        except OrderError as e:
            result["error"] = str(e)
        finally:
            u0._gather_now, u1._gather_now = late, second
            u0.reshard()
            u1.reshard()


if __name__ == "__main__":
    sys.exit(main())
