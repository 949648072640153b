"""Helpers for the server and playground tests."""

from __future__ import annotations

import time

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from playground.async_engine import AsyncEngine
from playground.launch import serving_in_thread as serving
from playground.server import ServerState

__all__ = ["API_KEY", "make_state", "serving", "wait_idle"]
API_KEY = "test-key-123"


def make_state(model: str, adapters=None, **config) -> ServerState:
    engine = LLMEngine(EngineConfig(model=model, num_threads=1, **config))
    for a in (adapters or {}).values():
        engine.load_lora(a)
    return ServerState(AsyncEngine(engine), model, dict(adapters or {}), api_key=API_KEY)


def wait_idle(engine, timeout: float = 15.0) -> dict:
    """Wait until the engine holds no request; returns the snapshot (free == total then)."""
    deadline = time.monotonic() + timeout
    while True:
        snap = engine.snapshot()
        if not engine.engine.groups and snap["num_running"] == 0 and snap["num_waiting"] == 0:
            return snap
        if time.monotonic() > deadline:
            busy = list(engine.engine.groups)
            raise AssertionError(f"engine still busy after {timeout} s: {busy}")
        time.sleep(0.05)
