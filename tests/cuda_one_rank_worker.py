"""One GPU, one rank, every collective over NCCL (Config.collectives_at_world_size_1), for
tests/test_cuda_one_rank_collectives.py, in a process of its own (TORCH_CUDA_SANITIZER is read at `import torch`):

    python tests/cuda_one_rank_worker.py SPEC.json
SPEC: {"out": file, "nvme": dir, "cases": [Case fields], "delay": "gather=0.005,reduce=0.005"}

Each case trains twice from one init and data, both pipelined: plainly (one rank copies locally, no collective) and
with the switch (offload.init starts a one-rank NCCL group in memory; the gather and reduce lanes issue their
all-gathers and reduce-scatters on their own communicators and streams, slowed by SPEC["delay"]). Writes, per case,
the bitwise mismatches between the two, the collectives issued by (group, op), and what each communicator took of
the device at open; an exception goes there too, and the exit status is 1.
"""
import copy
import dataclasses
import json
import os
import sys
import traceback
from collections import Counter

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import cuda_common as cc  # noqa: E402  (first: cuBLAS's deterministic workspace)
import torch  # noqa: E402

from zero_common import Case, _bitwise_mismatches, _data, _injected, make_model, offload_run  # noqa: E402

from offload.zero.collectives import comm  # noqa: E402


def run(case: Case, nvme: str, delay: str) -> dict:
    with cc.deterministic():
        torch.manual_seed(1234)
        plain_model = make_model(case.model)
        model = copy.deepcopy(plain_model)
        data = _data(case)
        plain = offload_run(case, plain_model, data, nvme)[:3]
        with comm.recording() as issued, _injected(delay):
            *through, stats = offload_run(dataclasses.replace(case, collectives_at_one=True), model, data, nvme)
    return {"case": case.name, "mismatches": _bitwise_mismatches(tuple(through), plain),
            "issued": {f"{g}:{op}": n for (g, op), n in Counter((e[0], e[1]) for e in issued.entries).items()},
            "communicators_device_bytes_by_group": stats["communicators_device_bytes_by_group"],
            "peak_device": stats["peak_resident_bytes"]["device"], "device_budget": stats["budgets"]["device"]}


def main() -> int:
    spec = json.load(open(sys.argv[1]))
    torch.cuda.set_device(0)
    results, failed = [], False
    for fields in spec["cases"]:
        try:
            results.append(run(Case(**fields), spec["nvme"], spec.get("delay", "")))
        except Exception:  # noqa: BLE001 - reported to the test with the traceback
            results.append({"case": fields, "error": traceback.format_exc()})
            failed = True
    with open(spec["out"], "w") as f:
        json.dump({"results": results, "sanitizer": os.environ.get("TORCH_CUDA_SANITIZER", "")}, f, default=str)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
