"""AsyncEngine(build=...): the engine is built on the loop thread that steps it, so one thread
starts every parallel region of loading and stepping (why: engine/entrypoints/async_engine.py's
docstring; `tandem serve` and the playground build theirs this way)."""

from __future__ import annotations

import asyncio
import threading

import pytest

from engine import SamplingParams
from engine.config import EngineConfig
from engine.entrypoints.async_engine import AsyncEngine, OutputObserver
from engine.llm_engine import LLMEngine


class Threads(OutputObserver):
    """The threads that handed out outputs (the loop calls observers from its stepping thread)."""

    def __init__(self):
        self.seen: set[int] = set()

    def on_output(self, out, now: float) -> None:
        self.seen.add(threading.get_ident())


def test_the_thread_that_builds_the_engine_steps_it(tiny_llama):
    built_on: list[int] = []

    def build() -> LLMEngine:
        built_on.append(threading.get_ident())
        return LLMEngine(EngineConfig(model=str(tiny_llama), num_threads=1, num_kv_blocks=32))

    stepped = Threads()
    engine = AsyncEngine(build=build, observers=[stepped])
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)

    async def generate() -> list[int]:
        stream = await engine.add_request("r", [1, 5, 9, 14, 2], params)
        return (await stream.last()).outputs[0].token_ids

    try:
        assert len(asyncio.run(generate())) == 8
        assert stepped.seen == set(built_on) == {engine._thread.ident}
        assert threading.get_ident() not in built_on
    finally:
        engine.shutdown()


def test_a_build_that_fails_raises_in_the_caller():
    def build() -> LLMEngine:
        raise ValueError("model='nowhere' not found")

    with pytest.raises(ValueError, match="nowhere"):
        AsyncEngine(build=build)
    with pytest.raises(TypeError, match="exactly one"):
        AsyncEngine()
