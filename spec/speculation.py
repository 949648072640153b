"""Speculation as the engine drives it, step by step: plan how many draft slots each running
request asks for, fill the slots the scheduler granted (forced tokens first, then the proposer's
drafts, cut where a grammar refuses), and account for what verification accepted.

Per step: `plan` before scheduling, `propose` once scheduled, `observe_step` and `record` once
the step's verdicts are on the host. Counters (spec.stats.SpecStats): `stats` (engine-wide),
`by_adapter`, each request's own (`of`), and `seconds` (draft passes, and the target's forward
plus verification); the adaptive planner's per-request acceptance history is kept here too.
"""

from __future__ import annotations

from collections.abc import Collection
from weakref import WeakKeyDictionary

from engine.config import MAX_PREDICTED_DRAFTS, MAX_SPECULATIVE_TOKENS, EngineConfig
from engine.model_runner import ModelRunner
from engine.request import Request
from engine.scheduler import SchedulerOutput
from spec.adaptive import Acceptance, AdaptiveSpeculation
from spec.draft_model import DraftModelProposer
from spec.prediction import Prediction, prediction_ids
from spec.proposer import ForcedTokens, NgramProposer, Proposer
from spec.stats import SpecStats
from spec.suffix import SuffixProposer

DEFAULT_K = 4  # drafts per step for n-gram and draft models (suffix: MAX_PREDICTED_DRAFTS)


class Speculation:
    def __init__(self, proposer: Proposer | None, k: int, adaptive: AdaptiveSpeculation | None):
        self.proposer = proposer
        # The engine's drafts per step (a cap when adaptive).
        self.k = k if proposer is not None else 0
        self.adaptive = adaptive
        self.forced_tokens: ForcedTokens | None = None  # e.g. a grammar's forced tokens
        self.stats = SpecStats()
        self.by_adapter: dict[str, SpecStats] = {}
        self.seconds = {"draft": 0.0, "verify": 0.0}
        self._acceptance: WeakKeyDictionary[Request, Acceptance] = WeakKeyDictionary()
        self._by_request: WeakKeyDictionary[Request, SpecStats] = WeakKeyDictionary()
        self.wanted: dict[Request, int] = {}  # the last plan's draft slots per request
        # The requests (id, index) of the last plan, and whether one joined since the engine
        # last started afresh (_batch_closed).
        self._present: set[tuple[str, int]] = set()
        self._joined = False
        self._forced: dict[Request, list[int]] = {}  # the last plan's forced tokens
        # Predicted Outputs (spec.prediction): each request's, and the last plan's drafts from it.
        self.predictions: WeakKeyDictionary[Request, Prediction] = WeakKeyDictionary()
        self._predicted: dict[Request, list[int]] = {}
        # Whether steps carry drafts at all (a proposer, or forced tokens): the engine plans,
        # proposes and accounts only then.
        self.active = proposer is not None

    def use_grammar(self, grammar, forced_tokens: bool) -> None:
        """A grammar now constrains some requests: the draft model proposes only what it allows;
        with forced_tokens, what it allows alone rides in the draft slots."""
        if self.draft_model is not None:
            self.draft_model.logits_masker = grammar.mask
        if forced_tokens and self.forced_tokens is None:
            self.force_with(grammar)

    @property
    def draft_model(self) -> DraftModelProposer | None:
        """The draft model's proposer, alone or after suffix drafts."""
        proposer = getattr(self.proposer, "fallback", self.proposer)
        return proposer if isinstance(proposer, DraftModelProposer) else None

    def force_with(self, forcer: ForcedTokens) -> None:
        """Tokens `forcer` knows ride in the draft slots from now on."""
        self.forced_tokens, self.active = forcer, True

    @staticmethod
    def prediction_ids(params, tokenizer, vocab_size: int) -> list[int] | None:
        """The request's prediction, checked, as token ids (None: it gave none)."""
        return prediction_ids(params.prediction, tokenizer, vocab_size)

    def predict(self, request: Request, token_ids: list[int]) -> None:
        """The request's output will mostly repeat token_ids: they ride in its draft slots
        after its forced tokens, on any engine (speculation is active from now on)."""
        self.predictions[request], self.active = Prediction(token_ids), True

    def of(self, request: Request) -> SpecStats:
        """The request's own counters."""
        own = self._by_request.get(request)
        if own is None:
            own = self._by_request[request] = SpecStats()
        return own

    def of_group(self, requests: list[Request]) -> SpecStats:
        """The counters summed over a group's completions (its output's metrics.spec)."""
        return SpecStats.merged(map(self.of, requests))

    def acceptance(self, request: Request) -> Acceptance:
        """The request's decayed verification outcomes (adaptive speculation plans with them)."""
        own = self._acceptance.get(request)
        if own is None:
            own = self._acceptance[request] = Acceptance()
        return own

    # ---- before scheduling -------------------------------------------------------------
    def plan(self, running: list[Request], waiting: Collection[Request] = ()) -> dict[Request, int]:
        """Draft slots each running request asks for in the coming step (`wanted`, what the
        scheduler reads): its forced tokens and its prediction's drafts, then its own k if it set
        one, else the engine's (a fixed k, or the adaptive plan capped by it; in a closed batch,
        knowing how long the requests outside the plan surely run); in all at most
        MAX_PREDICTED_DRAFTS with a prediction's drafts, else the engine's k or
        MAX_SPECULATIVE_TOKENS, the larger (suffix's default k is MAX_PREDICTED_DRAFTS)."""
        closed = self._batch_closed(running, waiting)
        self.wanted, self._forced, self._predicted = {}, {}, {}
        adaptive = []
        for request in running:
            # (A token still in flight: what it forces next is not known yet.)
            ready = request.is_decoding and not request.error and not request.num_pending
            if self.forced_tokens is not None and ready:
                try:
                    forced = self.forced_tokens.forced_tokens(request, MAX_SPECULATIVE_TOKENS)
                except Exception as exc:  # one request's grammar: that request alone
                    request.fail("grammar", exc)
                    forced = []
                if forced:
                    self._forced[request] = forced
            prediction = self.predictions.get(request) if ready else None
            if prediction is not None:
                self._plan_prediction(request, prediction)
            k = request.params.num_speculative_tokens if self.proposer is not None else 0
            self.wanted[request] = self.k if k is None else k
            if k is None and self.adaptive is not None and request.is_decoding:
                adaptive.append(request)
        if adaptive:
            planned = set(adaptive)
            others = [r for r in running if r not in planned]
            floor = max(map(must_run, others), default=0) if closed else None
            self._plan_adaptive(adaptive, floor)
        for request in self._forced.keys() | self._predicted.keys():
            free, cap = self._free(request), self._cap(request)
            self.wanted[request] = min(free + self.wanted[request], cap)
        return self.wanted

    def _free(self, request: Request) -> int:
        """The planned drafts that cost no proposal: forced tokens, then the prediction's."""
        return len(self._forced.get(request, ())) + len(self._predicted.get(request, ()))

    def _cap(self, request: Request) -> int:
        """The most draft slots the request may take this step."""
        if request in self._predicted:
            return MAX_PREDICTED_DRAFTS
        return max(self.k, MAX_SPECULATIVE_TOKENS)  # suffix's default k may pass 15

    def _plan_prediction(self, request: Request, prediction: Prediction) -> None:
        """Up to MAX_PREDICTED_DRAFTS drafts with the forced ones: a prediction, once in step
        with the output, tends to run on for many tokens (an edit changes a few lines of a file),
        so a run longer than a proposer's spreads each step's fixed cost further."""
        forced = self._forced.get(request, [])
        limit = MAX_PREDICTED_DRAFTS - len(forced)
        drafts = prediction.drafts(request.output_token_ids, forced, limit)
        if drafts:
            self._predicted[request] = drafts

    def _batch_closed(self, running: list[Request], waiting: Collection[Request]) -> bool:
        """Whether only the batch's wall time counts: nothing waits, and every request was there
        when the engine last started afresh (no request of the last plan still present), as in
        an offline generate(). A request joining while others run (a server's) opens the batch
        until the engine starts afresh again: then each request's own finish counts."""
        present = {(r.request_id, r.index) for r in (*running, *waiting)}
        if not present & self._present:
            self._joined = False
        elif present - self._present:
            self._joined = True
        self._present = present
        return not (self._joined or waiting)

    def _plan_adaptive(self, requests: list[Request], closed_steps: int | None) -> None:
        candidates = []
        for request in requests:
            # The proposer's drafts come after the free ones, within the request's cap.
            free = self._free(request)
            left = request.max_output_tokens - request.num_output_tokens
            room = max(0, min(self.k, left - 1 - free, self._cap(request) - free))
            lag = request.num_tokens - request.num_draft_computed
            own = self.acceptance(request)
            candidates.append(
                self.adaptive.candidate(
                    own, room, lag, left, must_run(request), free, request.num_tokens
                )
            )
        ks = self.adaptive.plan(candidates, closed_steps)
        for request, k in zip(requests, ks, strict=True):
            self.wanted[request] = k
            if k == 0:  # not drafting teaches nothing: drift back towards the engine's rate
                self.adaptive.idle(self.acceptance(request))

    # ---- once scheduled ----------------------------------------------------------------
    def propose(self, sched: SchedulerOutput, tables: dict[Request, list[int]], grammar) -> None:
        """Fill the draft slots on `sched`: forced tokens first, then the proposer's drafts,
        each list cut at its first token the grammar refuses; give back the slots a request
        did not fill."""
        for request, _, k in sched.scheduled():
            if k:
                free = self._forced.get(request, []) + self._predicted.get(request, [])
                sched.drafts[request] = free[:k]
        if self.proposer is not None:
            self.proposer.propose(sched, tables)
            self._count_offers(sched)
        for i, request in enumerate(sched.requests):
            drafts = sched.drafts.get(request)
            if drafts is None:
                continue
            if grammar is not None:
                try:
                    n = grammar.valid_prefix(request, drafts)
                except Exception as exc:
                    request.fail("grammar", exc)
                    n = 0
                del drafts[n:]
                if request in sched.draft_probs:
                    sched.draft_probs[request] = sched.draft_probs[request][:n]
            forced = min(len(self._forced.get(request, [])), sched.num_drafts[i], len(drafts))
            sched.num_forced[request] = forced
            sched.num_new_tokens[i] -= sched.num_drafts[i] - len(drafts)
            sched.num_drafts[i] = len(drafts)

    def _count_offers(self, sched: SchedulerOutput) -> None:
        """Whether the proposer had drafts for each request the adaptive plan gave slots (a
        prompt lookup often has none: such a request emits one token a step all the same)."""
        if self.adaptive is None:
            return
        for request, _, k in sched.scheduled():
            free = self._free(request)
            if k > free and request.params.num_speculative_tokens is None:
                has_drafts = len(sched.drafts.get(request, ())) > free
                self.acceptance(request).ask(has_drafts, self.adaptive.DECAY)

    def holds_back(self, request: Request, sched: SchedulerOutput) -> bool:
        """Whether the request's next step depends on this step's tokens on the host (its
        drafts or forced tokens are built from them), so steps may not overlap."""
        if self.proposer is not None or sched.drafts_of(request) or request in self.predictions:
            return True
        return self.forced_tokens is not None and self.forced_tokens.applies_to(request)

    # ---- once verified -----------------------------------------------------------------
    def observe_step(self, sched: SchedulerOutput, t0: float, t1: float, t2: float) -> None:
        """A step's times: drafting from t0 to t1, the target's forward and verification to t2.
        Each request still running gets its share (draft time by its drafts, target time by
        its rows); the adaptive planner's cost fits see the totals."""
        self.seconds["draft"] += t1 - t0
        self.seconds["verify"] += t2 - t1
        num_tokens, num_drafts = sched.total_tokens, sum(sched.num_drafts)
        pass_times = self.draft_model.pass_times if self.draft_model is not None else []
        if self.adaptive is not None:
            # The step's time but the draft passes (their own fit): the target's forward and
            # verification, and the proposer's host work (a prompt lookup's, all of it).
            target = t2 - t0 - sum(seconds for _, seconds in pass_times)
            has_chunk = any(n - k > 1 for _, n, k in sched.scheduled())
            keys = sum(n * r.num_tokens for r, n, _ in sched.scheduled())  # context the rows read
            self.adaptive.observe_target(num_tokens, has_chunk, target, keys)
            for rows, seconds in pass_times:
                self.adaptive.draft.observe(rows, seconds)
        pass_times.clear()
        for request, n, k in sched.scheduled():
            if not request.is_finished:
                own = self.of(request)
                own.draft_seconds += (t1 - t0) * k / num_drafts if num_drafts else 0.0
                own.target_seconds += (t2 - t1) * n / num_tokens

    def record(self, request: Request, num_drafts: int, num_forced: int, num_accepted: int) -> None:
        """One verification of the request's drafts (the first num_forced of them forced, then
        its prediction's): counters, and the adaptive planner's acceptance history."""
        # The prediction's drafts came right after the forced ones (a grammar may have cut them).
        planned = len(self._predicted.get(request, ())) if self.predictions else 0
        num_predicted = max(0, min(planned, num_drafts - num_forced))
        counts = (num_drafts, num_accepted, num_forced, num_predicted)
        self.of(request).record(*counts)
        self.stats.record(*counts)
        if request.lora is not None:  # acceptance per adapter
            self.by_adapter.setdefault(request.lora.name, SpecStats()).record(*counts)
        free = num_forced + num_predicted
        if self.adaptive is not None and num_accepted >= free:
            # The proposer's share: its drafts were judged only if the free ones held.
            self.adaptive.observe_verification(
                self.acceptance(request), num_drafts - free, num_accepted - free
            )

    def describe_request(self, request: Request) -> dict:
        """For a request's entry in the engine's snapshot: its counters and its planned k."""
        return self.of(request).as_dict() | {"k": self.wanted.get(request, 0)}

    def describe(self, method: str) -> dict:
        """For the engine's snapshot."""
        return {
            "method": method,
            **self.stats.as_dict(),
            "draft_seconds": self.seconds["draft"],
            "verify_seconds": self.seconds["verify"],
            "adaptive": self.adaptive.describe() if self.adaptive is not None else None,
            "by_adapter": {name: s.as_dict() for name, s in self.by_adapter.items()},
        }


def must_run(request: Request) -> int:
    """Tokens the request surely emits yet: all it has left when nothing but its length can
    end it (EOS ignored, no stop strings or ids, no grammar), else those min_tokens holds."""
    params, left = request.params, request.max_output_tokens - request.num_output_tokens
    if request.eos_token_ids or params.stop or params.stop_token_ids or request.grammar:
        return max(0, min(params.min_tokens - request.num_output_tokens, left))
    return left


def build_speculation(config: EngineConfig, draft_runner: ModelRunner | None) -> Speculation:
    """The engine's speculation for its config: a draft model's proposer (draft_runner), the
    n-gram proposer, the suffix proposer (before the draft model's, with both), or none
    (grammar-forced tokens may still ride as drafts)."""
    proposer: Proposer | None = None
    if draft_runner is not None:
        proposer = DraftModelProposer(draft_runner)
    elif config.spec_method == "ngram":
        proposer = NgramProposer(config.ngram_min, config.ngram_max)
    k = config.num_speculative_tokens
    if config.spec_method == "suffix":
        proposer = SuffixProposer(
            config.suffix_max_tree_depth,
            config.suffix_max_spec_factor,
            min_token_prob=config.suffix_min_token_prob,
            max_cached_tokens=config.suffix_max_cached_tokens,
            fallback=proposer,
        )
        # A match can run on through a whole repeated function or tool result, so suffix
        # drafts up to a prediction's step by default (the adaptive plan sizes each step); a
        # draft model beside it (sequential passes, one per draft) keeps a proposer's 15.
        if k is None:
            k = MAX_PREDICTED_DRAFTS if draft_runner is None else MAX_SPECULATIVE_TOKENS
    adaptive = None
    if proposer is not None and config.adaptive_speculation:
        adaptive = AdaptiveSpeculation(uses_draft_model=draft_runner is not None)
    return Speculation(proposer, DEFAULT_K if k is None else k, adaptive)
