"""A collective issued and never waited on the host (as NCCL's are: a wait makes a stream wait), its peer stalled:
the heartbeat names it. Run by test_watchdog.py.

    torchrun --nproc_per_node 2 watchdog_overdue_worker.py
"""
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from offload.zero.collectives.watchdog import CollectiveError, Watchdog  # noqa: E402

OVERDUE_S = 2.0
STALL_S = 12.0


def main():
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    wd = Watchdog(rank, 2, timeout_s=60.0, overdue_s=OVERDUE_S)
    t = torch.ones(4)
    if rank == 1:
        print(f"rank 1 stalls at {time.time():.3f}", flush=True)
        time.sleep(STALL_S)  # alive (its heartbeat beats), in its own code
        dist.all_reduce(t)  # meets rank 0's, so both end cleanly
    else:
        work = wd.run("gather", "all_reduce", "gather of unit 3 (layers.3)",
                      lambda: dist.all_reduce(t, async_op=True))
        deadline = time.time() + STALL_S - 1.0
        while wd.broken is None and time.time() < deadline:
            time.sleep(0.1)
        print(f"rank 0 broken at {time.time():.3f}: {wd.broken}", flush=True)
        try:
            wd.run("main", "all_reduce", "flags", lambda: None)
            print("rank 0 next collective: ran", flush=True)
        except CollectiveError:
            print("rank 0 next collective: refused", flush=True)
        work.wait()
    wd.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
