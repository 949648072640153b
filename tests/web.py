"""Helpers for the server and playground tests."""

from __future__ import annotations

import time

from playground.launch import serving_in_thread as serving

__all__ = ["serving", "wait_idle"]


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
