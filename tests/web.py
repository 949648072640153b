"""Helpers for the server and playground tests."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx

from engine.config import EngineConfig
from engine.entrypoints.async_engine import AsyncEngine
from engine.entrypoints.openai.server import ServerState, build_app
from engine.llm_engine import LLMEngine
from playground.launch import free_port

__all__ = [
    "API_KEY", "assert_all_returned", "command_line", "engine_held", "make_state", "serving",
    "tiny_serving", "until", "wait_idle",
]  # fmt: skip
API_KEY = "test-key-123"


def make_state(model: str, adapters=None, show_cached_tokens=False, **config) -> ServerState:
    adapters = dict(adapters or {})
    config = EngineConfig(model=model, num_threads=1, **config)
    state = ServerState(AsyncEngine.loading(config, adapters.values()), model, adapters,
                        api_keys=(API_KEY,))  # fmt: skip
    state.show_cached_tokens = show_cached_tokens
    return state


@contextmanager
def serving(app, host: str = "127.0.0.1") -> Iterator[str]:
    """Run an ASGI app with uvicorn in a background thread on a free port; yields its URL
    (tests)."""
    import uvicorn

    port = free_port(host)
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.05)
    try:
        yield f"http://{host}:{port}"
    finally:
        server.should_exit = True
        thread.join(10)


@contextmanager
def tiny_serving(model_dir, **fields) -> Iterator[tuple[str, ServerState]]:
    """A small model behind a real server; `fields` set ServerState's (api_keys, limits...)."""
    engine = LLMEngine(EngineConfig(model=str(model_dir), num_kv_blocks=64, num_threads=1))
    state = ServerState(AsyncEngine(engine), "tiny", {}, **fields)
    try:
        with serving(build_app(state)) as url:
            yield url, state
    finally:
        state.engine.shutdown()


@contextmanager
def command_line(command: str, model: str, *extra: str) -> Iterator[tuple[str, subprocess.Popen]]:
    """`tandem <command>` as a user starts it (one thread, the test API key, --port 0: the
    server binds a port of the kernel's choosing before it loads, so no other socket can take
    it, and prints it): yields (its URL, the process) once /health answers 200; stopped after."""
    args = [sys.executable, "-m", "playground.cli", command, "--model", model]
    args += ["--port", "0", "--threads", "1", "--api-key", API_KEY, *extra]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []

    def read() -> None:
        for line in proc.stdout:
            lines.append(line)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None or reader.is_alive(), "".join(lines)
            served = [line.split(" at ")[-1].strip() for line in list(lines) if "serving" in line]
            if served:
                url = served[0].removesuffix("/v1")
                try:
                    if httpx.get(url + "/health").status_code == 200:
                        break
                except httpx.TransportError:
                    pass
            assert time.monotonic() < deadline, "server did not come up: " + "".join(lines)
            time.sleep(0.2)
        yield url, proc
    finally:
        proc.terminate()
        proc.wait(30)


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


@contextmanager
def engine_held(state: ServerState) -> Iterator[None]:
    """The engine steps no more until the block ends (admitted requests wait in the server)."""
    with state.engine.lock:
        yield


def until(predicate, what: str, timeout: float = 60.0) -> None:
    """Poll predicate() until true; fails naming `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def assert_all_returned(state: ServerState) -> None:
    """Admission holds nothing and every KV block is back in the pool."""
    until(lambda: state.admission.num_requests == 0, "admitted requests released")
    assert state.admission.num_tokens == 0
    snap = wait_idle(state.engine)
    assert snap["num_free_blocks"] == snap["num_blocks"]
