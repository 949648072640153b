"""The pytest-benchmark suite: `make bench` (or `make bench QUICK=1`) runs it; `make test` never
collects it (the test command reads tests/ only, and these files are named bench_*.py)."""

from __future__ import annotations

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("tandem bench")
    group.addoption("--quick", action="store_true", help="the quick subset (make bench QUICK=1)")
    group.addoption(
        "--llama-cpp",
        default=None,
        help="folder with llama.cpp's tools (default: $TANDEM_LLAMA_CPP, else .llama.cpp/build/bin "
        "from `make llama-server`; absent: skipped)",
    )
    group.addoption(
        "--vllm-venv",
        default=None,
        help="venv with vLLM's CPU build (default: $TANDEM_VLLM_VENV, else .venv-vllm from "
        "`make vllm-cpu`; absent: skipped)",
    )
    group.addoption("--repeats", type=int, default=3, help="alternating rounds per group")


def pytest_benchmark_update_json(config: pytest.Config, benchmarks, output_json: dict) -> None:
    """Saved runs say which subset ran: a quick run's benchmarks do less work than a full run's
    of the same name, so bench.compare compares only runs of one kind."""
    output_json["suite"] = {"quick": bool(config.getoption("quick"))}
