"""Two-rank worker for tests/test_rank_skew.py, launched by torchrun:

    python -m torch.distributed.run --standalone --nproc_per_node 2 tests/skew_worker.py OUT NVME_DIR

Each rank's lanes are slowed differently (rank 0: every gather and copy late; rank 1: every reduce and disk
read late), so the ranks reach each collective at different times and in different interleavings of their
gather and reduce lanes: with one group and one program order per lane this must finish, bit for bit the
synchronous run's. (On NCCL, lanes sharing one stream in different orders hung here.)
"""
import contextlib
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import rank_sequences  # noqa: E402
from zero_common import Case, _bitwise_mismatches, _data, make_model, offload_run  # noqa: E402

from offload import inject  # noqa: E402
from offload.telemetry import Queue  # noqa: E402

SKEW = {0: {Queue.GATHER: 0.01, Queue.COPY: 0.005}, 1: {Queue.REDUCE: 0.01, Queue.NVME_READ: 0.005}}


def main() -> int:
    out_path, nvme_dir = sys.argv[1], sys.argv[2]
    rank_sequences.record(out_path + ".collectives")
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.set_num_threads(1)
    case = Case(params="nvme", optimizer="nvme", world=2, accum=2, no_sync=False, steps=20, cpu_budget="128KiB",
                snapshot_every=20)
    torch.manual_seed(1234)
    model = make_model(case.model)
    sync_model = make_model(case.model)
    sync_model.load_state_dict(model.state_dict())
    data = _data(case)
    reference = offload_run(case, sync_model, data, nvme_dir, pipeline=False)[:3]
    with contextlib.ExitStack() as stack:
        for queue, seconds in SKEW[rank].items():
            stack.enter_context(inject.delay(queue, seconds))
        skewed = offload_run(case, model, data, nvme_dir, pipeline=True)[:3]
    result = {"rank": rank, "steps": len(skewed[0]), "mismatches": _bitwise_mismatches(skewed, reference),
              "debug_level": str(dist.get_debug_level())}  # (the test sets TORCH_DISTRIBUTED_DEBUG=DETAIL)
    with open(f"{out_path}.{rank}", "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
