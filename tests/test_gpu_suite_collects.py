"""The GPU suite (tests/test_cuda_*.py) on a machine without one: every file imports and collects, and every test
in it is skipped saying why (none errors, none runs). It has never run where it is written unless this holds:
a GPU machine is lent only now and then, and an import error found there wastes the loan."""
import glob
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent


def _pytest(*args):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *args], cwd=str(REPO), env=env,
                          capture_output=True, text=True, timeout=600)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here: the suite runs for real (gpu_check.sh)")
def test_gpu_suite_collects_and_skips_without_a_gpu():
    files = sorted(glob.glob(str(REPO / "tests" / "test_cuda_*.py")))
    assert len(files) >= 4, files
    # -m cuda: a test without the cuda marker would be deselected, and said so on the summary line
    proc = _pytest("-q", "-rs", "-m", "cuda", *files)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    last = out.strip().splitlines()[-1]
    assert "skipped" in last and not any(w in last for w in ("passed", "failed", "error")), last
    assert "needs a CUDA GPU" in out, out[-2000:]
    assert "deselected" not in last, last  # every test of those files carries the cuda marker
