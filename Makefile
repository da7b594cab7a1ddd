# The two quick-start commands (README): `make demo` and `make test`. Both create .venv in the
# repository and install what they need; running them again reuses it.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | sha256sum | cut -c1-12)

.PHONY: demo test venv proto bench bench-replay clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[dev]'
	rm -f $(VENV)/.installed-*
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(BIN)/guard demo $(ARGS)

test: $(STAMP)
	$(BIN)/python -m pytest $(ARGS)

proto: $(STAMP)
	$(BIN)/python -m grpc_tools.protoc -Iproto --python_out=. --pyi_out=. --grpc_python_out=. proto/guard/v1/*.proto proto/guard/xds/*.proto

bench: $(STAMP)
	$(BIN)/python benchmarks/proxy_overhead.py $(ARGS)

bench-replay: $(STAMP)
	$(BIN)/python benchmarks/replay_throughput.py $(ARGS)

clean:
	rm -rf $(VENV) .pytest_cache
