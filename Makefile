# specboost — every target creates .venv and installs into it when needed.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
ARTIFACTS ?= artifacts

# bench-decoder inputs: the "bench" stand-in models by default (override with real model folders).
LLM ?= $(ARTIFACTS)/bench-models/llm
SSMS ?= $(ARTIFACTS)/bench-models/ssm-0 $(ARTIFACTS)/bench-models/ssm-1
PROMPTS ?= data/prompts/bench_prompts.txt
BENCH_FLAGS ?= --max-new-tokens 64 --max-prompts 8 --repeats 3 --warmup 1 --threads 1

# reference-llm: PRESET=tiny (demo, minutes) or small (benchmarks, ~1 h on 2 cores); THREADS= sets torch threads.
PRESET ?= tiny
OUT ?= $(ARTIFACTS)/reference-llm/$(PRESET)
THREADS ?=
# distill: the LLM writes continuations of the prompt set's train split (resumable; rerun to resume).
DISTILL_LLM ?= $(ARTIFACTS)/reference-llm/tiny/model
DISTILL_PROMPTS ?= tinystories_openings
DISTILL_FLAGS ?= --max-new-tokens 64 --batch-size 16

.PHONY: install test lint format example bench-decoder reference-llm distill clean

install: $(STAMP)

# torch comes first and pinned, so that pip takes the local CPU wheel and never a CUDA build.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $(STAMP)

test: $(STAMP)
	$(BIN)/ruff check .
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -q  # tests never reach a hub

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: $(STAMP)
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

# The README's decoding example, on tiny models built from configs.
example: $(STAMP)
	$(BIN)/python -m specboost.decoder.example

# Greedy bench: plain generate vs HF assisted vs our modes; table on stdout, JSON in artifacts/.
bench-decoder: $(STAMP)
	$(BIN)/python -m specboost.decoder.tiny_models --preset bench --out $(ARTIFACTS)/bench-models
	$(BIN)/specboost bench --llm $(LLM) --ssm $(SSMS) --prompts $(PROMPTS) $(BENCH_FLAGS) \
		--out $(ARTIFACTS)/bench-decoder

# Tokenizer + Llama trained on data/corpus; reruns resume from OUT/checkpoints or skip a finished run.
reference-llm: $(STAMP)
	$(BIN)/python -m specboost.training.reference_llm --preset $(PRESET) --out $(OUT) $(if $(THREADS),--threads $(THREADS))

# Needs the LLM first: `make reference-llm` (the default DISTILL_LLM) or DISTILL_LLM=PATH.
distill: $(STAMP)
	$(BIN)/python -m specboost.training.distill --llm $(DISTILL_LLM) --prompts $(DISTILL_PROMPTS) $(DISTILL_FLAGS)

clean:
	rm -rf $(ARTIFACTS) .pytest_cache .ruff_cache .hypothesis
