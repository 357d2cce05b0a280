"""compute_dtype="auto": bf16 where the CPU multiplies it fast, fp32 where torch only emulates it, agreed across
ranks; an explicit slow choice kept and warned about once. An AVX2-only CPU is emulated here with
ONEDNN_MAX_CPU_ISA=AVX2 (oneDNN then has no bf16 kernels: torch's bf16 matmul falls back to its emulation)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
AVX2_ONLY = {"ONEDNN_MAX_CPU_ISA": "AVX2"}


def _cpu_flags() -> set:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    line = next((l for l in text.splitlines() if l.startswith("flags")), "")
    return set(line.split(":", 1)[-1].split())


# bf16 instructions, and oneDNN not capped below them (ONEDNN_MAX_CPU_ISA=AVX2 emulates a CPU without them)
HAS_BF16 = bool({"avx512_bf16", "amx_bf16"} & _cpu_flags()) and "ONEDNN_MAX_CPU_ISA" not in os.environ

_REPORT = """
import json, warnings, torch, offload
from offload.compute_dtype import cpu_matmul_slowdown, fast_compute_dtype
warnings.simplefilter("always")
out = {"auto": fast_compute_dtype(torch.device("cpu")), "slowdown": cpu_matmul_slowdown(torch.bfloat16)}
with warnings.catch_warnings(record=True) as caught:
    for name in ("auto", "bf16", "bf16"):
        with offload.init(offload.Config(compute_dtype=name, cpu_budget="64MiB", device_budget="64MiB")) as rt:
            model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
            model(torch.randn(2, 8, dtype=rt.compute_dtype)).float().sum().backward()
            out.setdefault("runs", []).append([rt.config.compute_dtype, str(rt.compute_dtype),
                                               rt.stats()["compute_dtype"]])
out["warnings"] = [str(w.message) for w in caught if "compute_dtype" in str(w.message)]
print(json.dumps(out))
"""


def _report(**env) -> dict:
    out = subprocess.run([sys.executable, "-c", _REPORT], capture_output=True, text=True, cwd=ROOT,
                         env={**os.environ, **env}, timeout=300)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_auto_is_fp32_where_bf16_is_emulated_and_an_explicit_bf16_is_warned_about_once():
    r = _report(**AVX2_ONLY)
    assert r["slowdown"] > 5, r  # emulated bf16: 20-70x fp32's time
    assert r["auto"][0] == "fp32" and "no bf16 instructions" in r["auto"][1], r
    auto, explicit, again = r["runs"]
    assert auto[:2] == ["fp32", "torch.float32"] and auto[2]["auto"] is True and auto[2]["why"] == r["auto"][1]
    assert explicit[:2] == ["bf16", "torch.bfloat16"]
    assert explicit[2] == {"dtype": "bf16", "auto": False, "why": "as set"}
    assert again[:2] == ["bf16", "torch.bfloat16"]  # the user's choice is kept
    assert len(r["warnings"]) == 1, r["warnings"]  # once per process, with the measured figure and the fix
    assert "x fp32's time" in r["warnings"][0] and "compute_dtype='auto'" in r["warnings"][0]


@pytest.mark.skipif(not HAS_BF16, reason="this CPU has no AVX512_BF16 or AMX: bf16 is emulated here")
def test_auto_is_bf16_where_the_cpu_has_bf16_instructions_and_nothing_is_warned():
    r = _report()
    assert r["slowdown"] < 2, r
    assert r["auto"][0] == "bf16", r
    assert [run[0] for run in r["runs"]] == ["bf16", "bf16", "bf16"]
    assert r["warnings"] == []


def test_the_fine_tune_defaults_to_auto_and_says_it():
    from offload.cli import build_parser
    from offload.finetune.job import FinetuneConfig, runtime_config

    assert runtime_config(FinetuneConfig(), "/tmp").compute_dtype == "auto"
    assert runtime_config(FinetuneConfig(compute_dtype="bf16"), "/tmp").compute_dtype == "bf16"  # a flag is kept
    parser = build_parser()
    sub = next(a for a in parser._actions if getattr(a, "choices", None) and "finetune" in a.choices)
    help_text = sub.choices["finetune"].format_help()
    assert "default auto" in help_text and "AVX512_BF16" in help_text


def test_env_says_what_auto_picks():
    out = subprocess.run([sys.executable, "-m", "offload.cli", "env", "--json"], capture_output=True, text=True,
                         cwd=ROOT, env={**os.environ, **AVX2_ONLY}, timeout=300)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["compute_dtype_auto"].startswith("fp32 (the CPU multiplies bf16 at ")


def test_a_trainer_config_may_leave_the_dtype_to_training_arguments():
    from transformers import TrainingArguments

    from offload import Config
    from offload.integrations.transformers import _refuse_unsupported

    args = TrainingArguments(output_dir="unused", use_cpu=True, report_to=[])
    _refuse_unsupported(args, Config(compute_dtype="auto"), {})  # auto: Trainer's bf16/fp16 flags decide
    with pytest.raises(ValueError, match="TrainingArguments.bf16=False"):
        _refuse_unsupported(args, Config(compute_dtype="bf16"), {})


_RANK = """
import json, os, torch, offload
with offload.init(offload.Config(compute_dtype="auto", cpu_budget="64MiB", device_budget="64MiB")) as rt:
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    model(torch.randn(2, 8, dtype=rt.compute_dtype)).float().sum().backward()
    print(json.dumps([rt.rank, rt.config.compute_dtype, rt.stats()["compute_dtype"]["why"]]), flush=True)
"""


@pytest.mark.skipif(not HAS_BF16, reason="needs a CPU where one rank can find bf16 fast")
def test_ranks_that_measure_apart_all_compute_in_fp32():
    """Rank 1 sees an AVX2-only CPU, rank 0 a bf16 one: every rank must compute in one dtype, or their gathers
    and reduce-scatters pair buffers of different sizes. The choice is agreed (the safe one wins)."""
    import rank_launch

    store, joins = rank_launch.hosted_store()  # held while the ranks run; no free-port race
    procs = []
    for rank in (0, 1):
        env = {**os.environ, **joins, "RANK": str(rank),
               "WORLD_SIZE": "2", "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": "2", **(AVX2_ONLY if rank else {})}
        procs.append(subprocess.Popen([sys.executable, "-c", _RANK], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    results = []
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err
        results.append(json.loads(out.strip().splitlines()[-1]))
    assert [r[1] for r in results] == ["fp32", "fp32"], results
    assert "another rank" in results[0][2], results  # rank 0 measured bf16 fast and was overruled
