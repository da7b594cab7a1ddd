#!/usr/bin/env bash
# The GPU check, prepared to run in one go on a lent GPU machine (the device tool runs it in a
# copy of the working tree; results go to $OUT). It installs nothing big: it uses the machine's
# own CUDA-enabled torch if there is one, else says so and stops.
#   usage: bash benchmarks/gpu_check.sh            (OUT defaults to ./gpu-out)
#
# guard's light dependencies the machine lacks (pydantic, tritonclient, grpcio-health-checking,
# opentelemetry-api, ...) come from PyPI, or, on a machine that reaches no package index, from
# wheels carried in .whl/ (made by benchmarks/gpu_wheels.sh), installed into /tmp/site. guard
# itself runs from the checkout (PYTHONPATH): an editable install needs setuptools from the index.
#
# Output under $OUT: gpu_check.log (the machine, the tests, the rest as printed),
# gpu_trace_calls.{md,json} (benchmarks/gpu_trace_calls.py) and matrix-gpu/ (the matrix's
# records.jsonl, summary.md, summary.json, heatmap.png): 7 files, under the device tool's 8.
# Time: GPU_TEST_TIMEOUT_S (default 240) for tests/gpu, GPU_MATRIX_TIMEOUT_S (default 420) for
# the matrix, whose records.jsonl is written as it goes (a cut-short run keeps what it did).
# On an H200 the whole check took 99 s (2026-12-04).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
{
  date -u
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>&1
  grep -m1 "model name" /proc/cpuinfo; echo "cores: $(nproc)"
  $PY -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.is_available())'
} | tee "$OUT/gpu_check.log"
if ! $PY -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)'; then
  echo "no CUDA-enabled torch on this machine: nothing to check" | tee -a "$OUT/gpu_check.log"
  exit 1
fi
if compgen -G ".whl/*.whl" >/dev/null; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl 2>&1 | tail -2
  export PYTHONPATH=/tmp/site:$PWD
else  # a machine with a package index: guard's own light dependencies, torch kept as it is
  $PY -m pip install -q numpy grpcio grpcio-health-checking 'protobuf>=6.33.5,<7' \
    'tritonclient[grpc]' prometheus-client pydantic pyyaml opentelemetry-api onnx onnxruntime \
    onnxscript pytest pytest-timeout pytest-xdist matplotlib 2>&1 | tail -2
  export PYTHONPATH=$PWD
fi
$PY -c 'import guard.backends, tritonclient.grpc, pydantic; print("guard imports")' 2>&1 \
  | tee -a "$OUT/gpu_check.log"
timeout "${GPU_TEST_TIMEOUT_S:-240}" $PY -m pytest tests/gpu -v -p no:cacheprovider \
  -o addopts=-ra 2>&1 | tee -a "$OUT/gpu_check.log"
# A trace's baked cuDNN flags on CUDA, call by call (what the first matrix's cuda_eager found).
timeout 180 $PY benchmarks/gpu_trace_calls.py --out "$OUT" 2>&1 | tee -a "$OUT/gpu_check.log"
# The GPU matrix (the seed paper's study with causes named): summary under $OUT/matrix-gpu.
timeout "${GPU_MATRIX_TIMEOUT_S:-420}" $PY -m guard matrix configs/matrix/gpu.yaml \
  --output-dir "$OUT/matrix-gpu" 2>&1 | tee -a "$OUT/gpu_check.log"
echo "matrix exit: ${PIPESTATUS[0]}" | tee -a "$OUT/gpu_check.log"
