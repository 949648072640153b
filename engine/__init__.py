"""Tandem engine: paged KV cache, continuous batching, prefix caching.

The public names load on first use (PEP 562), so that importing one engine module (say
engine.sampler, from spec/) does not pull in the whole engine, whose model runner imports spec/.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.config import EngineConfig
    from engine.llm import LLM
    from engine.llm_engine import LLMEngine
    from engine.outputs import CompletionOutput, Logprob, RequestOutput
    from engine.sampling_params import RequestOutputKind, SamplingParams

_HOMES = {
    "LLM": "engine.llm",
    "CompletionOutput": "engine.outputs",
    "EngineConfig": "engine.config",
    "LLMEngine": "engine.llm_engine",
    "Logprob": "engine.outputs",
    "RequestOutput": "engine.outputs",
    "RequestOutputKind": "engine.sampling_params",
    "SamplingParams": "engine.sampling_params",
}
__all__ = [
    "LLM",
    "CompletionOutput",
    "EngineConfig",
    "LLMEngine",
    "Logprob",
    "RequestOutput",
    "RequestOutputKind",
    "SamplingParams",
]


def __getattr__(name: str):
    if name not in _HOMES:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    return getattr(importlib.import_module(_HOMES[name]), name)
