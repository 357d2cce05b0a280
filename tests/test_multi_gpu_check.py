"""benchmarks/multi_gpu_check.sh, the check for the first machine with several GPUs: here (fewer than 2 GPUs) it
starts, says in one line that there is nothing to check, leaves its results file, and exits 2."""
import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "benchmarks" / "multi_gpu_check.sh"


@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.device_count() >= 2,
                    reason="2 or more GPUs here: the check would run for 10 minutes (run it by hand)")
def test_the_multi_gpu_check_exits_2_below_two_gpus_saying_so(tmp_path):
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NCCL_", "TORCH_NCCL_"))}
    proc = subprocess.run(["bash", str(SCRIPT)], cwd=tmp_path, env=dict(env, OUT=str(tmp_path), PYTHON="python3"),
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode == 2, (proc.stdout[-2000:], proc.stderr[-2000:])
    assert proc.stdout == ""
    assert proc.stderr.splitlines() == [
        f"multi_gpu_check: {gpus} CUDA GPU(s) here, 2 or more needed: nothing was checked (results in "
        f"{tmp_path}/multi_gpu_check_results.json)"], proc.stderr
    results = json.loads((tmp_path / "multi_gpu_check_results.json").read_text())
    assert results["status"] == {"gpus": gpus, "skipped": "fewer than 2 CUDA GPUs"}
    assert results["versions"]["device_count"] == gpus and results["versions"]["torch"] == torch.__version__
