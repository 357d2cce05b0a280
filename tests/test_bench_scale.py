"""benchmarks/bench_scale.py at its CI size (--tiny): every section runs end to end and its figures are sane
(positive, ratios finite, bytes per parameter in the range the families store). No timing thresholds: the
machine may be busy; the goals are the bench's, recorded with its full-size figures."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _positive(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def test_the_tiny_bench_runs_and_its_figures_are_sane(tmp_path):
    out = tmp_path / "scale.json"
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "bench_scale.py"), "all", "--tiny",
                           "--json", str(out)], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "lane alone / kernel" in proc.stdout and "ms CPU per unit per step" in proc.stdout
    r = json.loads(out.read_text())

    u = r["update"]
    for who in ("torch", "kernel", "offload"):
        assert _positive(u["median"][who]["step_s"]) and _positive(u["median"][who]["opt_s"])
    assert _positive(u["median"]["offload"]["lane_s"]) and _positive(u["median"]["offload"]["lane_alone_s"])
    for ratio in ("lane_vs_kernel", "lane_overlapped_vs_kernel", "step_vs_torch", "kernel_params_per_s"):
        assert _positive(u[ratio]), ratio

    units = r["units"]
    assert units["runtime_units"] >= units["units"]  # each block a unit (and the root)
    for who in ("torch", "offload"):
        assert _positive(units["median"][who]["cpu_s"]) and _positive(units["median"][who]["wall_s"])
    assert math.isfinite(units["cpu_ms_per_unit"]) and math.isfinite(units["wall_ms_per_unit"])

    t = r["traffic"]
    assert _positive(t["copy_GBps"])
    assert t["families"]["adamw"]["bytes_per_param"] == 28.0  # grad 4, master, exp_avg, exp_avg_sq 2 x 4 each
    assert 16.0 < t["families"]["adamw8bit"]["bytes_per_param"] < 16.1  # 8-bit codes, a scale per 256
    for f in t["families"].values():
        assert _positive(f["kernel_s"]) and _positive(f["vs_roofline"]) and _positive(f["kernel_GBps"])


def test_the_tiny_load_bench_runs_and_its_figures_are_sane(tmp_path):
    """benchmarks/bench_scale_load.py at its CI shape: written, loaded inside offload.init onto nvme, one step,
    the peak RSS and times reported, and offload plan's prediction printed beside them."""
    out = tmp_path / "load.json"
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "bench_scale_load.py"), "--shape", "tiny",
                           "--dir", str(tmp_path / "ckpt"), "--nvme-dir", str(tmp_path / "swap"),
                           "--json", str(out)], env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["params"] == 119_104 and math.isfinite(r["loss"])
    for key in ("load_s", "first_step_s", "to_first_step_s", "peak_rss", "peak_growth"):
        assert _positive(r[key]), key
    assert r["peak_rss"] >= r["peak_rss_loading"] > 0
    assert "parameters" in r["plan"] and "per rank" in r["plan"]  # offload plan ran on the written config
    assert not (tmp_path / "swap" / "swap").exists()  # the swap directory is removed
