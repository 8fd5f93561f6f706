# One entry point. Each target sets up its own virtual environment first:
# torch==2.13.0 is installed before the project, so its plain torch requirement never pulls
# another build (which build: TORCH_INDEX below).
PY ?= python3.11
VENV ?= .venv
# where pip takes torch from: empty for pip's own configuration (PyPI's default build for
# the platform: CUDA on Linux x86), or e.g. https://download.pytorch.org/whl/cpu for the
# CPU-only build (make setup TORCH_INDEX=...; it applies when .venv is made: make clean first)
TORCH_INDEX ?=
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup demo dlrm codebert efficiency test test-fast bench gpu-check format clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0 $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	$(BIN)/pip install -q -e ".[dev]"
	touch $(STAMP)

demo: $(STAMP)  ## the main job: CoMERA and dense on MNLI's smoke preset vs the cue baseline (CPU)
	$(BIN)/python -m experiments.mnli.demo

dlrm: $(STAMP)  ## DLRM smoke: CoMERA and dense on generated Criteo-format data (CPU, ~1 min), then reports/dlrm.md
	$(BIN)/python -m experiments.dlrm.report --bench-json reports/dlrm_bench.json

codebert: $(STAMP)  ## CodeBERT smoke: CoMERA and dense MLM on the stdlib (CPU, ~5 min), then reports/codebert.md
	$(BIN)/python -m experiments.codebert.report --bench-json reports/codebert_bench.json

efficiency: $(STAMP)  ## the paper's Figure 1 on CPU (~20 min), then eager vs sync_free vs compile steps (~15 min)
	$(BIN)/python -m benchmarks.efficiency
	$(BIN)/python -m benchmarks.step_modes

bench: $(STAMP)  ## core and loader benchmarks (write reports/); every benchmark: docs/benchmarks.md
	$(BIN)/python -m benchmarks.core
	$(BIN)/python -m benchmarks.loader

test: $(STAMP)  ## lint, format check, then the whole test suite
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/python -m pytest

test-fast: $(STAMP)  ## lint, then every test not marked slow (a few minutes on 2 cores)
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -m "not slow"

gpu-check: $(STAMP)  ## on a CUDA machine: GPU-path tests, DLRM lookup, core bench, step modes, MNLI step (reports/gpu/)
	PY=$(BIN)/python bash scripts/gpu_check.sh

format: $(STAMP)
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
