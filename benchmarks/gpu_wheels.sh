#!/usr/bin/env bash
# The wheels benchmarks/gpu_check.sh installs on a GPU machine that reaches no package index:
# guard's light dependencies that a CUDA image with torch usually lacks, at the versions this
# project's venv has, as CPython manylinux x86-64 wheels for the GPU machine's Python (3.12 by
# default, GPU_PYTHON to change it). They land in .whl/ (git-ignored), about 12 MB; carry that
# folder to the GPU machine beside the checkout and run gpu_check.sh there.
#   usage: bash benchmarks/gpu_wheels.sh          (after `make venv`: it reads .venv's versions)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
PACKAGES="pydantic pydantic_core annotated-types typing-inspection grpcio grpcio-health-checking
  protobuf tritonclient python-rapidjson opentelemetry-api"
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
