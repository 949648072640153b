"""The engine: add_request / step / abort, for servers; `LLM` wraps it for batch and streaming.

`LLMEngine` orchestrates owners: the scheduler (which requests run and how many tokens each),
the KV cache manager (blocks), the model runner (one batched forward plus sampling and
verification), the speculation (spec/: draft slots, proposals, accounting), the adapter
registries (lora/), the grammar manager, the async pipeline, and the request groups that build
outputs. One step, top to bottom (`_step`): collect a step in flight if the next one needs its
tokens, plan draft slots, schedule, launch (propose, then queue the target), and collect the
step the launch overlapped: verdicts to KV bookkeeping and speculation counters, tokens appended
with their stop checks, outputs built by their groups.
"""

from __future__ import annotations

import asyncio
import threading
import time
from contextlib import nullcontext

import torch

from engine.backends import resolve_backend
from engine.block_pool import cache_extra_keys
from engine.config import EngineConfig
from engine.detokenizer import ExactDecoder
from engine.distributed.tensor_parallel import Workers
from engine.errors import ParamError
from engine.grammar.constraint import StructuredOutputs
from engine.introspection import snapshot
from engine.kv_cache_manager import KVCacheManager
from engine.model_runner import ModelRunner
from engine.models.loader import load_engine_models
from engine.outputs import RequestGroup, RequestOutput
from engine.pipeline import InFlight, Pipeline, may_overlap
from engine.request import Request, RequestStatus, step_token_kinds
from engine.sampling_params import RequestOutputKind, SamplingParams
from engine.scheduler import Scheduler, SchedulerOutput
from engine.step_budget import StepBudget
from engine.step_results import StepResult
from lora.adapter import LoRAAdapter, LoRARequest
from lora.batch import LoRASlots
from lora.registry import AdapterRegistry


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None, **kwargs):
        self.config = config = config or EngineConfig(**kwargs)
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        torch.set_flush_denormal(True)
        device = config.torch_device
        if device.type == "cuda" and device.index is not None:
            # Triton launches and CUDA graphs act on the current device, not the tensors'.
            torch.cuda.set_device(device)
        self.workers = Workers.start(config)  # tensor parallelism's other ranks, loading now
        with self.workers or nullcontext():  # (a failed load stops them)
            models = load_engine_models(config, self.workers and self.workers.group)
        self.tokenizer, self.eos_token_ids = models.tokenizer, models.eos_token_ids
        self.decoder = ExactDecoder(self.tokenizer)  # exact decoding for every output
        self.model_config = cfg = models.cfg
        self.max_model_len = min(
            config.max_model_len or cfg.max_position_embeddings, cfg.max_position_embeddings
        )
        self.vocab_size = cfg.vocab_size
        block_bytes = models.kv_bytes_per_block(config.block_size)  # int8 scales included
        self.kv_bytes_per_token = block_bytes / config.block_size
        num_blocks = config.num_kv_blocks or max(2, config.kv_budget_bytes() // block_bytes)
        self.kv = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(
            self.kv,
            config.max_num_seqs,
            config.max_num_batched_tokens,
            config.max_loras if config.enable_lora else None,
            None
            if config.max_step_ms is None
            else StepBudget(config.max_step_ms, config.block_size),
        )
        self.runner = self._runner(models.model, models.shard_cfg, num_blocks, models.kv_formats[0])
        if self.workers is not None:
            self.workers.attach(self.runner, num_blocks)
        self.runner.generator.manual_seed(config.seed)
        self.adapters = self._adapters("lora_request", self.runner)
        self.draft_runner = self.draft_adapters = None
        if models.draft is not None:
            self.draft_runner = self._runner(*models.draft, num_blocks, models.kv_formats[1])
            self.draft_runner.lora_of = lambda request: request.draft_lora
            self.draft_adapters = self._adapters("draft_lora_request", self.draft_runner)
        # spec/ builds on the engine's core; it is loaded here, not at import, so that
        # importing any engine module never imports spec/.
        from spec.speculation import build_speculation

        self.speculation = build_speculation(config, self.draft_runner)
        graphs = device.type == "cuda" and self.runner.backend.static_buffers
        if graphs and not config.enforce_eager:
            max_query_len = 1 + self.speculation.k
            for runner in filter(None, (self.runner, self.draft_runner)):
                runner.use_graphs(config.max_num_seqs, self.max_model_len, max_query_len)
        self.async_scheduling = (
            device.type == "cuda" if config.async_scheduling is None else config.async_scheduling
        )
        # Sampled tokens stay on the device only for a next step launched before they reach the
        # host; with a proposer no step overlaps (see pipeline.may_overlap), so none is kept.
        self.runner.keep_sampled = self.async_scheduling and self.speculation.proposer is None
        self.pipeline = Pipeline()
        self._undelivered: list[RequestGroup] = []  # a raising step()'s: out with the next
        self.grammar = None  # GrammarManager, made for the first constrained request
        self._grammar_lock = threading.Lock()
        self.groups: dict[str, RequestGroup] = {}
        self.num_steps = self.num_generated_tokens = 0
        self.num_request_errors = 0  # groups ended by a failure of their own (Request.fail)

    def _runner(self, model, cfg, num_blocks: int, kv_format: torch.dtype) -> ModelRunner:
        config = self.config
        backend = resolve_backend(config.attention_backend, config.torch_device)
        runner = ModelRunner(model, cfg, num_blocks, config.block_size, backend, kv_format)
        if config.enable_lora:
            runner.lora_slots = LoRASlots(
                cfg, config.max_loras, config.max_lora_rank, runner.device, runner.dtype
            )
        return runner

    def _adapters(self, param: str, runner: ModelRunner) -> AdapterRegistry:
        config = self.config
        capacity = config.max_cpu_loras or 2 * config.max_loras
        model_cfg = runner.model.config  # the whole model's shape (runner.cfg: this rank's)
        return AdapterRegistry(
            param, model_cfg, config.max_lora_rank, capacity, runner.lora_slots, self._held
        )

    def _held(self) -> set[int]:
        """ids of the adapters requests hold now (they keep them until they end)."""
        return {
            id(a)
            for g in self.groups.values()
            for r in g.requests
            for a in (r.lora, r.draft_lora)
            if a is not None
        }

    # ---- requests in -------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        cache_salt: str | None = None,
        lora_request: LoRARequest | None = None,
        draft_lora_request: LoRARequest | None = None,
        compiled_grammar=None,
    ) -> None:
        """lora_request: the target's adapter; draft_lora_request: the draft model's own adapter
        (a draft-model engine only; none by default); compiled_grammar: the constraint already
        compiled (compile_constraint_async), so this call never compiles."""
        params = params or SamplingParams()
        if request_id in self.groups:
            raise ParamError("request_id", f"request_id {request_id!r} is already in use")
        if isinstance(prompt, str):
            text, ids = prompt, self.tokenizer.encode(prompt)
        else:
            text, ids = None, list(prompt)
            bad = [t for t in ids if not isinstance(t, int) or not 0 <= t < self.vocab_size]
            if bad:
                raise ParamError(
                    "prompt", f"prompt token id {bad[0]!r} is outside [0, {self.vocab_size})"
                )
        self.scheduler.check_fits(len(ids), params, self.max_model_len)
        params.check_vocab(self.vocab_size)
        predicted = self.speculation.prediction_ids(params, self.tokenizer, self.vocab_size)
        compiled = compiled_grammar or self.compile_constraint(params.structured_outputs)
        adapter = _load(self.adapters, lora_request)
        if draft_lora_request is None and self.config.draft_model == "self":
            draft_lora_request = lora_request  # the quantized copy drafts with the same adapter
        if draft_lora_request is not None and self.draft_adapters is None:
            message = "draft_lora_request needs an engine with a draft model"
            raise ParamError("draft_lora_request", message)
        draft_adapter = _load(self.draft_adapters, draft_lora_request)
        # Prefix-cache keys carry the adapters and their versions: blocks hold the target's KV
        # and the draft model's, so neither is shared across adapters.
        salt = cache_extra_keys(
            cache_salt,
            adapter.cache_key if adapter else b"",
            draft_adapter.cache_key if draft_adapter else b"",
        )
        eos, max_len, block_size = self.eos_token_ids, self.max_model_len, self.config.block_size
        requests = [
            Request(request_id, ids, params, eos, max_len, i, salt, block_size)
            for i in range(params.n)
        ]
        for r in requests:
            r.lora, r.draft_lora = adapter, draft_adapter
            if compiled is not None or params.thinking_token_budget is not None:
                self.grammar_manager().attach(r, compiled)
            if predicted is not None:
                self.speculation.predict(r, predicted)
        group = RequestGroup(request_id, text, requests, self.decoder)
        self.groups[request_id] = group
        self.scheduler.add(group.leader)

    def load_lora(self, lora_request: LoRARequest) -> LoRAAdapter:
        """Load (or find loaded) the target's adapter a request names (lora.registry)."""
        return self.adapters.load(lora_request)

    def unload_lora(self, name: str) -> None:
        self.adapters.unload(name)

    def compile_constraint(self, constraint: StructuredOutputs | None):
        """Compile (or fetch from the cache) a request's constraint; ValueError if it is invalid,
        unsupported or slower to compile than grammar_compile_timeout. Thread-safe: a server
        calls it from the submitting thread, so the engine loop never waits for a compile."""
        if constraint is None:
            return None
        return self.grammar_manager().compiler.compile(constraint)

    async def compile_constraint_async(self, constraint: StructuredOutputs | None):
        """As compile_constraint, awaited: no thread is held while the compile runs."""
        if constraint is None:
            return None
        if self.grammar is None:  # built once: the tokenizer's vocabulary for xgrammar
            await asyncio.to_thread(self.grammar_manager)
        return await self.grammar.compiler.compile_async(constraint)

    def grammar_manager(self):
        """The grammar manager (constraints, thinking budgets), built on first use; thread-safe."""
        with self._grammar_lock:
            if self.grammar is None:
                from engine.grammar.matcher import GrammarManager  # xgrammar: loaded when needed

                cfg = self.config
                grammar = GrammarManager.build(
                    self.tokenizer, self.vocab_size, self.eos_token_ids, cfg
                )
                self.runner.logits_masker = grammar.mask
                self.speculation.use_grammar(grammar, cfg.grammar_forced_tokens)
                self.grammar = grammar
            return self.grammar

    def abort_request(self, request_id: str | list[str]) -> None:
        for rid in [request_id] if isinstance(request_id, str) else request_id:
            if rid in self.groups:
                self._end_group(self.groups[rid], RequestStatus.FINISHED_ABORTED)

    def has_unfinished_requests(self) -> bool:
        """Requests to run, a step still in flight (its requests may all have ended: one
        more step() collects it), or outputs a failed step() could not return."""
        return bool(self.groups or self._undelivered) or self.pipeline.in_flight is not None

    # ---- one step ----------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule, propose drafts, run the target over tokens + drafts, verify, append.

        Under async scheduling a step is launched before the previous one is collected: its
        tokens are appended (and its outputs returned) while the new step runs on the device.
        A step whose successor needs its tokens on the host is collected before scheduling.
        If a step() raises after collecting a step, the outputs that one produced (a finished
        request's only output, with FINAL_ONLY) come with the next step()."""
        touched, self._undelivered = self._undelivered, []
        try:
            self._step(touched)
        except BaseException:
            self._undelivered = touched
            raise
        groups = list({id(g): g for g in touched}.values())
        spec_of = self.speculation.of_group if self.speculation.active else None
        return [out for g in groups if (out := g.make_output(spec_of)) is not None]

    def _step(self, touched: list[RequestGroup]) -> None:
        """One step's work; the groups it touches go into `touched` as soon as they are."""
        pipeline, spec = self.pipeline, self.speculation
        if pipeline.must_land:
            touched += self._collect(pipeline.take())
        if spec.active:
            wanted = spec.plan(self.scheduler.running, self.scheduler.waiting)
        else:
            wanted = self._lookahead()
        sched = self.scheduler.schedule(wanted)
        sched.lookahead = not spec.active and bool(wanted)
        if sched.requests:
            launched = self._launch(sched)
            previous = pipeline.push(launched)
            if previous is not None:
                touched += self._collect(previous)
            if not launched.overlappable:
                touched += self._collect(pipeline.take())
            self.num_steps += 1
        elif pipeline.in_flight is not None:  # nothing more to launch: the last step lands
            touched += self._collect(pipeline.take())

    def _lookahead(self) -> dict[Request, int] | None:
        """Slots for num_scheduler_steps - 1 more greedy tokens per running request, where the
        runner decodes them all in one call and nobody watches them arrive: every running
        request decoding, FINAL_ONLY, and nothing waiting to be admitted."""
        steps, scheduler = self.config.num_scheduler_steps, self.scheduler
        if steps == 1 or scheduler.waiting or not scheduler.running or self.async_scheduling:
            return None
        final = RequestOutputKind.FINAL_ONLY
        if not all(
            r.is_decoding and r.params.output_kind == final and self.runner.decodes(r)
            for r in scheduler.running
        ):
            return None
        return {r: steps - 1 for r in scheduler.running}

    def _launch(self, sched: SchedulerOutput) -> InFlight:
        """Propose drafts and queue the target's step."""
        tables = self.kv.block_tables
        t0 = time.perf_counter()
        try:
            if self.speculation.active:
                self.speculation.propose(sched, tables, self.grammar)
            t1 = time.perf_counter()
            launched = self.runner.launch(sched, tables)
        except BaseException:
            self.kv.release_copy_sources()
            self.scheduler.unschedule(sched)
            raise
        uncomputed = self.kv.step_launched()
        self.kv.release_copy_sources()
        overlappable = self.async_scheduling and may_overlap(
            launched.members, lambda r: self.speculation.holds_back(r, sched)
        )
        step = InFlight(sched, launched, t0, t1, overlappable, uncomputed)
        step.count_launched()
        return step

    def _collect(self, step: InFlight) -> list[RequestGroup]:
        """Wait for a launched step's results and land them: verdicts, tokens, stop checks.
        Requests that finished or were aborted since it was launched are skipped."""
        try:
            result = step.launched.wait()
        except BaseException:
            # Its tokens never come: its requests queue again, and so do those of a step
            # launched after it (which read them on the device); the blocks either was to
            # fill leave the prefix cache.
            for lost in filter(None, (step, self.pipeline.take())):
                lost.count_landed()
                self.kv.forget_uncomputed(lost.uncomputed)
                self.scheduler.unschedule(lost.sched)
            raise
        step.count_landed()
        sched = step.sched
        if self.scheduler.step_budget is not None:  # launch to landing: the step's time
            self.scheduler.step_budget.observe(sched.total_tokens, time.perf_counter() - step.t0)
        if self.speculation.active:
            self.speculation.observe_step(sched, step.t0, step.t1, time.perf_counter())
        for request, _, k in sched.scheduled():
            if request.is_finished:
                continue
            num_accepted = result.num_accepted.get(request, 0)
            request.num_computed_tokens += num_accepted
            if k and sched.lookahead:  # its tokens are plain; free the slots it did not fill
                result.kinds[request] = "p" * (num_accepted + 1)
                self.kv.trim(request)
                self.kv.cache_blocks(request)
            elif k:
                self._settle_drafts(request, sched, num_accepted, result)
        touched = self._process_samples(result)
        for group in self._end_failed([*sched.requests, *self.scheduler.running]):
            if group not in touched:
                touched.append(group)
        return touched

    def _settle_drafts(
        self, request: Request, sched: SchedulerOutput, num_accepted: int, result: StepResult
    ) -> None:
        """After a verification: the first num_accepted drafts hold. Reclaim the slots of the
        rejected ones, record the emitted tokens' kinds and the rejected drafts on the result,
        count, and cache the blocks the accepted ones filled."""
        self.kv.trim(request)
        drafts, num_forced = sched.drafts[request], sched.num_forced[request]
        result.kinds[request] = step_token_kinds(len(drafts), num_forced, num_accepted)
        result.rejected[request] = drafts[num_accepted:]
        self.speculation.record(request, len(drafts), num_forced, num_accepted)
        if self.draft_runner is not None:
            computed = request.num_computed_tokens
            request.num_draft_computed = min(request.num_draft_computed, computed)
            self.kv.mark_draft_computed(request)
        # The scheduler registered the blocks of the step's own tokens; accepted drafts may
        # have filled more.
        self.kv.cache_blocks(request)

    def _end_failed(self, requests: list[Request]) -> list[RequestGroup]:
        """End the group of every request whose processing failed this step (Request.fail):
        all its completions finish with "error", its blocks and matchers are released."""
        ended = []
        for request in requests:
            group = self.groups.get(request.request_id) if request.error else None
            if group is not None:
                self._end_group(group, RequestStatus.FINISHED_ERROR)
                self.num_request_errors += 1
                ended.append(group)
        return ended

    def _end_group(self, group: RequestGroup, status: RequestStatus) -> None:
        """Finish every completion of the group not finished yet; the engine forgets it."""
        for request in group.requests:
            if not request.is_finished:
                self.scheduler.finish(request, status)
        del self.groups[group.request_id]

    def _process_samples(self, result: StepResult) -> list[RequestGroup]:
        touched: dict[str, RequestGroup] = {}
        ended: list[RequestGroup] = []  # groups a completion of which finished this step
        for request, (first, prompt_lps) in result.prompt_logprobs.items():
            if request.request_id in self.groups:
                self.groups[request.request_id].add_prompt_logprobs(first, prompt_lps)
        for request, _ in result.sampled:
            if request.status == RequestStatus.FORK_PENDING and request.request_id in self.groups:
                # Fork every sibling before any append can finish (and free) the leader.
                # Its first token: sampled from the leader's logits (a plain token).
                self.scheduler.fork(self.groups[request.request_id].leader, request)
        for request, tokens in result.sampled:
            request.siblings = []
            if request.error or request.is_finished:  # failed this step (e.g. its mask), or
                continue  # ended while the step ran (async scheduling): nothing of it is kept
            group = self.groups[request.request_id]
            touched[group.request_id] = group
            logprobs = result.logprobs.get(request) or [None] * len(tokens)
            kinds, rejected = result.kinds.get(request, "p"), result.rejected.get(request, [])
            for token, lp, kind in zip(tokens, logprobs, kinds, strict=True):
                self.num_generated_tokens += 1
                status = group.append(request, token, lp, kind, rejected, self.grammar)
                if status is not None:
                    self.scheduler.finish(request, status)
                    ended.append(group)
                    break  # finished: later tokens of a multi-token step are dropped
                if request.error:
                    break
        for group in ended:  # a group is done when its last completion is
            if group.finished:
                self.groups.pop(group.request_id, None)
        return list(touched.values())

    def snapshot(self) -> dict:
        return snapshot(self)


def _load(adapters: AdapterRegistry | None, lora_request: LoRARequest | None) -> LoRAAdapter | None:
    """The adapter a request names (None: none), its errors naming the request's field."""
    if lora_request is None:
        return None
    try:
        return adapters.load(lora_request)
    except ValueError as exc:  # the registry's and the adapter loader's own errors
        raise ParamError(adapters.param, str(exc)) from None
