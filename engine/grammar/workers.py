"""Compiles on trial in worker processes that can be killed: how a slow constraint is stopped.

xgrammar's compile is one C++ call that cannot be interrupted, and a thread cannot be killed, so
a compile on a thread that outlives its caller's timeout keeps a core busy until it ends (tens
of seconds for schemas under the 64 KiB cap). Here each compile first runs in a worker process:
at most `max_workers` at once, each given `timeout` seconds, then killed and replaced. A worker
answers only whether the constraint compiled (and xgrammar's message if not): a compiled
grammar's JSON serialization costs more than compiling it again (it grows with the square of
the grammar's size), so the caller compiles it again itself, knowing it ends (GrammarCompiler).

Workers are forked from a forkserver that has imported xgrammar (a fork of the multithreaded
engine process could inherit a lock some other thread held), start at normal CPU priority, and
drop to the lowest (nice 19) once a compile has run `demote_after` seconds: short compiles and
the engine's steps go first, long ones get what is left. A demoted worker is retired after its
compile, since a process cannot raise its priority back.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import threading
import time

_WORKER_MODULE = "engine.grammar.compiler"  # what the forkserver imports once (xgrammar, torch)
_START_TIMEOUT = 120.0  # the forkserver's first start imports torch: seconds on a busy machine


class CompileTimeout(Exception):
    """The trial did not end within its timeout, or no worker was free within it."""


def _serve(conn, tokenizer_info_json: str) -> None:
    """A worker's loop: receive a StructuredOutputs, answer None (it compiles) or the error."""
    import xgrammar as xgr

    from engine.grammar.compiler import build

    info = xgr.TokenizerInfo.deserialize_json(tokenizer_info_json)
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    conn.send("ready")
    while True:
        try:
            so = conn.recv()
        except EOFError:  # the engine closed the pipe or exited
            return
        try:
            build(compiler, info, so)
            conn.send(None)
        except ValueError as e:
            conn.send(str(e))


class _Worker:
    def __init__(self, ctx, tokenizer_info_json: str):
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(
            target=_serve, args=(child, tokenizer_info_json), daemon=True, name="tandem-grammar"
        )
        self.process.start()
        child.close()
        if not self.conn.poll(_START_TIMEOUT) or self.conn.recv() != "ready":
            self.stop()
            raise RuntimeError("a grammar compile worker did not start")

    def stop(self) -> None:
        self.process.kill()
        self.process.join()
        self.conn.close()


class CompileWorkers:
    """tokenizer_info_json: `TokenizerInfo.serialize_json()` of the engine's tokenizer info."""

    def __init__(self, tokenizer_info_json: str, max_workers: int = 8, demote_after: float = 0.1):
        self._ctx = mp.get_context("forkserver")
        self._ctx.set_forkserver_preload([_WORKER_MODULE])
        self._info_json = tokenizer_info_json
        self.max_workers = max_workers
        self.demote_after = demote_after
        self._slots = threading.BoundedSemaphore(max_workers)
        self._idle: list[_Worker] = []
        self._lock = threading.Lock()
        self._closed = False
        self.num_killed = 0  # workers killed at their timeout
        # Boot the forkserver and one worker now, not on the first request's clock.
        threading.Thread(target=self._refill, daemon=True, name="tandem-grammar-start").start()

    def trial(self, so, timeout: float) -> tuple[str | None, float]:
        """Compile `so` in a worker: (None if it compiles else xgrammar's message, seconds the
        worker ran). CompileTimeout if no worker is free within `timeout`, or the compile runs
        longer than `timeout` (its worker is then killed)."""
        if not self._slots.acquire(timeout=timeout):
            raise CompileTimeout(
                f"no compile worker was free within {timeout:g} s (grammar_compile_timeout): "
                f"all {self.max_workers} were busy (grammar_compile_workers)"
            )
        try:
            worker = self._take()
            threading.Thread(target=self._refill, daemon=True, name="tandem-grammar-start").start()
            t0 = time.perf_counter()
            worker.conn.send(so)
            is_demoted = not worker.conn.poll(min(self.demote_after, timeout))
            if is_demoted:
                with contextlib.suppress(ProcessLookupError):  # it may have just died
                    os.setpriority(os.PRIO_PROCESS, worker.process.pid, 19)
                if not worker.conn.poll(max(timeout - (time.perf_counter() - t0), 0.0)):
                    worker.stop()
                    with self._lock:
                        self.num_killed += 1
                    raise CompileTimeout(
                        f"compiling took longer than {timeout:g} s (grammar_compile_timeout)"
                    )
            try:
                answer = worker.conn.recv()
            except EOFError:  # the worker died (xgrammar crashed on this constraint)
                answer = f"structured_outputs.{so.kind}: compiling it crashed its worker"
                is_demoted = True  # so it is stopped below
            seconds = time.perf_counter() - t0
            if is_demoted:
                worker.stop()
            else:
                self._give_back(worker)
        finally:
            self._slots.release()
        return answer, seconds

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for worker in idle:
            worker.stop()

    def _take(self) -> _Worker:
        with self._lock:
            if self._idle:
                return self._idle.pop()
        return _Worker(self._ctx, self._info_json)

    def _give_back(self, worker: _Worker) -> None:
        with self._lock:
            if not self._closed and len(self._idle) < self.max_workers:
                self._idle.append(worker)
                return
        worker.stop()

    def _refill(self) -> None:
        """Keep one idle worker ready, so the next compile does not wait for a start (the
        start costs ~100 ms of CPU: forking, and the vocabulary read again)."""
        with self._lock:
            if self._closed or self._idle:
                return
        # On failure the next trial starts its own worker and reports what fails.
        with contextlib.suppress(RuntimeError, OSError):
            self._give_back(_Worker(self._ctx, self._info_json))
