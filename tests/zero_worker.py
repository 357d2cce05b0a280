"""Multi-rank parity worker, launched by torchrun (one process group runs many configurations):

    python -m torch.distributed.run --standalone --nproc_per_node 2 tests/zero_worker.py CASES.json OUT.json NVME_DIR

Every rank runs every case; rank 0 writes the list of results (zero_common.run_case) to OUT.json, and any
rank's exception is written there too, so the test reports it instead of hanging or guessing.
"""
import faulthandler
import json
import os
import sys
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch.distributed as dist  # noqa: E402

import rank_sequences  # noqa: E402
from zero_common import Case, inblock_values_check, run_case, state_dict_check  # noqa: E402


def main() -> int:
    cases_path, out_path, nvme_dir = sys.argv[1:4]
    rank_sequences.record(out_path + ".collectives")  # compared across ranks by the test
    faulthandler.enable()  # an abort (SIGABRT from a C++ thread) prints every thread's Python stack to stderr
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    results = []
    for fields in json.load(open(cases_path)):
        case = Case(**fields)
        try:
            results.append(run_case(case, nvme_dir))
        except Exception:  # noqa: BLE001 - reported to the test with the traceback
            results.append({"case": case.name, "error": traceback.format_exc()})
    for check, name in ((inblock_values_check, "inblock"), (state_dict_check, "state_dict")):
        try:
            results.append(check())
        except Exception:  # noqa: BLE001
            results.append({"case": name, "error": traceback.format_exc()})
    results.append({"case": "debug_level", "level": str(dist.get_debug_level())})  # (TORCH_DISTRIBUTED_DEBUG)
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(results, f)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
