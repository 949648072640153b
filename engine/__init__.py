"""Tandem engine: paged KV cache, continuous batching, prefix caching.

Layers: the core (engine/*.py, models/, grammar/, distributed/) imports nothing of spec/ (which
builds on it), of its entry points (entrypoints/: the offline LLM, the async engine, the OpenAI
server, replicas) or of the playground; `LLMEngine` loads its speculation when it is constructed.
tests/engine/test_layers.py holds every package to this.
"""

from engine.config import EngineConfig
from engine.entrypoints.beam_search import BeamSearchParams
from engine.entrypoints.llm import LLM
from engine.llm_engine import LLMEngine
from engine.outputs import CompletionOutput, Logprob, RequestOutput
from engine.sampling_params import RequestOutputKind, SamplingParams

__all__ = [
    "BeamSearchParams",
    "LLM",
    "CompletionOutput",
    "EngineConfig",
    "LLMEngine",
    "Logprob",
    "RequestOutput",
    "RequestOutputKind",
    "SamplingParams",
]
