"""Tandem engine: paged KV cache, continuous batching, prefix caching."""

from engine.config import EngineConfig
from engine.llm import LLM
from engine.llm_engine import LLMEngine
from engine.outputs import CompletionOutput, Logprob, RequestOutput
from engine.sampling_params import SamplingParams

__all__ = [
    "LLM",
    "CompletionOutput",
    "EngineConfig",
    "LLMEngine",
    "Logprob",
    "RequestOutput",
    "SamplingParams",
]
