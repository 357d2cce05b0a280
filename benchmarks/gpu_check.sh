#!/usr/bin/env bash
# The GPU check, one command from the repository root on a GPU machine (no network, no pip install):
#
#     bash benchmarks/gpu_check.sh
#
# 1. the machine: nvidia-smi, Python / torch / CUDA / NCCL / transformers versions
# 2. the C++ extension, JIT-built (offload/_ext.py)
# 3. offload bench pcie (pinned vs pageable host<->device GB/s), briefly
# 4. the GPU suite: python -m pytest -m cuda tests (the store, runtime and parity files first)
# 5. the step bench on the GPU, briefly (torch vs offload, 1 round), if the time budget leaves room
# 6. activation offload against its peers (bench_activations: none / cpu / auto, transformers' offload=True, and
#    DeepSpeed's cpu_checkpointing when `import deepspeed` works: the GPU image has no DeepSpeed; with .whl/ from
#    benchmarks/deepspeed_wheels.sh carried along, it is installed from there first), 1 round, if the budget
#    leaves room
# Every figure goes into ONE file, ${OUT:-.}/gpu_check_results.json, rewritten after each stage (a run cut short
# still leaves what it measured): versions, extension status, the tests' outcome (counts, failures, slowest),
# the figures the tests record (tests/cuda_common.record_figure), and the two benches.
# Exit status: 0 only when the extension builds and every selected test passes; 2 without a CUDA GPU (nothing
# was checked). The whole run keeps within GPU_CHECK_BUDGET_S seconds (default 570: under 10 minutes).
# GPU_CHECK_PYTEST_FLAGS (default -x) replaces pytest's stop-at-first-failure flag (e.g. "" to run every test).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
. benchmarks/wheels_env.sh  # DeepSpeed and its dependencies from .whl/, when carried along
export PYTHONUNBUFFERED=1
export CUBLAS_WORKSPACE_CONFIG="${CUBLAS_WORKSPACE_CONFIG:-:4096:8}"  # the parity tests compare runs bit for bit
PY="${PYTHON:-python}"
OUTDIR="${OUT:-.}"
mkdir -p "$OUTDIR"
RESULTS="$OUTDIR/gpu_check_results.json"
WORK="$(mktemp -d -t gpu-check-XXXXXX)"
export OFFLOAD_GPU_FIGURES="$WORK/figures.jsonl"
: > "$OFFLOAD_GPU_FIGURES"
BUDGET="${GPU_CHECK_BUDGET_S:-570}"
START=$(date +%s)
left() { echo $(( BUDGET - ($(date +%s) - START) )); }
min() { if [ "$1" -lt "$2" ]; then echo "$1"; else echo "$2"; fi; }
echo "{}" > "$WORK/status.json"

status() {  # status KEY VALUE: one stage's outcome, merged into the results
  "$PY" - "$WORK/status.json" "$1" "$2" <<'EOF'
import json, sys
path, key, value = sys.argv[1:4]
d = json.load(open(path))
try:
    d[key] = json.loads(value)
except ValueError:
    d[key] = value
json.dump(d, open(path, "w"))
EOF
}

merge() {  # everything measured so far -> $RESULTS
  "$PY" - "$WORK" "$RESULTS" "$START" <<'EOF'
import json, os, sys, time
import xml.etree.ElementTree as ET

work, out, start = sys.argv[1], sys.argv[2], float(sys.argv[3])


def load(name):
    path = os.path.join(work, name)
    if not os.path.exists(path):
        return None
    try:
        return json.load(open(path))
    except ValueError:
        return {"unreadable": open(path, errors="replace").read()[-2000:]}


def text(name, tail=6000):
    path = os.path.join(work, name)
    return open(path, errors="replace").read()[-tail:] if os.path.exists(path) else None


doc = {"wall_s": round(time.time() - start, 1), "status": load("status.json"), "versions": load("versions.json"),
       "nvidia_smi": text("nvidia-smi.txt", 4000), "extension": text("ext.log", 2000)}
junit = os.path.join(work, "junit.xml")
if os.path.exists(junit):
    try:
        root = ET.parse(junit).getroot()
        suite = root if root.tag == "testsuite" else root.find("testsuite")
        cases, failed = [], []
        for tc in suite.iter("testcase"):
            name = f"{tc.get('classname')}::{tc.get('name')}"
            outcome = "passed"
            for tag in ("failure", "error", "skipped"):
                el = tc.find(tag)
                if el is not None:
                    outcome = tag
                    if tag != "skipped":
                        failed.append({"test": name, "kind": tag, "message": (el.get("message") or "")[:1500],
                                       "detail": (el.text or "")[-3000:]})
            cases.append({"test": name, "outcome": outcome, "s": float(tc.get("time") or 0)})
        doc["tests"] = {k: suite.get(k) for k in ("tests", "failures", "errors", "skipped", "time")}
        doc["tests"]["passed"] = sum(c["outcome"] == "passed" for c in cases)
        doc["tests"]["failed"] = failed
        doc["tests"]["slowest"] = sorted(cases, key=lambda c: -c["s"])[:25]
        doc["tests"]["outcomes"] = {c["test"]: c["outcome"] for c in cases}
    except Exception as e:  # noqa: BLE001 - a truncated file from a killed run
        doc["tests"] = {"junit_unreadable": repr(e)}
doc["pytest_tail"] = text("pytest.log", 8000)
figures = []
path = os.path.join(work, "figures.jsonl")
if os.path.exists(path):
    for line in open(path):
        try:
            figures.append(json.loads(line))
        except ValueError:
            pass
doc["figures"] = figures
pcie = load("pcie.json")
if pcie is not None:
    doc["bench_pcie"] = pcie
doc["bench_pcie_log"] = text("pcie.log", 3000)
step = load("step.json")
if step is not None:
    doc["bench_offload_step"] = step
doc["bench_offload_step_log"] = text("step.log", 4000)
acts = load("acts.json")
if acts is not None:
    doc["bench_activations"] = acts
doc["bench_activations_log"] = text("acts.log", 4000)
tmp = out + ".partial"
json.dump(doc, open(tmp, "w"), indent=1, default=str)
os.replace(tmp, out)
EOF
}

echo "== gpu_check: results -> $RESULTS (work dir $WORK, budget ${BUDGET}s)"

# ---- 1. the machine -------------------------------------------------------------------------------------------
echo "== machine"
if command -v nvidia-smi >/dev/null 2>&1; then
  timeout 60 nvidia-smi > "$WORK/nvidia-smi.txt" 2>&1
  cat "$WORK/nvidia-smi.txt"
else
  echo "nvidia-smi: not found" | tee "$WORK/nvidia-smi.txt"
fi
timeout 120 "$PY" - > "$WORK/versions.json" <<'EOF'
import json, os, platform, sys
import torch
d = {"python": sys.version.split()[0], "platform": platform.platform(), "torch": torch.__version__,
     "cuda_build": torch.version.cuda, "cuda_available": torch.cuda.is_available(),
     "device_count": torch.cuda.device_count() if torch.cuda.is_available() else 0, "cpus": os.cpu_count()}
if torch.cuda.is_available():
    d["devices"] = [{"name": torch.cuda.get_device_name(i), "capability": list(torch.cuda.get_device_capability(i)),
                     "memory_GiB": round(torch.cuda.get_device_properties(i).total_memory / 2**30, 1)}
                    for i in range(torch.cuda.device_count())]
    d["cudnn"] = torch.backends.cudnn.version()
    try:
        d["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    except Exception as e:  # noqa: BLE001
        d["nccl"] = repr(e)
    d["driver"] = torch._C._cuda_getDriverVersion() if hasattr(torch._C, "_cuda_getDriverVersion") else None
for mod in ("transformers", "safetensors", "pytest", "numpy"):
    try:
        d[mod] = __import__(mod).__version__
    except Exception:  # noqa: BLE001
        d[mod] = None
print(json.dumps(d))
EOF
cat "$WORK/versions.json"; echo
CUDA_OK=$("$PY" -c "import json,sys; print(int(bool(json.load(open(sys.argv[1])).get('cuda_available'))))" \
  "$WORK/versions.json" 2>/dev/null || echo 0)
merge

# ---- 2. the extension ---------------------------------------------------------------------------------------------
echo "== extension (JIT build)"
timeout -k 10 "$(min 300 "$(left)")" "$PY" -c \
  "from offload import _ext; _ext.require(); print('extension built at', _ext.build_dir())" > "$WORK/ext.log" 2>&1
RC_EXT=$?
cat "$WORK/ext.log" | tail -20
status extension_rc "$RC_EXT"
merge

# ---- 3. offload bench pcie ------------------------------------------------------------------------------------------
if [ "$CUDA_OK" = 1 ] && [ "$(left)" -gt 400 ]; then
  echo "== offload bench pcie"
  timeout -k 10 90 "$PY" -m offload.cli bench pcie --rounds 3 --sizes 1MiB,64MiB,256MiB --json "$WORK/pcie.json" \
    > "$WORK/pcie.log" 2>&1
  status bench_pcie_rc $?
  tail -12 "$WORK/pcie.log"
  merge
fi

# ---- 4. the GPU suite ------------------------------------------------------------------------------------------------
T_TESTS=$(min 540 $(( $(left) - 20 )))
[ "$T_TESTS" -lt 60 ] && T_TESTS=60
echo "== pytest -m cuda (timeout ${T_TESTS}s)"
# `pytest -m cuda tests`, the store, runtime and parity files first (with -x, a failure there says the most), then
# every other test file (their cuda tests: the pcie bench's, the multi-GPU ones)
FIRST=(tests/test_cuda_store.py tests/test_cuda_runtime.py tests/test_cuda_parity.py)
FILES=("${FIRST[@]}")
for f in tests/test_*.py; do
  case " ${FIRST[*]} " in *" $f "*) ;; *) FILES+=("$f") ;; esac
done
timeout -k 15 "$T_TESTS" "$PY" -m pytest -m cuda -q -rs ${GPU_CHECK_PYTEST_FLAGS--x} --durations=25 \
  -p no:cacheprovider --junitxml="$WORK/junit.xml" "${FILES[@]}" 2>&1 | tee "$WORK/pytest.log"
RC_TESTS=${PIPESTATUS[0]}
status pytest_rc "$RC_TESTS"
[ "$RC_TESTS" = 124 ] || [ "$RC_TESTS" = 137 ] && status pytest_timed_out true
merge

# ---- 5. the step bench ---------------------------------------------------------------------------------------------
if [ "$CUDA_OK" = 1 ] && [ "$(left)" -gt 90 ]; then
  T_STEP=$(min 240 $(( $(left) - 10 )))
  echo "== bench_offload_step (torch vs offload, 1 round; timeout ${T_STEP}s)"
  timeout -k 10 "$T_STEP" "$PY" benchmarks/bench_offload_step.py --contenders torch,offload --rounds 1 --steps 3 \
    --warmup 1 --threads 8 --json "$WORK/step.json" > "$WORK/step.log" 2>&1
  status bench_step_rc $?
  tail -25 "$WORK/step.log"
else
  status bench_step "skipped: $(left) s of the budget left"
fi
merge

# ---- 6. activation offload against its peers ----------------------------------------------------------------------
if [ "$CUDA_OK" = 1 ] && [ "$(left)" -gt 150 ]; then
  T_ACT=$(min 300 $(( $(left) - 10 )))
  PEERS=none,cpu,auto,hf
  "$PY" -c "import deepspeed" > /dev/null 2>&1 && PEERS="$PEERS,ds"
  echo "== bench_activations ($PEERS, 1 round; timeout ${T_ACT}s)"
  timeout -k 10 "$T_ACT" "$PY" benchmarks/bench_activations.py --seqs 4096,16384 --dim 1024 --layers 8 --rounds 1 \
    --steps 3 --contenders "$PEERS" --json "$WORK/acts.json" > "$WORK/acts.log" 2>&1
  status bench_activations_rc $?
  tail -14 "$WORK/acts.log"
else
  status bench_activations "skipped: $(left) s of the budget left"
fi
merge

echo "== gpu_check: extension rc $RC_EXT, pytest rc $RC_TESTS, $(( $(date +%s) - START )) s; results in $RESULTS"
if [ "$CUDA_OK" != 1 ]; then
  echo "gpu_check: no CUDA GPU here: every GPU test was skipped, nothing was checked" >&2
  exit 2
fi
[ "$RC_EXT" = 0 ] && [ "$RC_TESTS" = 0 ]
