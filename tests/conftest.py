from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    # Triton kernels run in its interpreter on CPU. It must be set before anything imports
    # triton (xgrammar does): triton's own library functions are built at import time.
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, str(Path(__file__).parent))
torch.set_num_threads(1)
torch.set_flush_denormal(True)

from models import make_tiny_model  # noqa: E402


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
