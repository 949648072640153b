"""Tandem engine: paged KV cache, continuous batching, prefix caching.

Layers: the engine's modules import nothing of spec/ (which builds on them) or of the web layer;
`LLMEngine` loads its speculation when it is constructed.
"""

from engine.config import EngineConfig
from engine.llm import LLM
from engine.llm_engine import LLMEngine
from engine.outputs import CompletionOutput, Logprob, RequestOutput
from engine.sampling_params import RequestOutputKind, SamplingParams

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
