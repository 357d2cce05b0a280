#!/usr/bin/env bash
# DeepSpeed for a GPU machine that cannot reach the network: its wheel (pure Python: its ops JIT-build when
# used) and its dependencies the GPU image lacks, built for that image's Python, into .whl/ (git-ignored).
# gpu_check.sh installs them from there when the directory is present (carry it to the machine):
#
#     bash benchmarks/deepspeed_wheels.sh          # here, with network; PYVER=3.12 by default
#
# torch, numpy, ninja, packaging, psutil and tqdm are the image's own; --no-deps keeps them.
set -euo pipefail
cd "$(dirname "$0")/.."
PYVER="${PYVER:-3.12}"
mkdir -p .whl
DS_BUILD_OPS=0 python3 -m pip wheel -q --no-deps --no-build-isolation -w .whl "deepspeed==${DEEPSPEED_VERSION:-0.19.8}"
python3 -m pip download -q -d .whl --python-version "$PYVER" --only-binary=:all: \
  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 hjson py-cpuinfo pydantic msgpack einops
ls .whl
