from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))


def pytest_configure(config):
    """The default run is the CPU suite on every machine: where a GPU is present but the run
    does not select the `gpu` tests (`pytest -m gpu`), CUDA is hidden before anything starts
    it, so engines with device "auto" run on CPU in float32 as everywhere else, and the Triton
    kernels in Triton's interpreter. That must be set before anything imports triton (xgrammar
    does): triton's own library functions are built at import time."""
    expr = config.getoption("markexpr") or ""
    if "gpu" not in expr.replace("not gpu", ""):
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    torch.set_num_threads(1)
    torch.set_flush_denormal(True)


def make_tiny_model(*args, **kwargs) -> Path:
    from models import make_tiny_model as make  # after pytest_configure: imports transformers

    return make(*args, **kwargs)


@pytest.fixture(scope="session")
def thinking_qwen3(tmp_path_factory) -> Path:
    """A tiny random Qwen3 with Qwen3's chat template and think tags (make_thinking_qwen3)."""
    from models import make_thinking_qwen3

    return make_thinking_qwen3(tmp_path_factory.mktemp("thinking-qwen3"))


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny-llama"), "llama")


@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny-qwen2"), "qwen2")


@pytest.fixture(scope="session")
def draft_model(tmp_path_factory) -> Path:
    """Another random Llama with tiny_llama's shapes and vocabulary: a draft that mostly misses."""
    return make_tiny_model(tmp_path_factory.mktemp("draft"), "llama", seed=1)
