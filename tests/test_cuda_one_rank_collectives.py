"""The multi-rank path on the one GPU we get (issue 44): one rank issuing every collective through NCCL
(Config.collectives_at_world_size_1: offload.init starts a one-rank NCCL group), with the gather and reduce lanes'
communicators, streams and tickets as at world size 8 and both lanes slowed, trains bit for bit as the plain
one-rank run; once more under TORCH_CUDA_SANITIZER=1 (torch's stream-race checker: a kernel reading what another
stream writes without an event between them raises). Each communicator's device memory at open goes to the figures
file (rt.stats()["communicators_device_bytes_by_group"]). The CPU suite runs the same over gloo
(tests/test_one_rank_collectives.py). Each run is a process of its own (worker: tests/cuda_one_rank_worker.py)."""
import dataclasses
import json
import os
import subprocess
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cuda_common import REPO, TESTS, record_figure  # noqa: E402
from zero_common import Case  # noqa: E402

pytestmark = pytest.mark.cuda

CASES = [
    Case(params="cpu", optimizer="cpu", accum=2, no_sync=False, steps=4),  # a reduce per micro-batch
    Case(params="nvme", optimizer="nvme", dtype="bf16", accum=2, steps=4, clip=1e9),  # every state through the disk
]
DELAY = "gather=0.005,reduce=0.005"  # each lane's work late: the streams' waits must hold, not the timing


def _launch(tmp_path, sanitizer: bool) -> dict:
    spec = {"out": str(tmp_path / "out.json"), "nvme": str(tmp_path), "delay": DELAY,
            "cases": [dataclasses.asdict(c) for c in CASES]}
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    env = dict(os.environ, OMP_NUM_THREADS="2",
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    env.pop("WORLD_SIZE", None)  # one rank: the runtime starts its own group
    if sanitizer:
        env["TORCH_CUDA_SANITIZER"] = "1"
    proc = subprocess.run([sys.executable, str(TESTS / "cuda_one_rank_worker.py"), str(tmp_path / "spec.json")],
                          env=env, capture_output=True, text=True, timeout=500, cwd=str(REPO))
    out = json.loads((tmp_path / "out.json").read_text()) if (tmp_path / "out.json").exists() else {}
    assert proc.returncode == 0, (out, proc.stderr[-4000:])
    return out


@pytest.mark.parametrize("sanitizer", [False, True], ids=["plain", "cuda_sanitizer"])
def test_one_rank_through_nccl_trains_bitwise_as_without(tmp_path, sanitizer):
    out = _launch(tmp_path, sanitizer)
    for r in out["results"]:
        assert "error" not in r, r.get("error")
        assert r["mismatches"] == 0, r
        issued = r["issued"]
        assert issued.get("gather:all_gather", 0) > 0 and issued.get("reduce:reduce_scatter", 0) > 0, r
        assert issued.get("main:all_reduce", 0) > 0, r
        assert r["peak_device"] <= r["device_budget"], r
        if not sanitizer:
            taken = r["communicators_device_bytes_by_group"]
            assert set(taken) == {"main", "gather", "reduce"}, r
            record_figure("nccl_communicator_bytes_world1", case=r["case"], **taken)
