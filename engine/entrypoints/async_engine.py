"""One engine loop in a background thread, shared by every HTTP client and the playground.

The engine is single-threaded: only the loop thread touches it, and `lock` is held for each
step and each batch of submissions, so `snapshot()` from another thread sees a consistent state.
Callers on an asyncio loop submit with `add_request()` and read a RequestStream: what is new
since their last read (the engine hands out DELTA outputs, so its thread does work in
proportion to what each step adds, not to each request's length), or with `last()` the whole
output. Closing the stream aborts the request: a client that disconnects frees its blocks.

A server builds its engine on the loop thread (`AsyncEngine(build=...)`), so the thread that
loads the model (its warm-up runs parallel regions) is the one that steps it. GNU OpenMP keeps a
pool of worker threads for each thread that starts parallel regions, and once the process holds
more of them than it has cores, every pool's workers stop spinning between regions and sleep
(libgomp's throttled spin count): each of a step's many parallel regions then starts with a
futex wake. Loaded on the main thread and stepped on this one, SmolLM2's decode step at 2
threads on 2 cores took ~14.5 ms against ~10 ms with one thread doing both.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass, field

from engine.config import EngineConfig
from engine.entrypoints.beam_search import BeamSearch, BeamSearchOutput, BeamSearchParams
from engine.entrypoints.tenancy import tenant_view
from engine.introspection import summary
from engine.llm_engine import LLMEngine
from engine.outputs import OutputAccumulator, RequestOutput
from engine.sampling_params import RequestOutputKind, SamplingParams
from lora.adapter import LoRARequest

logger = logging.getLogger("tandem.server")


class EngineDeadError(RuntimeError):
    """The engine loop stopped (shut down, or a step raised): nothing more will be produced."""


@dataclass
class _Stream:
    """One request's outputs not read yet, handed from the loop thread to a coroutine: the
    deltas are joined as they arrive, so a slow reader gets them in one piece, losing nothing."""

    loop: asyncio.AbstractEventLoop
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    unread: OutputAccumulator = field(default_factory=OutputAccumulator)
    error: BaseException | None = None
    tenant: str | None = None  # whose request it is (a server with API keys: the key's salt)

    def put(self, out: RequestOutput | None, error: BaseException | None = None) -> None:
        def deliver() -> None:
            if out is not None:
                self.unread.add(out)
            if error is not None:
                self.error = error
            self.ready.set()

        self.loop.call_soon_threadsafe(deliver)


class OutputObserver:
    """Told about every output the loop hands out (metrics); called on the loop thread."""

    def on_output(self, out: RequestOutput, now: float) -> None: ...

    def forget(self, request_id: str) -> None:
        """The request was aborted: no final output will come."""


class RequestStream:
    """The outputs of one submitted request: iterate once (each item holds what is new since
    the previous one), or read `last()`; close() aborts it if unfinished."""

    def __init__(self, engine: AsyncEngine, request_id: str, stream: _Stream):
        self.engine, self.request_id, self._stream = engine, request_id, stream
        self.finished = self.closed = False

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        stream = self._stream
        try:
            while not self.finished:
                await stream.ready.wait()
                stream.ready.clear()
                if not stream.unread.empty:
                    out = stream.unread.take()
                    self.finished = out.finished
                    yield out
                if stream.error is not None and not self.finished:
                    raise stream.error
        finally:
            self.close()

    async def last(self, on_output: Callable[[], object] | None = None) -> RequestOutput | None:
        """Read to the end; the whole finished output (None if none came). on_output, if
        given, is called as each output arrives."""
        whole = OutputAccumulator()
        async for out in self:
            whole.add(out)
            if on_output is not None:
                on_output()
        return None if whole.empty else whole.take()

    async def cumulative(self) -> AsyncIterator[RequestOutput]:
        """Read to the end, each item the whole output so far (displays that redraw it)."""
        whole = OutputAccumulator()
        async for out in self:
            whole.add(out)
            snapshot = whole.take()
            yield snapshot
            whole.add(snapshot)

    def close(self) -> None:
        if not self.finished and not self.closed:
            self.closed = True
            self.engine.abort(self.request_id)


class AsyncEngine:
    def __init__(
        self,
        engine: LLMEngine | None = None,
        observers: list[OutputObserver] | None = None,
        *,
        build: Callable[[], LLMEngine] | None = None,
    ):
        """engine: a built engine; or build: makes one, run on the loop thread before its first
        step (a server's way: see the module docstring). Raises what build raises."""
        if (engine is None) == (build is None):
            raise TypeError("AsyncEngine takes an engine or build=, exactly one")
        self.engine = engine
        self.lock = threading.Lock()
        self.observers = list(observers or [])
        self._commands: deque[Callable[[], None]] = deque()
        self._wake = threading.Condition()
        self._streams: dict[str, _Stream] = {}
        # Beam searches the loop drives: each sees every step's outputs, and its future (on
        # the caller's event loop) gets the result.
        self._searches: list[tuple[BeamSearch, asyncio.Future]] = []
        self._stopped = False
        self.error: BaseException | None = None  # why the loop died, if it did
        self._tokens: deque[tuple[float, int]] = deque()  # (time, tokens) of recent steps
        built, failed = threading.Event(), []
        self._thread = threading.Thread(
            target=self._run, args=(build, built, failed), name="tandem-engine", daemon=True
        )
        self._thread.start()
        built.wait()
        if failed:
            raise failed[0]

    @classmethod
    def loading(cls, config: EngineConfig, adapters: Iterable[LoRARequest] = ()) -> AsyncEngine:
        """A server's engine: built with its adapters loaded (a bad one fails the start, not a
        request), on the loop thread that steps it."""

        def build() -> LLMEngine:
            engine = LLMEngine(config)
            for adapter in adapters:
                engine.load_lora(adapter)
            return engine

        return cls(build=build)

    # ---- the loop thread ---------------------------------------------------------------------
    def _run(self, build, built: threading.Event, failed: list) -> None:
        try:
            if build is not None:
                self.engine = build()
        except BaseException as exc:  # the caller raises it
            failed.append(exc)
            self._stopped = True
            return
        finally:
            built.set()
        engine = self.engine
        while True:
            with self._wake:
                while not self._stopped and not self._has_work():
                    self._wake.wait()
                if self._stopped:
                    break
                commands = list(self._commands)
                self._commands.clear()
            try:
                with self.lock:
                    for command in commands:
                        command()
                    outputs = engine.step() if engine.has_unfinished_requests() else []
                    self._feed_searches(outputs)
            except BaseException as exc:  # a bug in a step: fail every request, keep nothing
                self._fail_all(exc)
                return
            now = time.monotonic()
            for out in outputs:
                for observer in self.observers:
                    try:  # an observer (metrics, views) must never stop the engine
                        observer.on_output(out, now)
                    except Exception:
                        logger.exception("output observer %r failed", observer)
                stream = self._streams.get(out.request_id)
                if stream is not None:
                    stream.put(out)
                    if out.finished:
                        del self._streams[out.request_id]
            if outputs:
                self._count_tokens(now, engine.num_generated_tokens)
            if not outputs and not commands and not engine.has_unfinished_requests():
                # Streams whose requests are gone (aborted): nothing will wake them otherwise.
                for rid in [r for r in self._streams if r not in engine.groups]:
                    self._streams.pop(rid).put(None, EngineDeadError(f"request {rid} ended"))

    def _has_work(self) -> bool:
        return bool(self._commands or self._streams or self._searches)

    def _feed_searches(self, outputs: list[RequestOutput]) -> None:
        """Each beam search takes the step's outputs; finished or failed ones settle."""
        for entry in list(self._searches):
            search, done = entry
            try:
                search.feed(outputs)
                if not search.done:
                    continue
                result, error = search.outputs(), None
            except Exception as exc:  # that search's own failure: it alone ends
                search.close()
                result, error = None, exc
            self._searches.remove(entry)
            _settle_soon(done, result, error)

    def _fail_all(self, exc: BaseException) -> None:
        logger.error("engine step failed; the loop stops", exc_info=exc)
        self.error = exc
        with self._wake:
            self._stopped = True
        try:
            with self.lock:
                self.engine.abort_request(list(self.engine.groups))
        finally:
            for stream in self._streams.values():
                # The client hears what happened, not the internals (the log has the traceback).
                stream.put(None, EngineDeadError("the engine stopped after an internal error"))
            self._streams.clear()
            dead = EngineDeadError("the engine stopped after an internal error")
            for _, done in self._searches:
                _settle_soon(done, None, dead)
            self._searches.clear()

    def _count_tokens(self, now: float, total: int) -> None:
        self._tokens.append((now, total))
        while len(self._tokens) > 2 and now - self._tokens[0][0] > 10.0:
            self._tokens.popleft()

    def tokens_per_second(self) -> float:
        """Generated tokens per second over the last ~10 s of steps (0 when idle)."""
        if len(self._tokens) < 2 or time.monotonic() - self._tokens[-1][0] > 2.0:
            return 0.0
        (t0, n0), (t1, n1) = self._tokens[0], self._tokens[-1]
        return (n1 - n0) / (t1 - t0) if t1 > t0 else 0.0

    # ---- callers -----------------------------------------------------------------------------
    def _submit(self, command: Callable[[], None]) -> None:
        with self._wake:
            if self._stopped:
                raise EngineDeadError("the engine is not running")
            self._commands.append(command)
            self._wake.notify()

    async def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        lora_request: LoRARequest | None = None,
        cache_salt: str | None = None,
        tenant: str | None = None,
    ) -> RequestStream:
        """Submit one request; raises ValueError if the engine refuses it. Returns its stream of
        outputs (params' output_kind is replaced: DELTA); close() it (or cancel its reader) to
        abort the request. `tenant`: whose it is (snapshot(tenant) shows it to them alone)."""
        params = params.with_output_kind(RequestOutputKind.DELTA)
        # Compile the constraint here, off the loop thread, awaited without holding a thread;
        # the engine's add_request then takes the grammar as it is.
        grammar = await self.engine.compile_constraint_async(params.structured_outputs)
        if params.thinking_token_budget is not None and self.engine.grammar is None:
            await asyncio.to_thread(self.engine.grammar_manager)  # (xgrammar's tables, once)
        stream = _Stream(asyncio.get_running_loop(), tenant=tenant)

        def add() -> None:
            self.engine.add_request(
                request_id,
                prompt,
                params,
                cache_salt=cache_salt,
                lora_request=lora_request,
                compiled_grammar=grammar,
            )
            self._streams[request_id] = stream

        try:
            await self.call(add)
        except asyncio.CancelledError:  # the caller gave up while the add was queued
            self.abort(request_id)
            raise
        return RequestStream(self, request_id, stream)

    async def call(self, fn: Callable[[], object]):
        """fn() on the engine loop's thread, between steps; its result or exception."""
        done: asyncio.Future = asyncio.get_running_loop().create_future()

        def command() -> None:
            try:
                result = fn()
            except Exception as exc:
                _settle_soon(done, None, exc)
                return
            _settle_soon(done, result)

        self._submit(command)
        return await done

    async def beam_search(
        self, prompts: list[list[int]], params: BeamSearchParams, cache_salt: str | None = None
    ) -> list[BeamSearchOutput]:
        """Run a beam search (engine.entrypoints.beam_search) on the loop; ValueError if the engine
        refuses it. Cancelling the caller aborts its beams."""
        done: asyncio.Future = asyncio.get_running_loop().create_future()

        def start() -> None:
            search = BeamSearch(self.engine, params, cache_salt)
            try:
                search.start(prompts)
            except BaseException:
                search.close()
                raise
            self._searches.append((search, done))

        try:
            await self.call(start)
            return await done
        except asyncio.CancelledError:  # (after start, if it was queued: commands run in order)
            self._submit(lambda: self._cancel_search(done))
            raise

    def _cancel_search(self, done: asyncio.Future) -> None:
        for entry in [e for e in self._searches if e[1] is done]:
            entry[0].close()
            self._searches.remove(entry)

    def abort(self, request_id: str) -> None:
        def abort() -> None:
            self._streams.pop(request_id, None)
            self.engine.abort_request(request_id)
            for observer in self.observers:
                observer.forget(request_id)

        if not self._stopped:
            self._submit(abort)

    def snapshot(self, tenant: str | None = None) -> dict:
        """The engine's snapshot, taken between steps (blocks the caller for at most a step);
        with a tenant, what that tenant may see of it (engine.entrypoints.tenancy): requests
        added with another tenant, or none (beam searches), are left out."""

        def read() -> dict:
            snap = self.engine.snapshot()
            if tenant is None:
                return snap
            # A stream is registered under the lock, in the command that adds its request; one
            # whose request ended may stay a moment longer (its request is in no table then).
            owned = {rid for rid, s in list(self._streams.items()) if s.tenant == tenant}
            return tenant_view(snap, owned)

        return self._between_steps(read)

    def summary(self) -> dict:
        """The snapshot's counters and gauges alone (no walk over requests and blocks)."""
        return self._between_steps(lambda: summary(self.engine))

    def summaries(self) -> dict[str, dict]:
        """Summaries by replica ("": this one engine; Replicas gives one per replica)."""
        return {"": self.summary()}

    def _between_steps(self, read: Callable[[], dict]) -> dict:
        with self.lock:
            state = read()
        state["tokens_per_second"] = self.tokens_per_second()
        return state

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive() and not self._stopped

    def shutdown(self, timeout: float = 10.0) -> None:
        with self._wake:
            self._stopped = True
            self._wake.notify()
        self._thread.join(timeout)
        with self.lock:
            self.engine.abort_request(list(self.engine.groups))


def _settle_soon(done: asyncio.Future, result, error: BaseException | None = None) -> None:
    """Settle an event-loop future from the engine's thread (a later settle is ignored)."""

    def settle() -> None:
        if not done.done():
            done.set_exception(error) if error else done.set_result(result)

    done.get_loop().call_soon_threadsafe(settle)
