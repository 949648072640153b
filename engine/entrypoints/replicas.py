"""Data-parallel replicas: N engines as one Ray Serve deployment behind the one OpenAI server.

`tandem serve --data-parallel-size N` starts a local Ray instance (or joins $RAY_ADDRESS), deploys
N `EngineReplica`s (each an engine in its own Ray actor process) and serves the usual FastAPI app
in this process with `Replicas` where one engine's AsyncEngine would be: the server tokenizes,
checks and answers as with one engine, and each request goes through a deployment handle whose
router (engine/entrypoints/routing.py) picks the replica. Ray Serve restarts a replica that dies
or fails its health check; the requests it was running end with an error (a 503 or an SSE error
event).

The local Ray instance started here takes no client without this server's own token (Ray's
token auth with a random RAY_AUTH_TOKEN, not the ~/.ray/auth_token every local user can read):
Ray listens on every interface, so the token is what keeps other processes and machines from
running code in it. A cluster joined through $RAY_ADDRESS keeps its operator's settings.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import sys
import threading
import time
from collections.abc import AsyncIterator
from contextlib import suppress

import ray
from ray import serve
from ray.exceptions import RayActorError, RayTaskError
from ray.serve.config import RequestRouterConfig

from engine.config import EngineConfig
from engine.detokenizer import ExactDecoder
from engine.entrypoints.async_engine import AsyncEngine, EngineDeadError, RequestStream
from engine.entrypoints.routing import Submission
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams
from lora.adapter import LoRARequest

ROUTING_STATS_PERIOD_S = 0.5  # how often replicas report their caches and load


class EngineReplica:
    """One engine in a Ray actor: the deployment's body."""

    def __init__(self, config: EngineConfig, adapters: list[LoRARequest]):
        self.engine = AsyncEngine.loading(config, adapters)

    def describe(self) -> dict:
        """What the server needs to tokenize and check requests without a model of its own."""
        llm = self.engine.engine
        return {
            "tokenizer": llm.tokenizer,
            "max_model_len": llm.max_model_len,
            "vocab_size": llm.vocab_size,
        }

    async def generate(self, sub: Submission) -> AsyncIterator[RequestOutput | None]:
        """None once the engine accepted the request (its refusal raises before), then the
        request's outputs, each holding what is new. Cancelling the call aborts it."""
        stream = await self.engine.add_request(
            sub.request_id, sub.prompt, sub.params, sub.lora, cache_salt=sub.cache_salt
        )
        try:
            yield None
            async for out in stream:
                yield out
        finally:
            stream.close()

    async def beam_search(self, prompts: list[list[int]], params, cache_salt=None):
        return await self.engine.beam_search(prompts, params, cache_salt)

    async def load_lora(self, adapter: LoRARequest) -> None:
        await self.engine.call(lambda: self.engine.engine.load_lora(adapter))

    async def unload_lora(self, name: str) -> None:
        def unload() -> None:
            with suppress(ValueError):  # not loaded here (evicted, or a replica started since)
                self.engine.engine.unload_lora(name)

        await self.engine.call(unload)

    def record_routing_stats(self) -> dict:
        """For the router: the prefix-cache index and loaded adapters; for /metrics: the
        engine's summary."""
        llm = self.engine.engine
        with self.engine.lock:  # between steps
            cached = set(llm.kv.pool.cached)
            adapters = llm.adapters.cache_keys() if llm.adapters is not None else {}
        summary = self.engine.summary()
        return {
            "cached": cached,
            "adapters": adapters,
            "load": summary["num_running"] + summary["num_waiting"],
            "pid": os.getpid(),
            "replica": serve.get_replica_context().replica_id.unique_id,
            "summary": summary,
        }

    def check_health(self) -> None:
        """Ray Serve calls it periodically; raising has the replica replaced."""
        if not self.engine.is_running:
            raise RuntimeError(f"the engine loop stopped: {self.engine.error!r}")

    def __del__(self):
        self.engine.shutdown()


class Front:
    """Where the server reads `state.engine.engine`: the replicas' tokenizer and limits, and
    adapter loads and unloads, done on every replica (a replica started later loads an adapter
    when a request first names it: requests carry its path)."""

    def __init__(self, handle, described: dict):
        self.handle = handle
        self.tokenizer = described["tokenizer"]
        self.max_model_len = described["max_model_len"]
        self.vocab_size = described["vocab_size"]
        self.decoder = ExactDecoder(self.tokenizer)

    def load_lora(self, adapter: LoRARequest) -> None:
        self._everywhere("load_lora", adapter)

    def unload_lora(self, name: str) -> None:
        self._everywhere("unload_lora", name)

    def _everywhere(self, method: str, *args) -> None:
        """Run a replica method on every replica; the first failure is raised as itself."""
        results = self.handle.broadcast(method, *args).results(return_exceptions=True)
        for result in results:
            if isinstance(result, BaseException):
                raise _own(result)


class ReplicaStream(RequestStream):
    """One request's outputs from the replica serving it."""

    def __init__(self, replicas: Replicas, request_id: str, response):
        self.engine, self.request_id, self._response = replicas, request_id, response
        self.finished = self.closed = False

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        try:
            while not self.finished:
                out = await _unwrapped(self._response.__anext__(), self.request_id)
                self.finished = out.finished
                now = time.monotonic()
                for observer in self.engine.observers:
                    observer.on_output(out, now)
                yield out
        finally:
            self.close()

    def close(self) -> None:
        if not self.finished and not self.closed:
            self.closed = True
            self._response.cancel()
            for observer in self.engine.observers:
                observer.forget(self.request_id)


async def _unwrapped(call, request_id: str):
    """A replica's result; its own errors re-raised as themselves, a replica that died (or a
    stream that ended without a final output) as EngineDeadError."""
    try:
        return await call
    except RayTaskError as exc:
        raise _own(exc) from None
    except (RayActorError, StopAsyncIteration) as exc:
        message = f"the replica serving request {request_id} stopped: {type(exc).__name__}"
        raise EngineDeadError(message) from None


def _own(error: BaseException) -> BaseException:
    """The error a replica's own code raised (Ray wraps it in a RayTaskError)."""
    return error.cause if isinstance(error, RayTaskError) else error


def _own_token() -> None:
    """Ray's token auth on for the local instance about to start, with a random token of this
    process's (kept if the operator set RAY_AUTH_TOKEN): Ray's processes inherit it from the
    environment, and a client without it is refused (tests/engine/entrypoints/test_replicas.py)."""
    from ray._raylet import AuthenticationTokenLoader, Config

    os.environ["RAY_AUTH_MODE"] = "token"
    os.environ.pop("RAY_AUTH_TOKEN_PATH", None)
    if not os.environ.get("RAY_AUTH_TOKEN"):
        os.environ["RAY_AUTH_TOKEN"] = secrets.token_hex(32)
    Config.initialize("")  # this process reads the mode and token afresh
    AuthenticationTokenLoader.instance().reset_cache()


class Replicas:
    """The AsyncEngine face of a deployment of engine replicas (ServerState.engine)."""

    def __init__(self, handle, front: Front, app: str):
        self.handle, self.engine, self.app = handle, front, app
        self.observers: list = []
        self._stopped = False
        self._calls = threading.Lock()  # adapter loads and unloads take turns, as on one engine

    @classmethod
    def start(
        cls,
        config: EngineConfig,
        num_replicas: int,
        adapters: list[LoRARequest] = (),
        policy: str = "prefix",
        app: str = "tandem",
    ) -> Replicas:
        """Deploy `num_replicas` engines (Ray started here unless it runs already)."""
        if not ray.is_initialized():
            if not os.environ.get("RAY_ADDRESS"):
                _own_token()
            # Workers import this checkout as the server does (its sys.path, '' as its cwd).
            path = os.pathsep.join(p or os.getcwd() for p in sys.path)
            env = {"env_vars": {"PYTHONPATH": path, "OMP_NUM_THREADS": "1"}}
            ray.init(include_dashboard=False, runtime_env=env, log_to_driver=False)
        serve.start(proxy_location="Disabled")
        router = RequestRouterConfig(
            # a path: Ray imports the router where it runs
            request_router_class="engine.entrypoints.routing:ReplicaRouter",
            request_router_kwargs={"block_size": config.block_size, "policy": policy},
            request_routing_stats_period_s=ROUTING_STATS_PERIOD_S,
            request_routing_stats_timeout_s=30,
        )
        deployment = serve.deployment(EngineReplica, name="engine").options(
            num_replicas=num_replicas,
            ray_actor_options={"num_cpus": 0},  # threads are the engine's (num_threads)
            max_ongoing_requests=max(config.max_num_seqs, 1) * 4,
            request_router_config=router,
            health_check_period_s=2,
            health_check_timeout_s=30,
        )
        handle = serve.run(deployment.bind(config, list(adapters)), name=app, route_prefix=None)
        front = Front(handle, handle.describe.remote().result())
        return cls(handle.options(stream=True), front, app)

    async def add_request(
        self,
        request_id: str,
        prompt: list[int],
        params: SamplingParams,
        lora_request: LoRARequest | None = None,
        cache_salt: str | None = None,
        tenant: str | None = None,
    ) -> ReplicaStream:
        """Route and submit one request; raises what the replica's engine raises on refusal.
        (`tenant` stays here: the replicas' snapshot() holds counts only, the same for all.)"""
        if self._stopped:
            raise EngineDeadError("the replicas are shut down")
        sub = Submission(request_id, list(prompt), params, lora_request, cache_salt)
        response = self.handle.generate.remote(sub)
        try:
            await _unwrapped(response.__anext__(), request_id)  # accepted (None)
        except BaseException:
            response.cancel()
            raise
        return ReplicaStream(self, request_id, response)

    async def beam_search(self, prompts: list[list[int]], params, cache_salt=None):
        call = self.handle.options(stream=False).beam_search.remote(prompts, params, cache_salt)
        try:
            return await _unwrapped(call, "beam search")
        except asyncio.CancelledError:
            call.cancel()
            raise

    async def call(self, fn):
        """fn() in a worker thread, one call at a time (the server's adapter loads/unloads)."""

        def locked():
            with self._calls:
                return fn()

        return await asyncio.to_thread(locked)

    def abort(self, request_id: str) -> None:
        """Requests abort when their stream closes (the replica's generator is cancelled)."""

    def reports(self, timeout_s: float = 10.0) -> dict[str, dict]:
        """Every running replica's report (EngineReplica.record_routing_stats), by replica id;
        a replica that does not answer is left out. Blocks: call it off the event loop."""
        call = self.handle.options(stream=False).broadcast("record_routing_stats")
        results = call.results(timeout_s=timeout_s, return_exceptions=True)
        return {r["replica"]: r for r in results if isinstance(r, dict)}

    def summaries(self) -> dict[str, dict]:
        """Each replica's engine summary (for /metrics), by replica id."""
        return {k: r["summary"] for k, r in self.reports().items()}

    def snapshot(self, tenant: str | None = None) -> dict:
        """The first replica's summary (/v1/snapshot; the playground's views draw one engine
        and refuse replicas): counts only, the same for every tenant."""
        summaries = self.summaries()
        return next(iter(summaries.values())) if summaries else {}

    @property
    def is_running(self) -> bool:
        if self._stopped:
            return False
        app = serve.status().applications.get(self.app)
        deployment = app.deployments.get("engine") if app is not None else None
        states = deployment.replica_states if deployment is not None else {}
        return any(str(state).endswith("RUNNING") and n for state, n in states.items())

    def shutdown(self, timeout: float = 10.0) -> None:
        if not self._stopped:
            self._stopped = True
            serve.delete(self.app)
