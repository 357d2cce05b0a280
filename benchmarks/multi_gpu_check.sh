#!/usr/bin/env bash
# The multi-GPU check, one command from the repository root on a machine with 2 or more GPUs (no network, no pip
# install; the conventions of benchmarks/gpu_check.sh):
#
#     bash benchmarks/multi_gpu_check.sh
#
# Cheapest first, 2 ranks before 8, each stage within what the budget leaves:
# 1. the machine: nvidia-smi (and its topology), Python / torch / CUDA / NCCL versions, the GPU count
#    (fewer than 2: one line, exit 2, nothing else run)
# 2. the C++ extension, JIT-built (offload/_ext.py)
# 3. offload bench pcie: each GPU alone and every GPU at once (one wall-clock window), briefly
# 4. the multi-GPU tests at 2 ranks: pytest -m multi_gpu (tests/test_cuda_multi_gpu.py's 2-rank parity with plain
#    torch and the synchronous runtime, the overlap profile; the pcie all-at-once test)
# 5. the step bench at 2 ranks (benchmarks/bench_offload_step.py, the offload contender, NCCL, 1 round)
# 6. the multi-GPU tests at 8 ranks (skew, contexts, parity, checkpoint 8 -> 4 -> 8), with 8 GPUs or more
# 7. the step bench at 8 ranks, with 8 GPUs or more
# NCCL's own diagnostics are on for every stage, where the caller has not set them: NCCL_DEBUG=INFO into one file
# per process under the work directory (NCCL_DEBUG_FILE), TORCH_NCCL_DUMP_ON_TIMEOUT=1 with a flight-recorder
# buffer (TORCH_NCCL_TRACE_BUFFER_SIZE=2000) dumped under the work directory (TORCH_NCCL_DEBUG_INFO_TEMP_FILE): a
# hang leaves each rank's last collectives. Their tails (the versions, transports and every WARN line) go in the
# results.
# Every figure goes into ONE file, ${OUT:-.}/multi_gpu_check_results.json, rewritten after each stage (a run cut
# short still leaves what it measured): versions, GPU count and topology, extension status, each test stage's
# outcome (counts, failures, slowest), the figures the tests record (tests/cuda_common.record_figure), the pcie
# bench, the two step benches, the NCCL logs' tails and the flight-recorder dumps found.
# Exit status: 0 only when the extension builds and every selected test passes; 2 with fewer than 2 CUDA GPUs
# (nothing was checked). The whole run keeps within MULTI_GPU_CHECK_BUDGET_S seconds (default 570: under 10
# minutes). MULTI_GPU_CHECK_PYTEST_FLAGS (default -x) replaces pytest's stop-at-first-failure flag.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
export CUBLAS_WORKSPACE_CONFIG="${CUBLAS_WORKSPACE_CONFIG:-:4096:8}"  # the parity tests compare runs bit for bit
PY="${PYTHON:-python}"
OUTDIR="${OUT:-.}"
mkdir -p "$OUTDIR"
RESULTS="$OUTDIR/multi_gpu_check_results.json"
WORK="$(mktemp -d -t multi-gpu-check-XXXXXX)"
export OFFLOAD_GPU_FIGURES="$WORK/figures.jsonl"
: > "$OFFLOAD_GPU_FIGURES"
BUDGET="${MULTI_GPU_CHECK_BUDGET_S:-570}"
START=$(date +%s)
left() { echo $(( BUDGET - ($(date +%s) - START) )); }
min() { if [ "$1" -lt "$2" ]; then echo "$1"; else echo "$2"; fi; }
echo "{}" > "$WORK/status.json"

# NCCL's diagnostics, unless the caller chose their own
mkdir -p "$WORK/nccl"
export NCCL_DEBUG="${NCCL_DEBUG:-INFO}"
export NCCL_DEBUG_FILE="${NCCL_DEBUG_FILE:-$WORK/nccl/nccl.%h.%p.log}"
export TORCH_NCCL_DUMP_ON_TIMEOUT="${TORCH_NCCL_DUMP_ON_TIMEOUT:-1}"
export TORCH_NCCL_TRACE_BUFFER_SIZE="${TORCH_NCCL_TRACE_BUFFER_SIZE:-2000}"
export TORCH_NCCL_DEBUG_INFO_TEMP_FILE="${TORCH_NCCL_DEBUG_INFO_TEMP_FILE:-$WORK/nccl/flight_recorder_rank_}"

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
import glob, json, os, sys, time
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


def junit(name):
    path = os.path.join(work, name)
    if not os.path.exists(path):
        return None
    try:
        root = ET.parse(path).getroot()
        suite = root if root.tag == "testsuite" else root.find("testsuite")
        cases, failed = [], []
        for tc in suite.iter("testcase"):
            test = f"{tc.get('classname')}::{tc.get('name')}"
            outcome = "passed"
            for tag in ("failure", "error", "skipped"):
                el = tc.find(tag)
                if el is not None:
                    outcome = tag
                    if tag != "skipped":
                        failed.append({"test": test, "kind": tag, "message": (el.get("message") or "")[:1500],
                                       "detail": (el.text or "")[-3000:]})
            cases.append({"test": test, "outcome": outcome, "s": float(tc.get("time") or 0)})
        doc = {k: suite.get(k) for k in ("tests", "failures", "errors", "skipped", "time")}
        doc.update(passed=sum(c["outcome"] == "passed" for c in cases), failed=failed,
                   slowest=sorted(cases, key=lambda c: -c["s"])[:15], outcomes={c["test"]: c["outcome"] for c in cases})
        return doc
    except Exception as e:  # noqa: BLE001 - a truncated file from a killed run
        return {"junit_unreadable": repr(e)}


doc = {"wall_s": round(time.time() - start, 1), "status": load("status.json"), "versions": load("versions.json"),
       "nvidia_smi": text("nvidia-smi.txt", 4000), "topology": text("topo.txt", 4000),
       "extension": text("ext.log", 2000)}
for ranks in (2, 8):
    doc[f"tests_{ranks}_ranks"] = junit(f"junit{ranks}.xml")
    doc[f"pytest_{ranks}_ranks_tail"] = text(f"pytest{ranks}.log", 6000)
    step = load(f"step{ranks}.json")
    if step is not None:
        doc[f"bench_offload_step_{ranks}_ranks"] = step
    doc[f"bench_offload_step_{ranks}_ranks_log"] = text(f"step{ranks}.log", 3000)
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
nccl = {}
for log in sorted(glob.glob(os.path.join(work, "nccl", "nccl.*.log")))[:64]:
    lines = open(log, errors="replace").read().splitlines()
    keep = [l for l in lines if "WARN" in l or "NCCL version" in l or "Using network" in l or "via P2P" in l
            or "via SHM" in l or "Init COMPLETE" in l]
    nccl[os.path.basename(log)] = {"lines": len(lines), "kept": keep[:40], "tail": lines[-10:]}
doc["nccl_logs"] = {"dir": os.path.join(work, "nccl"), "files": nccl}
doc["nccl_flight_recorder_dumps"] = sorted(os.path.basename(p) for p in
                                           glob.glob(os.path.join(work, "nccl", "flight_recorder_rank_*")))
doc["work_dir"] = work
tmp = out + ".partial"
json.dump(doc, open(tmp, "w"), indent=1, default=str)
os.replace(tmp, out)
EOF
}

# ---- 1. the machine (and the GPU count: below 2, nothing to check) -------------------------------------------------
timeout 120 "$PY" - > "$WORK/versions.json" 2> "$WORK/versions.err" <<'EOF'
import json, os, platform, sys
import torch
d = {"python": sys.version.split()[0], "platform": platform.platform(), "torch": torch.__version__,
     "cuda_build": torch.version.cuda, "cuda_available": torch.cuda.is_available(),
     "device_count": torch.cuda.device_count() if torch.cuda.is_available() else 0, "cpus": os.cpu_count()}
if torch.cuda.is_available():
    d["devices"] = [{"name": torch.cuda.get_device_name(i), "capability": list(torch.cuda.get_device_capability(i)),
                     "memory_GiB": round(torch.cuda.get_device_properties(i).total_memory / 2**30, 1)}
                    for i in range(torch.cuda.device_count())]
    try:
        d["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    except Exception as e:  # noqa: BLE001
        d["nccl"] = repr(e)
for mod in ("transformers", "safetensors", "pytest", "numpy"):
    try:
        d[mod] = __import__(mod).__version__
    except Exception:  # noqa: BLE001
        d[mod] = None
print(json.dumps(d))
EOF
GPUS=$("$PY" -c "import json,sys; print(int(json.load(open(sys.argv[1])).get('device_count') or 0))" \
  "$WORK/versions.json" 2>/dev/null || echo 0)
status gpus "$GPUS"
if [ "$GPUS" -lt 2 ]; then
  status skipped "fewer than 2 CUDA GPUs"
  merge
  echo "multi_gpu_check: $GPUS CUDA GPU(s) here, 2 or more needed: nothing was checked (results in $RESULTS)" >&2
  exit 2
fi
echo "== multi_gpu_check: $GPUS GPUs; results -> $RESULTS (work dir $WORK, budget ${BUDGET}s)"
cat "$WORK/versions.json"; echo
timeout 60 nvidia-smi > "$WORK/nvidia-smi.txt" 2>&1
timeout 60 nvidia-smi topo -m > "$WORK/topo.txt" 2>&1
cat "$WORK/topo.txt"
merge

# ---- 2. the extension ---------------------------------------------------------------------------------------------
echo "== extension (JIT build)"
timeout -k 10 "$(min 300 "$(left)")" "$PY" -c \
  "from offload import _ext; _ext.require(); print('extension built at', _ext.build_dir())" > "$WORK/ext.log" 2>&1
RC_EXT=$?
tail -20 "$WORK/ext.log"
status extension_rc "$RC_EXT"
merge

# ---- 3. offload bench pcie: each GPU, then all at once -------------------------------------------------------------
if [ "$(left)" -gt 400 ]; then
  echo "== offload bench pcie ($GPUS GPUs, and all at once)"
  timeout -k 10 90 "$PY" -m offload.cli bench pcie --rounds 3 --sizes 1MiB,256MiB --json "$WORK/pcie.json" \
    > "$WORK/pcie.log" 2>&1
  status bench_pcie_rc $?
  tail -16 "$WORK/pcie.log"
  merge
fi

EIGHT='eight or 8_to_4'  # tests/test_cuda_multi_gpu.py's 8-rank tests (they skip below 8 GPUs)
run_tests() {  # run_tests RANKS SELECTION TIMEOUT
  echo "== pytest -m multi_gpu, $1 ranks (timeout ${3}s)"
  timeout -k 15 "$3" "$PY" -m pytest -m multi_gpu -k "$2" -q -rs ${MULTI_GPU_CHECK_PYTEST_FLAGS--x} --durations=15 \
    -p no:cacheprovider --junitxml="$WORK/junit$1.xml" tests 2>&1 | tee "$WORK/pytest$1.log"
  local rc=${PIPESTATUS[0]}
  status "pytest_${1}_ranks_rc" "$rc"
  { [ "$rc" = 124 ] || [ "$rc" = 137 ]; } && status "pytest_${1}_ranks_timed_out" true
  merge
  return "$rc"
}
run_step() {  # run_step RANKS THREADS TIMEOUT
  echo "== bench_offload_step, offload at $1 ranks (NCCL, 1 round; timeout ${3}s)"
  timeout -k 10 "$3" "$PY" benchmarks/bench_offload_step.py --contenders offload --world-size "$1" --rounds 1 \
    --steps 3 --warmup 1 --threads "$2" --no-bound --json "$WORK/step$1.json" > "$WORK/step$1.log" 2>&1
  status "bench_step_${1}_ranks_rc" $?
  tail -12 "$WORK/step$1.log"
  merge
}

# ---- 4. / 5. two ranks ---------------------------------------------------------------------------------------------
T=$(min 330 $(( $(left) - 150 )))
[ "$T" -lt 60 ] && T=60
run_tests 2 "not ($EIGHT)" "$T"
RC_2=$?
if [ "$(left)" -gt 100 ]; then
  run_step 2 4 "$(min 120 $(( $(left) - 60 )))"
else
  status bench_step_2_ranks "skipped: $(left) s of the budget left"
fi

# ---- 6. / 7. eight ranks ------------------------------------------------------------------------------------------
RC_8=0
if [ "$GPUS" -ge 8 ] && [ "$(left)" -gt 60 ]; then
  run_tests 8 "$EIGHT" "$(( $(left) - 10 ))"
  RC_8=$?
  if [ "$(left)" -gt 60 ]; then
    run_step 8 2 "$(( $(left) - 5 ))"
  else
    status bench_step_8_ranks "skipped: $(left) s of the budget left"
  fi
elif [ "$GPUS" -lt 8 ]; then
  status eight_ranks "skipped: $GPUS GPUs"
else
  status eight_ranks "skipped: $(left) s of the budget left"
fi
merge

echo "== multi_gpu_check: extension rc $RC_EXT, 2-rank tests rc $RC_2, 8-rank tests rc $RC_8," \
  "$(( $(date +%s) - START )) s; results in $RESULTS; NCCL logs in $WORK/nccl"
[ "$RC_EXT" = 0 ] && [ "$RC_2" = 0 ] && [ "$RC_8" = 0 ]
