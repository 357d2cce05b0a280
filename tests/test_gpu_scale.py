"""benchmarks/gpu_scale.sh + gpu_scale.py (issue 42, section 2): the one-GPU scale bench at its --tiny size on
this machine, through the same code path a GPU run takes (the shell stages, one process per run under its own
limit, the probe, the figures, the bound and `offload plan`'s prediction). Structural facts and the arithmetic
that ties the figures together are asserted, no timing thresholds (the machine may be busy)."""
from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
import time

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import gpu_scale  # noqa: E402


def test_run_names_give_contender_model_and_tokens():
    assert gpu_scale.parse_run("offload8bit-8b-64k", tiny=False, seq=4096) == {
        "contender": "offload8bit", "model": "8b", "tokens_per_step": 65536}
    assert gpu_scale.parse_run("torch-3b-16k", tiny=True, seq=64)["tokens_per_step"] == 128  # 2 sequences
    with pytest.raises(SystemExit, match="CONTENDER-MODEL-TOKENSk"):
        gpu_scale.parse_run("offload-7b-16k", tiny=False, seq=4096)
    for name in gpu_scale.DEFAULT_RUNS:  # every default run is a known contender with a time limit
        assert gpu_scale.parse_run(name, tiny=False, seq=4096)["contender"] in gpu_scale.LIMIT_S


def test_model_shapes_are_the_published_ones():
    from transformers import LlamaForCausalLM

    def count(model):
        s = gpu_scale.ScaleSettings(model=model)
        with torch.device("meta"):
            return sum(p.numel() for p in LlamaForCausalLM(gpu_scale.llama_config(s)).parameters())

    assert count("3b") == 3_212_749_824  # Llama-3.2-3B (tied embeddings)
    assert count("8b") == 8_030_261_248  # Llama-3-8B


def test_dry_run_lists_the_runs_without_running_any():
    out = subprocess.run(["bash", os.path.join(ROOT, "benchmarks", "gpu_scale.sh"), "--dry-run"],
                         capture_output=True, text=True, timeout=120, env=dict(os.environ, PYTHON=sys.executable))
    assert out.returncode == 0, out.stderr
    for name in gpu_scale.DEFAULT_RUNS:
        assert name in out.stdout
    assert "cpu_budget" in out.stdout and "limit" in out.stdout


def test_tiny_runs_end_to_end_through_the_shell_script(tmp_path):
    runs = "offload-3b-16k,torch-3b-16k,fsdp2-3b-16k,deepspeed-3b-16k"
    env = dict(os.environ, OUT=str(tmp_path), PYTHON=sys.executable, GPU_SCALE_BUDGET_S="400")
    proc = subprocess.run(["bash", os.path.join(ROOT, "benchmarks", "gpu_scale.sh"), "--tiny", "--runs", runs,
                           "--seq", "32", "--warmup", "1", "--steps", "1", "--threads", "1"],
                          capture_output=True, text=True, timeout=500, env=env)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    doc = json.loads((tmp_path / "gpu_scale.json").read_text())
    assert (tmp_path / "gpu_scale.log").read_text().count("== ") >= 3
    assert doc["probes"]["host"]["copy_GBps"] > 0 and doc["probes"]["host"]["adam_params_per_s"] > 0
    if importlib.util.find_spec("deepspeed") is None:
        assert "not importable" in doc["skipped"]["deepspeed-3b-16k"]
    rows = doc["runs"]
    from transformers import LlamaForCausalLM

    with torch.device("meta"):
        s = gpu_scale.ScaleSettings(tiny=True, seq=32)
        n_params = sum(p.numel() for p in LlamaForCausalLM(gpu_scale.llama_config(s)).parameters())
    for name in ("offload-3b-16k", "torch-3b-16k", "fsdp2-3b-16k"):
        row = rows[name]
        assert "error" not in row, row.get("output_tail")
        assert set(gpu_scale.ROW_FIELDS) <= set(row), set(gpu_scale.ROW_FIELDS) - set(row)
        assert row["n_params"] == n_params and row["tokens_per_step"] == 64 == row["accum"] * 2 * 32
        assert row["tokens_per_s"] == pytest.approx(row["tokens_per_step"] / row["s_per_step"])
        assert row["model_tflops"] == pytest.approx(6 * n_params * row["tokens_per_s"] / 1e12)
        assert row["mfu"] == pytest.approx(row["model_tflops"] / 790.0)
        assert row["peak_gpu_bytes"] is None and row["peak_rss_bytes"] > 50 << 20
        assert all(math.isfinite(x) and 3.0 < x < 10.0 for x in row["losses"])  # about ln(512), random tokens
        b = row["bound"]
        assert set(b["terms_s"]) == {"compute", "host_adam", "pcie", "disk"}
        assert b["bound_s"] == max(b["terms_s"].values()) == b["terms_s"][b["binds"]] > 0
        assert b["efficiency"] == pytest.approx(b["bound_s"] / row["s_per_step"])
        assert row["split"]
    off = rows["offload-3b-16k"]
    assert off["tiers"] == {"params": "device", "optimizer": "cpu", "grads": "device"}
    split = off["split"]
    assert split["compute_s"] > 0 and split["lane_busy_s"]["optimizer"] > 0 and "links" in split
    assert off["throughput"]["tokens"] == 64  # rt.stats()'s own count of the step's tokens
    assert off["pcie_bytes_source"] == "rt.stats()" and off["bound"]["terms_s"]["host_adam"] > 0
    assert set(rows["torch-3b-16k"]["split"]) == {"forward_backward_s", "clip_s", "optimizer_s"}
    assert rows["torch-3b-16k"]["bound"]["terms_s"]["host_adam"] == 0
    for name in ("offload-3b-16k", "torch-3b-16k"):
        plan = rows[name]["plan"]
        assert plan["predicted_s"] > 0 and plan["command"].startswith("offload plan --model ")
        assert plan["error"] == pytest.approx(plan["predicted_s"] / rows[name]["s_per_step"] - 1)
    assert rows["offload-3b-16k"]["plan"]["placement"] == "params=device, optimizer=cpu, grads=device"
    assert rows["fsdp2-3b-16k"]["plan"] is None
    assert "3b_16k_offload_over_fsdp2 (>= 1.5)" in doc["targets"]


def _hang_script(tmp_path):
    """A child that starts a grandchild (its pid written to a file), says "started" and hangs."""
    script, pidfile = tmp_path / "hang.py", tmp_path / "grandchild.pid"
    # (the pid written aside and renamed into place: a reader that sees the file sees the whole pid; written in place,
    # a test once read it empty)
    script.write_text("import os, subprocess, sys, time\n"
                      "p = subprocess.Popen(['sleep', '300'])\n"
                      f"open({str(pidfile)!r} + '.tmp', 'w').write(str(p.pid))\n"
                      f"os.replace({str(pidfile)!r} + '.tmp', {str(pidfile)!r})\n"
                      "print('started', flush=True)\ntime.sleep(300)\n")
    return script, pidfile


def _gone(pid: int, within_s: float = 10.0) -> bool:
    """The process exits (a zombie waiting for its reaper counts as gone) within `within_s`."""
    def alive() -> bool:
        try:
            with open(f"/proc/{pid}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] != "Z"
        except OSError:
            return False

    deadline = time.monotonic() + within_s
    while alive() and time.monotonic() < deadline:
        time.sleep(0.1)
    return not alive()


def test_a_run_past_its_limit_is_killed_with_everything_it_started(tmp_path):
    import bench_offload_step as bso

    script, pidfile = _hang_script(tmp_path)
    s = gpu_scale.ScaleSettings(nvme_dir=str(tmp_path / "run"), threads=1)
    res = bso.spawn("hang", s, script=str(script), timeout_s=3)
    assert res["error"] == "timed out after 3 s" and res["child_wall_s"] < 60
    assert "started" in "\n".join(res["output_tail"])
    assert _gone(int(pidfile.read_text()))  # the sleep the child started went with it (one process group)


def test_a_stopped_parent_takes_its_run_along(tmp_path):
    """gpu_scale.sh's outer timeout sends SIGTERM to gpu_scale.py: the run in flight, in a process group of its own,
    must not outlive it (on a GPU machine it would hold the GPU)."""
    script, pidfile = _hang_script(tmp_path)
    parent = subprocess.Popen([sys.executable, "-c", (
        "import signal, sys; sys.path.insert(0, sys.argv[1]); import gpu_scale, bench_offload_step as bso\n"
        "signal.signal(signal.SIGTERM, lambda n, f: sys.exit(128 + n))\n"
        "bso.spawn('hang', gpu_scale.ScaleSettings(nvme_dir=sys.argv[3], threads=1), script=sys.argv[2])"),
        os.path.join(ROOT, "benchmarks"), str(script), str(tmp_path / "run")])
    deadline = time.monotonic() + 120
    while not pidfile.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    grandchild = int(pidfile.read_text())
    parent.terminate()
    assert parent.wait(timeout=60) == 128 + 15
    assert _gone(grandchild)
