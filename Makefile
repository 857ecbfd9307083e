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
# distill: the LLM writes continuations of the prompt set's train split (resumable; rerun to resume),
# with the top-64 of its next-token distribution at every output token (--top-k-probs K; 0: off).
# Sampled data: DISTILL_FLAGS="--do-sample --temperature 0.8 --num-samples 4 ..." (one row per sample).
# Several domains: DISTILL_PROMPTS=SET[:N],SET[:N],... (bundled names or files, no spaces; N: at most
# N train prompts of that set): each set split into train / held-out by itself, the train splits
# mixed, every row's set in the column `source`. Into ARTIFACTS/distill/<name>: the set's name or
# file stem, for a list the names joined with "+" without the caps (e.g. tinystories_openings+gsm8k).
DISTILL_LLM ?= $(ARTIFACTS)/reference-llm/tiny/model
DISTILL_PROMPTS ?= tinystories_openings
# $(call distill_name,PROMPTS): that folder name (what `distill` without --out names it, too)
comma := ,
space := $(subst ,, )
distill_name = $(subst $(space),+,$(foreach set,$(subst $(comma),$(space),$(1)),$(basename $(notdir $(firstword $(subst :,$(space),$(set)))))))
DISTILL_FLAGS ?= --max-new-tokens 64 --batch-size 16
# boost: collective boost-tuning of an SSM pool on the distilled data (resumable; rerun to resume).
# BOOST_FLAGS="--loss ce|kl|tv|mix --boost-mode greedy|sampled ...": kl / tv / mix and the sampled
# mode train on the distributions distill stored (ALGORITHMS.md section 15).
BOOST_LLM ?= $(ARTIFACTS)/reference-llm/tiny/model
BOOST_DISTILLED ?= $(ARTIFACTS)/distill/$(call distill_name,$(DISTILL_PROMPTS))
BOOST_OUT ?= $(ARTIFACTS)/pool
BOOST_FLAGS ?=
# export: the boost run's pool as a hub-style folder; HUB_REPO=ORG/NAME also pushes it (needs `hf auth login`).
EXPORT_BOOST ?= $(ARTIFACTS)/pool
EXPORT_OUT ?= $(ARTIFACTS)/pool-export
HUB_REPO ?=
# Learned scheduler: labels from distilled data of a prompt set the pool never trained on, the
# predictor and the hardware profile go into the boost run (so `make export` ships them).
SCHED_LLM ?= $(BOOST_LLM)
SCHED_POOL ?= $(BOOST_OUT)
SCHED_PROMPTS ?= gutenberg_openings
SCHED_DISTILLED ?= $(ARTIFACTS)/distill/$(call distill_name,$(SCHED_PROMPTS))
PREDICTOR_DATA ?= $(ARTIFACTS)/predictor-data
PREDICTOR_DATA_FLAGS ?= --threads 1
SCHED_EVAL_FLAGS ?= --max-prompts 8 --max-new-tokens 64 --repeats 3 --threads 1
# demo: the whole offline loop on the tiny reference LLM (the targets below, in order), then
# `specboost bench --suite demo` on the exported pool: every single-file bench row plus Sequoia and
# the learned scheduler, greedy, on 8 held-out Gutenberg openings (books kept out of the corpus,
# prompts kept out of the predictor's labels). Report in ARTIFACTS/demo-bench.
# The pool learns from a mix of domains, 180 train prompts as one set's train split gave before:
# stories, instructions, factoid questions and math (whose wrong answers the tiny LLM's data keeps:
# it cannot do the math, and the SSMs are to predict what it writes).
DEMO_LLM := $(ARTIFACTS)/reference-llm/tiny/model
DEMO_PROMPTS ?= tinystories_openings:60,self_instruct_seed:40,eagle_qa:40,gsm8k:40
DEMO_DISTILL_FLAGS ?= $(DISTILL_FLAGS) --keep-wrong-answers
DEMO_DISTILLED = $(ARTIFACTS)/distill/$(call distill_name,$(DEMO_PROMPTS))
# A pool of specialists (ALGORITHMS.md 4.1): the 3 SSMs split the mix among themselves by EM, each
# SSM's 400 steps spread over 2 rounds, the same 1200 steps as greedy boosting; EM adds only the
# E-steps' scoring passes (each tiny SSM over the ~160 training samples, once per round).
DEMO_BOOST_FLAGS ?= --max-steps 400 --boost-mode specialists --em-rounds 4 --em-span 8
DEMO_BENCH_FLAGS ?= --max-new-tokens 64 --repeats 3 --warmup 1 --threads 1
# check-deepspeed: DeepSpeed (the optional `deepspeed` extra) lives in its own venv, never in .venv or CI's.
DS_VENV  := .venv-deepspeed
DS_BIN   := $(DS_VENV)/bin
DS_STAMP := $(DS_VENV)/.installed

.PHONY: install test check-wheel lint format example bench-decoder reference-llm distill boost export demo check-deepspeed clean \
	predictor-data predictor profile scheduler-eval

install: $(STAMP)

# torch comes first and pinned, so that pip takes the local CPU wheel and never a CUDA build.
# setuptools and wheel too: `make check-wheel` builds the wheel with this venv's (no build isolation).
$(STAMP): pyproject.toml setup.py
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip 'setuptools>=77' wheel
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $(STAMP)

test: $(STAMP)
	$(BIN)/ruff check .
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -q  # tests never reach a hub

# The package as users get it: build the wheel, install it alone into a fresh venv outside the
# checkout (its dependencies reused from .venv through a .pth file, nothing downloaded) and, from
# another folder, check imports, data, --help/--version, generate and serve (tests/check_installed.py).
WHEEL_CHECK ?= /tmp/specboost-wheel-check

check-wheel: $(STAMP)
	rm -rf $(WHEEL_CHECK) build
	mkdir -p $(WHEEL_CHECK)/work
	$(BIN)/pip wheel --quiet --no-deps --no-build-isolation --wheel-dir $(WHEEL_CHECK)/dist .
	rm -rf build
	$(PYTHON) -m venv --without-pip $(WHEEL_CHECK)/venv
	$(BIN)/pip --python $(WHEEL_CHECK)/venv/bin/python install --quiet --no-deps $(WHEEL_CHECK)/dist/*.whl
	$(BIN)/python -c "import sysconfig; print(sysconfig.get_path('purelib'))" \
		> "$$($(WHEEL_CHECK)/venv/bin/python -c "import sysconfig; print(sysconfig.get_path('purelib'))")/specboost-deps.pth"
	cd $(WHEEL_CHECK)/work && HF_HUB_OFFLINE=1 $(WHEEL_CHECK)/venv/bin/python $(CURDIR)/tests/check_installed.py \
		--checkout $(CURDIR) --work $(WHEEL_CHECK)/work

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: $(STAMP)
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

# The README's decoding example, on tiny models built from configs.
example: $(STAMP)
	$(BIN)/python -m specboost.decoder.example

# Greedy bench on one prompt file: plain generate vs HF assisted vs our modes; report on stdout,
# report.md, bench.json and plots in artifacts/bench-decoder.
bench-decoder: $(STAMP)
	$(BIN)/python -m specboost.decoder.tiny_models --preset bench --out $(ARTIFACTS)/bench-models
	$(BIN)/specboost bench --llm $(LLM) --ssm $(SSMS) --prompts $(PROMPTS) $(BENCH_FLAGS) \
		--out $(ARTIFACTS)/bench-decoder

# Benchmark suite: training/bench_fixture.py builds (or reuses) the fixture in
# ARTIFACTS/bench-fixture/<fixture> (reference LLM, a mix of domains distilled, a pool of
# specialists, predictor, hardware profile, Sequoia acceptance, export; then a generalist SSM on the
# same data and steps, which serves the `generalist` rows; then a pool boosted for sampling, which
# serves the sampled rows), then `specboost bench --suite` runs every method on the bundled held-out workloads;
# report.md, suite.json and plots go to ARTIFACTS/bench-suite/<fixture>.
# SUITE=quick: the tiny fixture (minutes); FIXTURE=tiny|small overrides the suite's fixture;
# SUITE_FLAGS="--readme README.md" also writes the full results into docs/results.md and the headline
# table into README.md ("--build-threads N": training threads).
SUITE ?= default
FIXTURE ?=
SUITE_FLAGS ?=
.PHONY: bench

bench: $(STAMP)
	$(BIN)/python -m specboost.training.bench_fixture --suite $(SUITE) --artifacts $(ARTIFACTS) \
		$(if $(FIXTURE),--fixture $(FIXTURE)) $(SUITE_FLAGS)

# Tokenizer + Llama trained on data/corpus; reruns resume from OUT/checkpoints or skip a finished run.
reference-llm: $(STAMP)
	$(BIN)/python -m specboost.training.reference_llm --preset $(PRESET) --out $(OUT) $(if $(THREADS),--threads $(THREADS))

# Needs the LLM first: `make reference-llm` (the default DISTILL_LLM) or DISTILL_LLM=PATH.
# Into ARTIFACTS/distill/$(call distill_name,DISTILL_PROMPTS) (see DISTILL_PROMPTS above).
distill: $(STAMP)
	$(BIN)/python -m specboost.training.distill --llm $(DISTILL_LLM) --prompts $(DISTILL_PROMPTS) \
		--out $(ARTIFACTS)/distill/$(call distill_name,$(DISTILL_PROMPTS)) $(DISTILL_FLAGS)

# Needs a finished boost run in EXPORT_BOOST (ssm-i/ + boost_record.json).
export: $(STAMP)
	$(BIN)/python -m specboost.training.export --boost $(EXPORT_BOOST) --out $(EXPORT_OUT) $(if $(HUB_REPO),--hub-repo $(HUB_REPO))

# Needs the distilled data first: `make distill`. Pool in BOOST_OUT/ssm-*, record and coverage.png.
boost: $(STAMP)
	$(BIN)/python -m specboost.training.boost --distilled $(BOOST_DISTILLED) --llm $(BOOST_LLM) --out $(BOOST_OUT) $(BOOST_FLAGS)

# Labels for the match-length predictor (resumable): distills SCHED_PROMPTS first if needed.
predictor-data: $(STAMP)
	$(MAKE) distill DISTILL_LLM=$(SCHED_LLM) DISTILL_PROMPTS=$(SCHED_PROMPTS)
	$(BIN)/python -m specboost.training.predictor_data --llm $(SCHED_LLM) --ssm $(SCHED_POOL)/ssm-* \
		--distilled $(SCHED_DISTILLED) --out $(PREDICTOR_DATA) $(PREDICTOR_DATA_FLAGS)

# The 3-layer MLP predictor, into the boost run folder (SCHED_POOL/predictor).
predictor: $(STAMP)
	$(BIN)/python -m specboost.training.train_predictor --labels $(PREDICTOR_DATA) --out $(SCHED_POOL)/predictor

# Verify / speculation latencies of this machine, eager and compiled, greedy and sampled chains, into
# SCHED_POOL/hardware_profile.json.
profile: $(STAMP)
	$(BIN)/specboost profile --llm $(SCHED_LLM) --ssm $(SCHED_POOL)/ssm-* --out $(SCHED_POOL)/hardware_profile.json --threads 1 --compile --sampled

# Learned scheduler vs every fixed beam shape vs the oracle, on held-out prompts (exports the pool first).
scheduler-eval: $(STAMP)
	$(MAKE) export EXPORT_BOOST=$(SCHED_POOL)
	$(BIN)/specboost bench --suite scheduler --llm $(SCHED_LLM) --pool $(EXPORT_OUT) \
		--prompts $(SCHED_PROMPTS) $(SCHED_EVAL_FLAGS) --out $(ARTIFACTS)/scheduler-eval

# Sequoia (ALGORITHMS.md 8): every SSM's positional acceptance vector on the boost run's held-out
# distilled samples, into BOOST_OUT/sequoia_acceptance.json (`make export` ships it for strategy="sequoia").
SEQUOIA_FLAGS ?= --threads 1
# strategy-compare: Sequoia trees vs k chains, majority vs single SSMs, adaptive vs fixed lengths (exports first).
STRATEGY_COMPARE_FLAGS ?= --max-prompts 5 --max-new-tokens 64 --repeats 2 --threads 1
.PHONY: sequoia-acceptance strategy-compare

sequoia-acceptance: $(STAMP)
	$(BIN)/python -m specboost.training.sequoia_trees --llm $(BOOST_LLM) --ssm $(BOOST_OUT)/ssm-* \
		--distilled $(BOOST_DISTILLED) --held-out-from $(BOOST_OUT)/boost_record.json $(SEQUOIA_FLAGS) \
		--out $(BOOST_OUT)/sequoia_acceptance.json

strategy-compare: $(STAMP)
	test -f $(BOOST_OUT)/sequoia_acceptance.json || $(MAKE) sequoia-acceptance
	$(MAKE) export EXPORT_BOOST=$(BOOST_OUT)
	$(BIN)/specboost bench --suite strategies --llm $(BOOST_LLM) --pool $(EXPORT_OUT) \
		$(STRATEGY_COMPARE_FLAGS) --out $(ARTIFACTS)/strategy-compare

# Batched decoding (BASS) and the serving engine with and without pipelining (Minions) vs plain
# batched generate at batch sizes 1-16, greedy (~8 minutes on 2 cores); needs the demo's LLM and pool.
BATCH_BENCH_FLAGS ?= --llm $(ARTIFACTS)/reference-llm/tiny/model --ssm $(ARTIFACTS)/pool/ssm-0 \
	--num-prompts 32 --max-new-tokens 48 --repeats 3 --threads 1
.PHONY: bench-batched

bench-batched: $(STAMP)
	$(BIN)/specboost bench --suite batched $(BATCH_BENCH_FLAGS) --out $(ARTIFACTS)/batch-bench

# Server load: N concurrent streamed requests on held-out prompts against `specboost serve`, speculation
# on (the pool's manifest defaults) vs off (--strategy plain), both servers started in one process;
# report in ARTIFACTS/serve-bench. Default: the small fixture's LLM and pool (`make bench` builds them).
SERVE_LLM ?= $(ARTIFACTS)/reference-llm/small/model
SERVE_POOL ?= $(ARTIFACTS)/bench-fixture/small/pool-export
SERVE_BENCH_FLAGS ?= --requests 64 --concurrency 8 --max-tokens 64 --rounds 2 --threads 1
.PHONY: bench-serve

bench-serve: $(STAMP)
	$(BIN)/python -m specboost.decoder.bench.serve_load --llm $(SERVE_LLM) --pool $(SERVE_POOL) \
		$(SERVE_BENCH_FLAGS) --out $(ARTIFACTS)/serve-bench

# Serve the demo's pool on 127.0.0.1:8000 (OpenAI-compatible; SERVE_FLAGS="--api-key KEY ...").
SERVE_FLAGS ?=
.PHONY: serve

serve: $(STAMP)
	$(BIN)/specboost serve --llm $(DEMO_LLM) --pool $(EXPORT_OUT) $(SERVE_FLAGS)

# From a fresh clone, nothing downloaded: reference LLM (tiny) -> distill -> boost -> predictor
# labels (distilling SCHED_PROMPTS first) -> predictor -> this machine's hardware profile -> Sequoia
# acceptance vectors -> export (the pool with all three, so strategy="learned" and "sequoia" run on
# it) -> tokens/step and speedup of every method vs the LLM alone (and HF assisted generation).
demo: $(STAMP)
	$(MAKE) reference-llm PRESET=tiny
	$(MAKE) distill DISTILL_LLM=$(DEMO_LLM) DISTILL_PROMPTS=$(DEMO_PROMPTS) DISTILL_FLAGS="$(DEMO_DISTILL_FLAGS)"
	$(MAKE) boost BOOST_LLM=$(DEMO_LLM) BOOST_DISTILLED=$(DEMO_DISTILLED) BOOST_FLAGS="$(DEMO_BOOST_FLAGS)"
	$(MAKE) predictor-data SCHED_LLM=$(DEMO_LLM)
	$(MAKE) predictor
	$(MAKE) profile SCHED_LLM=$(DEMO_LLM)
	$(MAKE) sequoia-acceptance BOOST_LLM=$(DEMO_LLM) BOOST_DISTILLED=$(DEMO_DISTILLED)
	$(MAKE) export EXPORT_BOOST=$(BOOST_OUT)
	$(BIN)/specboost bench --suite demo --llm $(DEMO_LLM) --pool $(EXPORT_OUT) $(DEMO_BENCH_FLAGS) \
		--out $(ARTIFACTS)/demo-bench

# torch first and pinned again beside the extra, so that pip keeps the local CPU wheel (DeepSpeed
# only asks for torch>=2); DeepSpeed's setup is run against that torch (no build isolation), and
# DS_ACCELERATOR=cpu keeps it from adding GPU packages.
$(DS_STAMP): pyproject.toml setup.py
	$(PYTHON) -m venv $(DS_VENV)
	$(DS_BIN)/pip install --quiet --upgrade pip 'setuptools>=77' wheel
	$(DS_BIN)/pip install --quiet torch==2.13.0
	DS_ACCELERATOR=cpu $(DS_BIN)/pip install --quiet --no-build-isolation -e '.[dev,deepspeed]' torch==2.13.0
	touch $(DS_STAMP)

# Boost-tuning under the shipped ZeRO-2 and ZeRO-3 configs (2 processes, on the CPU here) on tiny
# models, checked (training/check_deepspeed.py); DeepSpeed's JIT-built op is kept in the venv.
check-deepspeed: $(DS_STAMP)
	TORCH_EXTENSIONS_DIR=$(CURDIR)/$(DS_VENV)/torch-extensions HF_HUB_OFFLINE=1 \
		$(DS_BIN)/python -m specboost.training.check_deepspeed --out $(ARTIFACTS)/deepspeed-check

clean:
	rm -rf $(ARTIFACTS) .pytest_cache .ruff_cache .hypothesis
