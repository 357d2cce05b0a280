#!/usr/bin/env bash
# One GPU at user scale (issue 42, section 2), one command from the repository root on the GPU machine (no network):
#
#     bash benchmarks/gpu_scale.sh               # the default runs; figures in ${OUT:-.}/gpu_scale.json (+ .log)
#     bash benchmarks/gpu_scale.sh --tiny        # the same code path with a tiny model, on any machine (CPU test)
#     bash benchmarks/gpu_scale.sh --dry-run     # the runs, their limits and settings; nothing runs
#
# Extra arguments go to benchmarks/gpu_scale.py (--runs NAME,..., --steps N, ...; its docstring says what each
# run is and what is measured). Stages: DeepSpeed from .whl/ when it was carried along (wheels_env.sh, as
# gpu_check.sh does), the C++ extension JIT-built (about 20 s on the H200), then gpu_scale.py with what is left of
# GPU_SCALE_BUDGET_S (default 530: the whole script within 9 minutes), every run in its own process under its own
# time limit, the JSON rewritten after each run (a run cut short keeps what it measured).
# Exit status: gpu_scale.py's (0 when every run that started finished), 124 when the budget ran out.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
PY="${PYTHON:-python}"
case " $* " in *" --dry-run "*) exec "$PY" benchmarks/gpu_scale.py "$@" ;; esac
OUTDIR="${OUT:-.}"
mkdir -p "$OUTDIR"
BUDGET="${GPU_SCALE_BUDGET_S:-530}"
START=$(date +%s)
left() { echo $(( BUDGET - ($(date +%s) - START) )); }

. benchmarks/wheels_env.sh
if command -v nvidia-smi >/dev/null 2>&1; then
  timeout 30 nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
fi
echo "== extension (JIT build)"
timeout -k 5 180 "$PY" -c "from offload import _ext; _ext.require(); print('extension built at', _ext.build_dir())" \
  2>&1 | tail -5
echo "== gpu_scale.py ($(left) s left)"
timeout -k 10 "$(left)" "$PY" benchmarks/gpu_scale.py --budget-s "$(( $(left) - 15 ))" \
  --json "$OUTDIR/gpu_scale.json" "$@" 2>&1 | tee "$OUTDIR/gpu_scale.log"
exit "${PIPESTATUS[0]}"
