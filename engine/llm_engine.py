"""The engine: add_request / step / abort, for servers; `LLM` wraps it for batch and streaming."""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

import torch
from transformers import AutoTokenizer

from engine.attention import resolve_backend
from engine.config import MAX_SPECULATIVE_TOKENS, EngineConfig
from engine.detokenizer import ExactDecoder, IncrementalDetokenizer
from engine.grammar.constraint import StructuredOutputs
from engine.introspection import snapshot
from engine.kv_cache_manager import KVCacheManager
from engine.model_runner import LaunchedStep, ModelRunner, StepResult, kv_bytes_per_block
from engine.models.loader import (
    draft_load_args,
    load_model,
    needs_dense,
    read_generation_eos,
)
from engine.models.registry import resolve_model
from engine.outputs import (
    NOTHING_SENT,
    CompletionOutput,
    Logprob,
    RequestMetrics,
    RequestOutput,
    Sent,
    advance,
)
from engine.request import FINISH_REASONS, Request, RequestStatus, step_token_kinds
from engine.sampling_params import RequestOutputKind, SamplingParams
from engine.scheduler import Scheduler, SchedulerOutput
from lora.adapter import LoRAAdapter, LoRARequest, load_adapter
from lora.batch import LoRASlots
from spec.adaptive import AdaptiveSpeculation
from spec.draft_model import DraftModelProposer
from spec.metrics import SpecStats
from spec.proposer import ForcedTokens, NgramProposer, Proposer


class RequestGroup:
    """What the user submitted: one prompt, n completions (one Request each)."""

    def __init__(self, request_id: str, prompt: str | None, requests: list[Request], detoks):
        self.request_id = request_id
        self.prompt = prompt
        self.requests = requests
        self.detokenizers: list[IncrementalDetokenizer] = detoks
        self.metrics = RequestMetrics(arrival_time=time.monotonic())
        # DELTA: per completion, what of it is already in an output; whether the prompt
        # logprobs are.
        self.sent: list[Sent] = [NOTHING_SENT] * len(requests)
        self.sent_prompt_logprobs = False

    @property
    def finished(self) -> bool:
        return all(r.is_finished for r in self.requests)

    @property
    def failed(self) -> Request | None:
        """The request whose own processing failed (Request.fail), if one did."""
        return next((r for r in self.requests if r.error), None)


@dataclass
class InFlight:
    """A launched step: what was scheduled, the runner's handle, when drafting and the
    target's launch began, whether the next step may be scheduled before it lands, and the
    blocks it fills that the prefix cache offers already."""

    sched: SchedulerOutput
    launched: LaunchedStep
    t0: float
    t1: float
    overlappable: bool
    uncomputed: list[int]  # blocks registered in the prefix cache ahead of it


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None, **kwargs):
        self.config = config = config or EngineConfig(**kwargs)
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        torch.set_flush_denormal(True)
        device, dtype = config.torch_device, config.torch_dtype
        self_draft = config.draft_model == "self"  # the exact target drafts for itself
        quantization = None if self_draft else config.quantization
        path = resolve_model(config.model, dense=needs_dense(quantization, device))
        self.tokenizer = AutoTokenizer.from_pretrained(str(path))
        self._decode = ExactDecoder(self.tokenizer)
        if device.type == "cuda" and device.index is not None:
            # Triton launches and CUDA graphs act on the current device, not the tensors'.
            torch.cuda.set_device(device)
        model, self.model_config, _ = load_model(
            path, device=device, dtype=dtype, quantization=quantization
        )
        cfg = self.model_config
        self.max_model_len = min(
            config.max_model_len or cfg.max_position_embeddings, cfg.max_position_embeddings
        )
        self.eos_token_ids = read_generation_eos(path)
        if self.tokenizer.eos_token_id is not None:
            self.eos_token_ids.add(self.tokenizer.eos_token_id)
        self.vocab_size = cfg.vocab_size
        draft = None
        if config.spec_method == "draft":
            draft_dense = needs_dense(config.draft_quantization, device)
            draft_path = path if self_draft else resolve_model(config.draft_model, draft_dense)
            draft_model, draft_cfg, _ = load_model(
                draft_path,
                device=device,
                dtype=dtype,
                **draft_load_args(config.draft_quantization, draft_path, device),
            )
            if draft_cfg.vocab_size != cfg.vocab_size:
                raise ValueError(
                    f"draft_model vocabulary ({draft_cfg.vocab_size}) differs from the target's "
                    f"({cfg.vocab_size}); the two models must share a tokenizer"
                )
            draft = (draft_model, draft_cfg)
        block_bytes = kv_bytes_per_block(cfg, config.block_size, dtype)
        if draft is not None:  # the draft's KV lives in the same blocks: budget both
            block_bytes += kv_bytes_per_block(draft[1], config.block_size, dtype)
        num_blocks = config.num_kv_blocks or max(2, config.kv_budget_bytes() // block_bytes)
        self.kv = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(
            self.kv,
            config.max_num_seqs,
            config.max_num_batched_tokens,
            config.max_loras if config.enable_lora else None,
        )
        backend = resolve_backend(config.attention_backend, cfg.sliding_window, device)
        self.runner = ModelRunner(model, cfg, num_blocks, config.block_size, backend)
        self.loras: OrderedDict[str, LoRAAdapter] = OrderedDict()  # loaded, least recent first
        self.draft_loras: OrderedDict[str, LoRAAdapter] = OrderedDict()  # for the draft model
        if config.enable_lora:
            self.runner.lora_slots = LoRASlots(
                cfg, config.max_loras, config.max_lora_rank, device, dtype
            )
        self.runner.generator.manual_seed(config.seed)
        self.draft_runner = None
        self.proposer: Proposer | None = None
        if draft is not None:
            draft_backend = resolve_backend(
                config.attention_backend, draft[1].sliding_window, device
            )
            self.draft_runner = ModelRunner(*draft, num_blocks, config.block_size, draft_backend)
            self.draft_runner.lora_of = lambda request: request.draft_lora
            if config.enable_lora:
                self.draft_runner.lora_slots = LoRASlots(
                    draft[1], config.max_loras, config.max_lora_rank, device, dtype
                )
            self.proposer = DraftModelProposer(self.draft_runner)
        elif config.spec_method == "ngram":
            self.proposer = NgramProposer(config.ngram_min, config.ngram_max)
        if device.type == "cuda" and backend == "triton" and not config.enforce_eager:
            max_query_len = 1 + (config.num_speculative_tokens if self.proposer else 0)
            for runner in filter(None, (self.runner, self.draft_runner)):
                runner.use_graphs(config.max_num_seqs, self.max_model_len, max_query_len)
        self.async_scheduling = (
            device.type == "cuda" if config.async_scheduling is None else config.async_scheduling
        )
        # Sampled tokens stay on the device only for a next step launched before they reach the
        # host; with a proposer no step overlaps (see _overlappable), so none is kept.
        self.runner.keep_sampled = self.async_scheduling and self.proposer is None
        self._in_flight: InFlight | None = None  # a launched step not yet collected
        # Groups a step() touched before it raised: their outputs come with the next step().
        self._undelivered: list[RequestGroup] = []
        self.forced_tokens: ForcedTokens | None = None  # e.g. a grammar's forced tokens
        self.adaptive: AdaptiveSpeculation | None = None
        if self.proposer is not None and config.adaptive_speculation:
            self.adaptive = AdaptiveSpeculation(uses_draft_model=draft is not None)
        self.grammar = None  # GrammarManager, made for the first constrained request
        self._grammar_lock = threading.Lock()
        self.spec_stats = SpecStats()
        self.spec_by_adapter: dict[str, SpecStats] = {}
        self.spec_time = {"draft": 0.0, "verify": 0.0}
        self.groups: dict[str, RequestGroup] = {}
        self.num_steps = 0
        self.num_overlapped_steps = 0  # launched while the previous step was still in flight
        self.num_generated_tokens = 0
        self.num_request_errors = 0  # groups ended by a failure of their own (Request.fail)

    # ---- requests in -------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        cache_salt: str | None = None,
        lora_request: LoRARequest | None = None,
        draft_lora_request: LoRARequest | None = None,
    ) -> None:
        """lora_request: the target's adapter; draft_lora_request: the draft model's own adapter
        (a draft-model engine only; none by default)."""
        params = params or SamplingParams()
        if request_id in self.groups:
            raise ValueError(f"request_id {request_id!r} is already in use")
        if isinstance(prompt, str):
            text, ids = prompt, self.tokenizer.encode(prompt)
        else:
            text, ids = None, list(prompt)
            bad = [t for t in ids if not isinstance(t, int) or not 0 <= t < self.vocab_size]
            if bad:
                raise ValueError(f"prompt token id {bad[0]!r} is outside [0, {self.vocab_size})")
        self._check_fits(ids, params)
        params.check_vocab(self.vocab_size)
        compiled = self.compile_constraint(params.structured_outputs)
        adapter = self.load_lora(lora_request) if lora_request is not None else None
        if draft_lora_request is None and self.config.draft_model == "self":
            draft_lora_request = lora_request  # the quantized copy drafts with the same adapter
        draft_adapter = None
        if draft_lora_request is not None:
            draft_adapter = self.load_lora(draft_lora_request, for_draft=True)
        # Prefix-cache keys carry the adapters and their versions: blocks hold the target's KV
        # and the draft model's, so neither is shared across adapters.
        salt = (cache_salt or "").encode() + (adapter.cache_key if adapter else b"")
        if draft_adapter is not None:
            salt += b"\x00draft" + draft_adapter.cache_key
        requests = [
            Request(
                request_id,
                ids,
                params,
                self.eos_token_ids,
                self.max_model_len,
                i,
                salt,
                self.config.block_size,
            )
            for i in range(params.n)
        ]
        for r in requests:
            r.lora, r.draft_lora = adapter, draft_adapter
            if compiled is not None:
                self.grammar.attach(r, compiled, params.structured_outputs.kind)
        for sibling in requests[1:]:
            sibling.status = RequestStatus.FORK_PENDING
        requests[0].siblings = requests[1:]
        detoks = [
            IncrementalDetokenizer(
                self._decode,
                ids,
                params.skip_special_tokens,
                params.stop,
                params.include_stop_str_in_output,
            )
            for _ in requests
        ]
        self.groups[request_id] = RequestGroup(request_id, text, requests, detoks)
        self.scheduler.add(requests[0])

    # ---- LoRA adapters ---------------------------------------------------------------------
    def load_lora(self, lora_request: LoRARequest, for_draft: bool = False) -> LoRAAdapter:
        """Load (or find loaded) the adapter a request names (for the draft model with
        for_draft). Loading a name again from another path replaces it: requests in flight keep
        the weights they started with."""
        what = "draft_lora_request" if for_draft else "lora_request"
        if not self.config.enable_lora:
            raise ValueError(f"{what} needs an engine with enable_lora=True")
        if not isinstance(lora_request, LoRARequest):
            raise ValueError(f"{what} must be a LoRARequest, got {lora_request!r:.80}")
        if for_draft and self.draft_runner is None:
            raise ValueError("draft_lora_request needs an engine with a draft model")
        loaded = self.draft_loras if for_draft else self.loras
        current = loaded.get(lora_request.name)
        if current is not None and current.path == str(lora_request.path):
            loaded.move_to_end(lora_request.name)
            return current
        cfg = self.draft_runner.cfg if for_draft else self.model_config
        adapter = load_adapter(lora_request, cfg, self.config.max_lora_rank)
        loaded[lora_request.name] = adapter
        loaded.move_to_end(lora_request.name)
        limit = self.config.max_cpu_loras or 2 * self.config.max_loras
        in_use = self._loras_in_use()
        for name in [n for n, a in loaded.items() if id(a) not in in_use]:
            if len(loaded) <= limit:
                break
            self.unload_lora(name, for_draft)
        return adapter

    def unload_lora(self, name: str, for_draft: bool = False) -> None:
        """Forget an adapter. Requests in flight with it finish with it (they hold its weights);
        new requests must load it again."""
        adapter = (self.draft_loras if for_draft else self.loras).pop(name, None)
        if adapter is None:
            raise ValueError(f"no LoRA adapter named {name!r} is loaded")
        if id(adapter) not in self._loras_in_use():
            runner = self.draft_runner if for_draft else self.runner
            runner.lora_slots.evict(adapter)

    def _loras_in_use(self) -> set[int]:
        return {
            id(a)
            for g in self.groups.values()
            for r in g.requests
            for a in (r.lora, r.draft_lora)
            if a is not None
        }

    def compile_constraint(self, constraint: StructuredOutputs | None):
        """Compile (or fetch from the cache) a request's constraint; ValueError if it is invalid,
        unsupported or slower to compile than grammar_compile_timeout. Thread-safe: a server
        calls it from the submitting thread, so the engine loop never waits for a compile."""
        if constraint is None:
            return None
        return self._grammar_manager().compiler.compile(constraint)

    def _grammar_manager(self):
        with self._grammar_lock:
            if self.grammar is None:
                from engine.grammar.compiler import GrammarCompiler, tokenizer_info
                from engine.grammar.matcher import GrammarManager

                cfg = self.config
                compiler = GrammarCompiler(
                    tokenizer_info(self.tokenizer, self.vocab_size, self.eos_token_ids),
                    cfg.grammar_cache_size,
                    cfg.grammar_compile_timeout,
                )
                rows = cfg.max_num_seqs * (MAX_SPECULATIVE_TOKENS + 1)
                grammar = GrammarManager(compiler, self.tokenizer, self.vocab_size, rows)
                self.runner.logits_masker = grammar.mask
                if self.draft_runner is not None:
                    self.proposer.logits_masker = grammar.mask
                if cfg.grammar_forced_tokens and self.forced_tokens is None:
                    self.forced_tokens = grammar
                self.grammar = grammar
            return self.grammar

    def _check_fits(self, ids: list[int], params: SamplingParams) -> None:
        if not ids:
            raise ValueError("prompt must contain at least one token")
        if len(ids) >= self.max_model_len:
            raise ValueError(
                f"prompt has {len(ids)} tokens, the context limit is {self.max_model_len} "
                "(and at least one token must be generated)"
            )
        if params.n > self.config.max_num_seqs:
            raise ValueError(
                f"n={params.n} is over max_num_seqs={self.config.max_num_seqs}: the "
                "completions of one prompt run side by side"
            )
        total = min(len(ids) + (params.max_tokens or self.max_model_len), self.max_model_len)
        bs = self.config.block_size
        need = -(-len(ids) // bs) + params.n * (-(-(total - len(ids)) // bs) + 1)
        if need > self.kv.pool.num_usable:
            raise ValueError(
                f"request needs up to {need} KV blocks ({total} tokens x n={params.n}) but the "
                f"pool has {self.kv.pool.num_usable}; lower max_tokens or n, or give the KV "
                "cache more memory"
            )

    def abort_request(self, request_id: str | list[str]) -> None:
        for rid in [request_id] if isinstance(request_id, str) else request_id:
            group = self.groups.pop(rid, None)
            if group is None:
                continue
            for r in group.requests:
                if not r.is_finished:
                    self.scheduler.finish(r, RequestStatus.FINISHED_ABORTED)

    def has_unfinished_requests(self) -> bool:
        """Requests to run, a step still in flight (its requests may all have ended: one
        more step() collects it), or outputs a failed step() could not return."""
        return bool(self.groups or self._undelivered) or self._in_flight is not None

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
        return [out for g in groups if (out := self._make_output(g)) is not None]

    def _step(self, touched: list[RequestGroup]) -> None:
        """One step's work; the groups it touches go into `touched` as soon as they are."""
        if self._in_flight is not None and not self._in_flight.overlappable:
            touched += self._collect(self._take_in_flight())
        self._plan_speculation()
        sched = self.scheduler.schedule()
        if sched.requests:
            launched = self._launch(sched)
            previous, self._in_flight = self._in_flight, launched
            if previous is not None:
                self.num_overlapped_steps += 1
                touched += self._collect(previous)
            if not launched.overlappable:
                touched += self._collect(self._take_in_flight())
            self.num_steps += 1
        elif self._in_flight is not None:  # nothing more to launch: the last step lands
            touched += self._collect(self._take_in_flight())

    @staticmethod
    def _landed(step: InFlight) -> None:
        """The step's K/V writes and sampled tokens are done (or will never be)."""
        for request, n, k in step.sched.scheduled():
            request.num_inflight_tokens -= n - k
        for request in step.launched.members:
            request.num_pending -= 1

    def _take_in_flight(self) -> InFlight:
        step, self._in_flight = self._in_flight, None
        return step

    def _launch(self, sched: SchedulerOutput) -> InFlight:
        """Propose drafts and queue the target's step; the scheduled tokens count as computed
        from here (drafts once verified)."""
        tables = self.kv.block_tables
        t0 = time.perf_counter()
        try:
            if self.proposer is not None or self.forced_tokens is not None:
                self._propose(sched, tables)
            t1 = time.perf_counter()
            launched = self.runner.launch(sched, tables)
        except BaseException:
            self.kv.release_copy_sources()
            self.scheduler.unschedule(sched)
            raise
        uncomputed = self.kv.step_launched()
        self.kv.release_copy_sources()
        for request, n, k in sched.scheduled():
            request.num_computed_tokens += n - k
            request.num_inflight_tokens += n - k
        for request in launched.members:
            request.num_pending += 1
        return InFlight(sched, launched, t0, t1, self._overlappable(launched.members), uncomputed)

    def _overlappable(self, members: list[Request]) -> bool:
        """Whether the next step may be scheduled before these requests' tokens reach the host:
        nothing that shapes their next step reads them (drafts, forced tokens, grammar masks,
        penalties, min_tokens bans, forking n > 1 siblings)."""
        if not self.async_scheduling or self.proposer is not None:
            return False
        forced = self.forced_tokens
        return not any(
            r.grammar is not None
            or (forced is not None and forced.applies_to(r))
            or r.spec_token_ids
            or r.siblings
            or r.status == RequestStatus.FORK_PENDING
            or r.params.has_penalties
            or r.num_output_tokens < r.params.min_tokens
            for r in members
        )

    def _collect(self, step: InFlight) -> list[RequestGroup]:
        """Wait for a launched step's results and append them: verdicts, stop checks, outputs.
        Requests that finished or were aborted since it was launched are skipped."""
        try:
            result = step.launched.wait()
        except BaseException:
            # Its tokens never come: its requests queue again, and so do those of a step
            # launched after it (which read them on the device); the blocks either was to
            # fill leave the prefix cache.
            for lost in filter(None, (step, self._take_in_flight())):
                self._landed(lost)
                self.kv.forget_uncomputed(lost.uncomputed)
                self.scheduler.unschedule(lost.sched)
            raise
        t2 = time.perf_counter()
        sched, t0, t1 = step.sched, step.t0, step.t1
        self._landed(step)
        self.spec_time["draft"] += t1 - t0
        self.spec_time["verify"] += t2 - t1
        num_tokens, num_drafts = sched.total_tokens, sum(sched.num_drafts)
        self._observe_costs(num_tokens, t2 - t1)
        for request, n, k in sched.scheduled():
            if request.is_finished:
                continue
            # This request's share of the step: draft time by its drafts, target time by rows.
            request.spec.draft_seconds += (t1 - t0) * k / num_drafts if num_drafts else 0.0
            request.spec.target_seconds += (t2 - t1) * n / num_tokens
            num_accepted = result.num_accepted.get(request, 0)
            request.num_computed_tokens += num_accepted
            request.step_kinds = "p"
            if k:  # reclaim the slots of rejected drafts
                self.kv.trim(request)
                num_forced = min(len(request.forced_token_ids), k)
                request.step_kinds = step_token_kinds(k, num_forced, num_accepted)
                request.step_rejected = request.spec_token_ids[num_accepted:]
                request.spec.record(k, num_accepted, num_forced)
                self.spec_stats.record(k, num_accepted, num_forced)
                if request.lora is not None:  # acceptance per adapter
                    by_adapter = self.spec_by_adapter.setdefault(request.lora.name, SpecStats())
                    by_adapter.record(k, num_accepted, num_forced)
                if self.adaptive is not None and num_accepted >= num_forced:
                    # The proposer's share: its drafts were judged only if the forced ones held.
                    self.adaptive.observe_verification(
                        request.acceptance, k - num_forced, num_accepted - num_forced
                    )
                request.spec_token_ids, request.draft_probs = [], None
                if self.draft_runner is not None:
                    request.num_draft_computed = min(
                        request.num_draft_computed, request.num_computed_tokens
                    )
                    self.kv.mark_draft_computed(request)
                # The scheduler registered the blocks of the step's own tokens; accepted drafts
                # may have filled more.
                self.kv.cache_blocks(request)
        touched = self._process_samples(result)
        for group in self._end_failed([*sched.requests, *self.scheduler.running]):
            if group not in touched:
                touched.append(group)
        return touched

    def _end_failed(self, requests: list[Request]) -> list[RequestGroup]:
        """End the group of every request whose processing failed this step (Request.fail):
        all its completions finish with "error", its blocks and matchers are released."""
        ended = []
        for request in requests:
            group = self.groups.get(request.request_id) if request.error else None
            if group is None:
                continue
            for member in group.requests:
                if not member.is_finished:
                    self.scheduler.finish(member, RequestStatus.FINISHED_ERROR)
            del self.groups[request.request_id]
            self.num_request_errors += 1
            ended.append(group)
        return ended

    def _plan_speculation(self) -> None:
        """Draft slots each running request asks for in the coming step: its forced tokens,
        then its own k if it set one, else the engine's (a fixed k, or the adaptive plan
        capped by it)."""
        if self.proposer is None and self.forced_tokens is None:
            return
        default = self.config.num_speculative_tokens if self.proposer is not None else 0
        adaptive = []
        for request in self.scheduler.running:
            request.forced_token_ids = []
            # (A token still in flight: what it forces next is not known yet.)
            ready = request.is_decoding and not request.error and not request.num_pending
            if self.forced_tokens is not None and ready:
                try:
                    request.forced_token_ids = self.forced_tokens.forced_tokens(
                        request, MAX_SPECULATIVE_TOKENS
                    )
                except Exception as exc:  # one request's grammar: that request alone
                    request.fail("grammar", exc)
            k = request.params.num_speculative_tokens if self.proposer is not None else 0
            request.num_spec_wanted = default if k is None else k
            if k is None and self.adaptive is not None and request.is_decoding:
                adaptive.append(request)
        if adaptive:
            self._plan_adaptive(adaptive, default)
        for request in self.scheduler.running:
            if request.forced_token_ids:
                request.num_spec_wanted = min(
                    len(request.forced_token_ids) + request.num_spec_wanted,
                    MAX_SPECULATIVE_TOKENS,
                )

    def _plan_adaptive(self, requests: list[Request], cap: int) -> None:
        candidates = []
        for request in requests:
            room = max(0, min(cap, request.max_output_tokens - request.num_output_tokens - 1))
            lag = request.num_tokens - request.num_draft_computed
            candidates.append(self.adaptive.candidate(request.acceptance, room, min(lag, room + 1)))
        for request, k in zip(requests, self.adaptive.plan(candidates), strict=True):
            request.num_spec_wanted = k
            if k == 0:  # not drafting teaches nothing: drift back towards the engine's rate
                self.adaptive.idle(request.acceptance)

    def _propose(self, sched: SchedulerOutput, tables: dict[Request, list[int]]) -> None:
        """Fill the draft slots: forced tokens first, then the proposer's drafts; give back the
        slots a request did not fill."""
        for request, _, k in sched.scheduled():
            request.spec_token_ids = request.forced_token_ids[:k]
        if self.proposer is not None:
            self.proposer.propose(sched, tables)
        if self.grammar is not None:  # cut each draft list at its first token the grammar refuses
            for request in sched.requests:
                try:
                    n = self.grammar.valid_prefix(request, request.spec_token_ids)
                except Exception as exc:
                    request.fail("grammar", exc)
                    n = 0
                del request.spec_token_ids[n:]
                if request.draft_probs is not None:
                    request.draft_probs = request.draft_probs[:n]
        for i, request in enumerate(sched.requests):
            num_drafts = len(request.spec_token_ids)
            sched.num_new_tokens[i] -= sched.num_drafts[i] - num_drafts
            sched.num_drafts[i] = num_drafts

    def _observe_costs(self, num_tokens: int, target_seconds: float) -> None:
        """Feed this step's measured times to the adaptive planner's cost fits."""
        pass_times = self.proposer.pass_times if self.draft_runner is not None else []
        if self.adaptive is not None:
            self.adaptive.target.observe(num_tokens, target_seconds)
            for rows, seconds in pass_times:
                self.adaptive.draft.observe(rows, seconds)
        pass_times.clear()

    def _process_samples(self, result: StepResult) -> list[RequestGroup]:
        touched: dict[str, RequestGroup] = {}
        ended: list[RequestGroup] = []  # groups a completion of which finished this step
        for request, prompt_lps in result.prompt_logprobs.items():
            request.prompt_logprobs.extend(map(self._decode_logprobs, prompt_lps))
        for request, _ in result.sampled:
            if request.status == RequestStatus.FORK_PENDING and request.request_id in self.groups:
                # Fork every sibling before any append can finish (and free) the leader.
                leader = self.groups[request.request_id].requests[0]
                self.kv.fork(leader, request)
                request.step_kinds = "p"  # its first token: sampled from the leader's logits
                request.num_computed_tokens = leader.num_computed_tokens
                request.num_draft_computed = leader.num_draft_computed
                self.scheduler.add_running(request)
        for request, tokens in result.sampled:
            request.siblings = []
            if request.error or request.is_finished:  # failed this step (e.g. its mask), or
                continue  # ended while the step ran (async scheduling): nothing of it is kept
            group = self.groups[request.request_id]
            touched[group.request_id] = group
            logprobs = result.logprobs.get(request) or [None] * len(tokens)
            for token, lp, kind in zip(tokens, logprobs, request.step_kinds, strict=True):
                if kind == "r":
                    request.rejected_drafts.append(
                        (request.num_output_tokens, request.step_rejected)
                    )
                request.token_kinds.append(kind)
                if self._append(group, request, token, lp):
                    ended.append(group)
                    break  # finished: later tokens of a multi-token step are dropped
                if request.error:
                    break
        for group in ended:  # a group is done when its last completion is
            if group.finished:
                self.groups.pop(group.request_id, None)
        return list(touched.values())

    def _append(self, group: RequestGroup, request: Request, token: int, logprobs) -> bool:
        """Append one token and check stop conditions; True when the request finished."""
        request.append_token(token)
        self.num_generated_tokens += 1
        if group.metrics.first_token_time is None:
            group.metrics.first_token_time = time.monotonic()
        try:
            terminated = request.grammar is not None and self.grammar.commit(request, token)
        except Exception as exc:
            request.fail("grammar", exc)
            return False
        if logprobs is not None:  # decoded once here: outputs repeat them, step after step
            request.logprobs.append(self._decode_logprobs(logprobs))
            request.cumulative_logprob += logprobs[token][0]
        detok = group.detokenizers[request.index]
        p = request.params
        status = None
        may_stop = request.num_output_tokens > p.min_tokens  # vLLM: stops count after min_tokens
        if may_stop:
            if token in p.stop_token_ids:
                status, request.stop_reason = RequestStatus.FINISHED_STOPPED, token
            elif token in request.eos_token_ids:
                status = RequestStatus.FINISHED_STOPPED
        try:
            stop = detok.add_token(token, may_stop) if status is None else None
        except Exception as exc:
            request.fail("detokenizer", exc)
            return False
        if stop is not None:
            status, request.stop_reason = RequestStatus.FINISHED_STOPPED, stop
        if status is None and terminated:  # the grammar is complete (e.g. with ignore_eos)
            status = RequestStatus.FINISHED_STOPPED
        if status is None and request.num_output_tokens >= request.max_output_tokens:
            status = RequestStatus.FINISHED_LENGTH
        if status is not None:
            if request.stop_reason is None or isinstance(request.stop_reason, int):
                detok.flush()
            self.scheduler.finish(request, status)
        return status is not None

    # ---- outputs -----------------------------------------------------------------------
    def _decode_logprobs(self, raw: dict[int, tuple[float, int]]) -> dict[int, Logprob]:
        decode = self._decode
        return {
            t: Logprob(lp, rank, decode([t], skip_special_tokens=False))
            for t, (lp, rank) in raw.items()
        }

    def _make_output(self, group: RequestGroup) -> RequestOutput | None:
        """The group's output after a step that touched it, as its output_kind asks: everything
        so far (CUMULATIVE), what is new (DELTA: completions with nothing new are left out),
        or nothing until it has finished (FINAL_ONLY)."""
        finished = group.finished
        kind = group.requests[0].params.output_kind
        if kind == RequestOutputKind.FINAL_ONLY and not finished:
            return None
        completions = []
        for request, detok in zip(group.requests, group.detokenizers, strict=True):
            visible = detok.visible_len(request.is_finished)
            chars = tokens = 0
            if kind == RequestOutputKind.DELTA:
                chars, tokens, _ = sent = group.sent[request.index]
                ended = request.is_finished
                sent = advance(sent, visible, request.num_output_tokens, ended)
                if sent is None:
                    continue  # nothing new of this completion
                group.sent[request.index] = sent
            text = detok.text[chars:visible]
            completions.append(self._completion(request, text, tokens))
        leader, failed = group.requests[0], group.failed
        prompt_lps = None
        if leader.params.prompt_logprobs is not None and not group.sent_prompt_logprobs:
            prompt_lps = [None, *leader.prompt_logprobs]
            group.sent_prompt_logprobs = kind == RequestOutputKind.DELTA
        if finished and group.metrics.finished_time is None:
            group.metrics.finished_time = time.monotonic()
        group.metrics.num_cached_tokens = max(0, leader.num_cached_tokens)
        group.metrics.num_preemptions = sum(r.num_preemptions for r in group.requests)
        if self.proposer is not None or self.forced_tokens is not None:
            group.metrics.spec = SpecStats.merged(r.spec for r in group.requests)
        return RequestOutput(
            request_id=group.request_id,
            prompt=group.prompt,
            prompt_token_ids=leader.prompt_token_ids,
            outputs=completions,
            finished=finished,
            prompt_logprobs=prompt_lps,
            metrics=group.metrics,
            num_cached_tokens=group.metrics.num_cached_tokens,
            error=failed.error if failed else None,
            error_status=failed.error_status if failed else None,
        )

    @staticmethod
    def _completion(request: Request, text: str, tokens: int) -> CompletionOutput:
        """One completion after its first `tokens` tokens (0: all of it), `text` the matching
        part of its text. Lists are copies: later steps extend the request's own.
        rejected_drafts keep their indices into the whole completion."""
        with_logprobs = request.params.logprobs is not None
        start = request.num_prompt_tokens + tokens
        rejected = request.rejected_drafts
        return CompletionOutput(
            index=request.index,
            text=text,
            token_ids=request.token_ids[start:],
            cumulative_logprob=request.cumulative_logprob if with_logprobs else None,
            logprobs=request.logprobs[tokens:] if with_logprobs else None,
            finish_reason=FINISH_REASONS.get(request.status),
            stop_reason=request.stop_reason,
            token_kinds="".join(request.token_kinds[tokens:]),
            rejected_drafts=[r for r in rejected if r[0] >= tokens] if tokens else list(rejected),
        )

    def snapshot(self) -> dict:
        return snapshot(self)
