#!/usr/bin/env bash
# The GPU check, prepared to run in one go on a lent GPU machine (the device tool runs it in a
# copy of the working tree; results go to $OUT). It installs nothing big: it uses the machine's
# own CUDA-enabled torch if there is one, else says so and stops.
#   usage: bash benchmarks/gpu_check.sh            (OUT defaults to ./gpu-out)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
{
  date -u
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>&1
  $PY -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.is_available())'
} | tee "$OUT/machine.txt"
if ! $PY -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)'; then
  echo "no CUDA-enabled torch on this machine: nothing to check" | tee -a "$OUT/machine.txt"
  exit 1
fi
# guard's own light dependencies (no torch: the machine's CUDA build is kept).
$PY -m pip install -q --no-deps -e . 2>&1 | tail -2
$PY -m pip install -q numpy grpcio grpcio-health-checking 'protobuf>=6.33.5,<7' \
  'tritonclient[grpc]' prometheus-client pydantic pyyaml opentelemetry-api onnx onnxruntime \
  pytest pytest-timeout 2>&1 | tail -2
$PY -m pytest tests/gpu -v -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests.txt"
# The GPU matrix (the seed paper's study with causes named): summary under $OUT/matrix-gpu.
$PY -m pip install -q matplotlib 2>&1 | tail -1
$PY -m guard matrix configs/matrix/gpu.yaml --output-dir "$OUT/matrix-gpu" 2>&1 | tail -40 \
  | tee "$OUT/matrix_gpu.txt"
