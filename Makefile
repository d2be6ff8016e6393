# gpupool: `make run` serves the default config; `make test` sets up and runs every check.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
VLLM_VENV := .venv-vllm
MODELS := .models
STAMP := $(VENV)/.installed

.PHONY: install run docs docs-build docs-ref test check test-stress lint typecheck unit vllm-setup models ops-deps docker-deps docker-test bench-deps bench bench-routing bench-throughput gpu-bundle clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

run: install
	$(BIN)/gpupool serve --config config/gpupool.yaml

LINT_PATHS := gpupool tests bench scripts docker/grafana

# The documentation site (mkdocs.yml): `make docs` serves it with live reload; `make docs-build`
# writes site/, which opens offline. `make docs-ref` regenerates the reference pages from the code
# (config fields, commands, metrics, endpoints); `make test` fails when they differ.
DOCS_ADDR ?= 127.0.0.1:8008

docs: install
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs serve --dev-addr $(DOCS_ADDR)

docs-build: install
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

docs-ref: install
	$(BIN)/python scripts/gen_reference.py

lint: install
	$(BIN)/ruff check $(LINT_PATHS)
	$(BIN)/ruff format --check $(LINT_PATHS)
	$(BIN)/python docker/grafana/generate.py --check

typecheck: install
	$(BIN)/mypy

vllm-setup:
	bash scripts/setup_vllm.sh $(VLLM_VENV)

models: vllm-setup
	$(VLLM_VENV)/bin/python scripts/make_tiny_models.py $(MODELS)

ops-deps:
	bash scripts/install_ops_deps.sh

# Debian's docker.io, docker-compose and debootstrap: tests/deploy/test_stack.py starts its own
# dockerd (own socket and data root) and builds every image it runs (docs/getting-started/compose.md).
docker-deps:
	bash scripts/install_ops_deps.sh docker

# The gateway image built and run: a Compose stack of two gateways, Redis, Prometheus and
# simulated workers found by DNS; a gateway killed under load; the workers scaled 2 -> 3 -> 1.
# The base image's tarball is cached in .cache/docker, the wheels in docker/wheels.
docker-test: install docker-deps ops-deps
	$(BIN)/pytest -q -s tests/deploy tests/deploy/test_docker_files.py

unit: install
	$(BIN)/pytest -q -m "not vllm"

# Every run ends with the 30 slowest tests and the time per test folder (tests/support/timing.py).
TIMING ?= --timing=30
# pytest-xdist workers: each test file runs whole on one; real vLLM and the Docker stack share one
# unit, so they never run beside each other (tests/support/parallel.py). JOBS=1: serially. `make
# test` runs 3 (the gate: its heavy unit takes both cores), `make check` 5: its tests mostly wait
# on servers (1,900 s of test time for 900 s of CPU at 3), so two more workers fill the cores.
JOBS ?=
XDIST = $(if $(filter 1,$(1)),,-n $(1))

# The gate: lint, types and every test, real vLLM, Docker and the browser included. The throughput
# guard runs after the rest, alone: it measures the gateway against direct calls, and beside the
# suite's other workers it measured them (single rounds at 0.31-0.45 of direct).
test: install lint typecheck models ops-deps docker-deps
	GPUPOOL_VLLM_PYTHON=$(CURDIR)/$(VLLM_VENV)/bin/python GPUPOOL_TINY_MODELS=$(CURDIR)/$(MODELS) \
		$(BIN)/pytest -q $(call XDIST,$(or $(JOBS),3)) -m "not throughput" $(TIMING)
	$(BIN)/pytest -q -m throughput $(TIMING)

# The inner loop (DEVELOPING.md): lint, types and every test that needs no real vLLM, Docker or
# browser, nor the throughput guard (a measurement: it wants the CPUs its 5 workers take).
check: install lint typecheck
	$(BIN)/pytest -q $(call XDIST,$(or $(JOBS),5)) -m "not (vllm or docker or browser or throughput)" --timing=10

# The tests marked `timing` N times beside two CPU burners (scripts/stress_tests.sh).
N ?= 5
test-stress: install
	GPUPOOL_VLLM_PYTHON=$(CURDIR)/$(VLLM_VENV)/bin/python GPUPOOL_TINY_MODELS=$(CURDIR)/$(MODELS) \
		bash scripts/stress_tests.sh $(N)

# wrk and nginx for the bench's wrk phase; without them (no root) that phase reports why and the
# others run.
bench-deps:
	-bash scripts/install_ops_deps.sh bench

bench: install bench-deps
	$(BIN)/python bench/run.py

# The offline vLLM + gpupool bundle for the H200 lane, in parts under .gpu/ (scripts/gpu_lane/README.md)
gpu-bundle: install
	PYTHON=$(BIN)/python bash scripts/gpu_lane/make_bundle.sh .gpu

# Routing quality on real vLLM (needs `make models`' .venv-vllm); ARGS: see bench/routing/run.py.
bench-routing: install
	$(BIN)/python bench/routing/run.py $(ARGS)

# Does routing cost tokens/s? gpupool against clients pinned evenly on two GPU-shaped simulators,
# per round and per worker (the throughput guard in `make test` runs the same); ARGS: --help.
bench-throughput: install
	$(BIN)/python bench/throughput.py $(ARGS)

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(MODELS) .gpupool .mypy_cache .ruff_cache .pytest_cache
