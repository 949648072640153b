"""Public output types, shaped like vLLM's so client code carries over, and the request group
that builds them from its completions' state."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from engine.detokenizer import ExactDecoder, IncrementalDetokenizer
from engine.request import FINISH_REASONS, Request, RequestStatus
from engine.sampling_params import RequestOutputKind
from engine.stop import check_stop

if TYPE_CHECKING:
    from spec.stats import SpecStats


@dataclass(slots=True)
class Logprob:
    logprob: float
    rank: int  # 1 = most likely
    decoded_token: str | None = None


# One dict per position: token id -> Logprob (the chosen token plus the top-N).
PositionLogprobs = dict[int, Logprob]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[PositionLogprobs] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None  # the stop string or token id that ended it
    # One letter per token of token_ids: where it came from (engine.request.TOKEN_KINDS).
    token_kinds: str = ""
    # Drafts the target rejected: (index in token_ids of the token that replaced them, ids).
    rejected_drafts: list[tuple[int, list[int]]] = field(default_factory=list)
    # engine.entrypoints.tools.ToolCall, set by LLM.chat when given tools
    tool_calls: list | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


# What of one completion a stream has already carried: (characters, tokens, its finish).
Sent = tuple[int, int, bool]


def advance(sent: Sent, num_chars: int, num_tokens: int, finished: bool) -> Sent | None:
    """The completion's new cursor if it has something a stream has not carried yet (text,
    tokens, or its finish, which is sent once), else None: what the engine's DELTA outputs
    count as new."""
    unchanged = num_chars == sent[0] and num_tokens == sent[1]
    if unchanged and (not finished or sent[2]):
        return None
    return (num_chars, num_tokens, finished)


@dataclass
class RequestMetrics:
    arrival_time: float
    first_token_time: float | None = None
    finished_time: float | None = None
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    spec: SpecStats | None = None  # speculation counters over the group's completions


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    metrics: RequestMetrics | None = None
    num_cached_tokens: int = 0
    error: str | None = None  # set when the request ended with finish_reason "error"
    error_status: int | None = None  # 400: the request's own fault; 500: ours


class OutputAccumulator:
    """DELTA outputs of one request joined into one RequestOutput: with every delta, the
    whole output; with those a reader has not taken yet, what is new to it. Linear in what
    it is given (texts are joined once, at `take`)."""

    def __init__(self):
        self._reset()

    def _reset(self) -> None:
        self._out: RequestOutput | None = None
        self._completions: dict[int, CompletionOutput] = {}
        self._texts: dict[int, list[str]] = {}  # per completion: text pieces, kinds pieces
        self._kinds: dict[int, list[str]] = {}

    @property
    def empty(self) -> bool:
        return self._out is None

    def add(self, delta: RequestOutput) -> None:
        if self._out is None:
            self._out = replace(delta, outputs=[])
        out = self._out
        for c in delta.outputs:
            mine = self._completions.get(c.index)
            if mine is None:  # lists are the engine's copies: extended here from now on
                mine = self._completions[c.index] = replace(c, text="", token_kinds="")
                mine.token_ids, mine.rejected_drafts = list(c.token_ids), list(c.rejected_drafts)
                mine.logprobs = None if c.logprobs is None else list(c.logprobs)
                self._texts[c.index], self._kinds[c.index] = [c.text], [c.token_kinds]
                continue
            self._texts[c.index].append(c.text)
            self._kinds[c.index].append(c.token_kinds)
            mine.token_ids.extend(c.token_ids)
            mine.rejected_drafts.extend(c.rejected_drafts)
            if c.logprobs is not None:
                if mine.logprobs is None:
                    mine.logprobs = []
                mine.logprobs.extend(c.logprobs)
            mine.cumulative_logprob = c.cumulative_logprob
            mine.finish_reason, mine.stop_reason = c.finish_reason, c.stop_reason
        out.finished, out.metrics = delta.finished, delta.metrics
        out.num_cached_tokens = delta.num_cached_tokens
        out.error, out.error_status = delta.error, delta.error_status
        if delta.prompt_logprobs is not None:
            out.prompt_logprobs = delta.prompt_logprobs

    def take(self) -> RequestOutput:
        """The joined output (its completions by index); the accumulator starts over."""
        if self._out is None:
            raise ValueError("nothing to take: no output was added")
        out = self._out
        for index, c in self._completions.items():
            c.text, c.token_kinds = "".join(self._texts[index]), "".join(self._kinds[index])
        out.outputs = sorted(self._completions.values(), key=lambda c: c.index)
        self._reset()
        return out


def decode_logprobs(decode: ExactDecoder, raw: dict[int, tuple[float, int]]) -> PositionLogprobs:
    """One position's raw (logprob, rank) per token id, with each token's text (decode: the
    engine's ExactDecoder). Done once per position, when it is produced: outputs repeat it."""
    return {
        t: Logprob(lp, rank, decode([t], skip_special_tokens=False))
        for t, (lp, rank) in raw.items()
    }


@dataclass
class CompletionHistory:
    """What one completion has emitted, kept for its outputs: each token's kind
    (engine.request.TOKEN_KINDS), the drafts the target rejected (output position of the token
    that replaced them, their ids), per position the logprobs asked for (decoded once) and
    their sum, and, for the group's leader, the prompt's logprobs."""

    token_kinds: list[str] = field(default_factory=list)
    rejected_drafts: list[tuple[int, list[int]]] = field(default_factory=list)
    logprobs: list[PositionLogprobs] = field(default_factory=list)
    cumulative_logprob: float = 0.0
    prompt_logprobs: list[PositionLogprobs] = field(default_factory=list)


class RequestGroup:
    """What the user submitted: one prompt, n completions (one Request and one detokenizer
    each), and what of them a DELTA stream has already carried. The first request leads: it
    computes the prompt, and the others fork from it (they wait in FORK_PENDING)."""

    def __init__(
        self, request_id: str, prompt: str | None, requests: list[Request], decode: ExactDecoder
    ):
        self.request_id = request_id
        self.prompt = prompt
        self.requests = requests
        self.leader = requests[0]
        self.leader.siblings = requests[1:]
        for sibling in requests[1:]:
            sibling.status = RequestStatus.FORK_PENDING
        params = self.leader.params
        self._decode = decode
        self.detokenizers = [
            IncrementalDetokenizer(
                decode,
                r.prompt_token_ids,
                params.skip_special_tokens,
                params.stop,
                params.include_stop_str_in_output,
            )
            for r in requests
        ]
        self.histories = [CompletionHistory() for _ in requests]
        self.metrics = RequestMetrics(arrival_time=time.monotonic())
        self.sent: list[Sent] = [(0, 0, False)] * len(requests)  # DELTA: per completion
        self.sent_prompt_logprobs = False

    @property
    def finished(self) -> bool:
        return all(r.is_finished for r in self.requests)

    def append(
        self, request: Request, token: int, logprobs, kind: str, rejected: list[int], grammar
    ) -> RequestStatus | None:
        """Append a token to one of the group's completions (`request`): its kind and, if it
        replaced rejected drafts, those go into the completion's history, its grammar advances,
        its logprobs (raw, this position's) are decoded, its stop conditions are checked.
        Returns the finished status it reached, if any. A failure of the request's own grammar
        or detokenizer fails it (Request.fail) and returns None."""
        history = self.histories[request.index]
        if kind == "r":
            history.rejected_drafts.append((request.num_output_tokens, rejected))
        history.token_kinds.append(kind)
        request.append_token(token)
        if self.metrics.first_token_time is None:
            self.metrics.first_token_time = time.monotonic()
        try:
            terminated = request.grammar is not None and grammar.commit(request, token)
        except Exception as exc:
            request.fail("grammar", exc)
            return None
        if logprobs is not None:  # decoded once here: outputs repeat them, step after step
            history.logprobs.append(decode_logprobs(self._decode, logprobs))
            history.cumulative_logprob += logprobs[token][0]
        try:
            return check_stop(request, token, self.detokenizers[request.index], terminated)
        except Exception as exc:
            request.fail("detokenizer", exc)
            return None

    def add_prompt_logprobs(self, first: int, raw: list[dict[int, tuple[float, int]]]) -> None:
        """The prompt's logprobs at positions first, first + 1, ...: those not recorded yet (a
        preempted request computes its prompt again)."""
        recorded = self.histories[0].prompt_logprobs
        if first > len(recorded):
            raise RuntimeError(f"prompt logprobs from position {first}, {len(recorded)} recorded")
        recorded.extend(decode_logprobs(self._decode, r) for r in raw[len(recorded) - first :])

    def make_output(
        self, spec_of: Callable[[list[Request]], SpecStats] | None
    ) -> RequestOutput | None:
        """The group's output after a step that touched it, as its output_kind asks: everything
        so far (CUMULATIVE), what is new (DELTA: completions with nothing new are left out),
        or nothing until it has finished (FINAL_ONLY). spec_of: the speculation's counters
        summed over given requests (None: the engine does not speculate), for the metrics."""
        finished = self.finished
        kind = self.leader.params.output_kind
        if kind == RequestOutputKind.FINAL_ONLY and not finished:
            return None
        completions = []
        for request, detok in zip(self.requests, self.detokenizers, strict=True):
            visible = detok.visible_len(request.is_finished)
            chars = tokens = 0
            if kind == RequestOutputKind.DELTA:
                chars, tokens, _ = sent = self.sent[request.index]
                sent = advance(sent, visible, request.num_output_tokens, request.is_finished)
                if sent is None:
                    continue  # nothing new of this completion
                self.sent[request.index] = sent
            history = self.histories[request.index]
            completions.append(completion(request, history, detok.text[chars:visible], tokens))
        leader, failed = self.leader, next((r for r in self.requests if r.error), None)
        prompt_lps = None
        if leader.params.prompt_logprobs is not None and not self.sent_prompt_logprobs:
            prompt_lps = [None, *self.histories[0].prompt_logprobs]
            self.sent_prompt_logprobs = kind == RequestOutputKind.DELTA
        metrics = self.metrics
        if finished and metrics.finished_time is None:
            metrics.finished_time = time.monotonic()
        metrics.num_cached_tokens = max(0, leader.num_cached_tokens)
        metrics.num_preemptions = sum(r.num_preemptions for r in self.requests)
        metrics.spec = spec_of(self.requests) if spec_of else None
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=leader.prompt_token_ids,
            outputs=completions,
            finished=finished,
            prompt_logprobs=prompt_lps,
            metrics=metrics,
            num_cached_tokens=metrics.num_cached_tokens,
            error=failed.error if failed else None,
            error_status=failed.error_status if failed else None,
        )


def completion(
    request: Request, history: CompletionHistory, text: str, tokens: int
) -> CompletionOutput:
    """One completion after its first `tokens` tokens (0: all of it), `text` the matching part
    of its text. Lists are copies: later steps extend the history's own. rejected_drafts keep
    their indices into the whole completion."""
    with_logprobs = request.params.logprobs is not None
    start = request.num_prompt_tokens + tokens
    rejected = history.rejected_drafts
    return CompletionOutput(
        index=request.index,
        text=text,
        token_ids=request.token_ids[start:],
        cumulative_logprob=history.cumulative_logprob if with_logprobs else None,
        logprobs=history.logprobs[tokens:] if with_logprobs else None,
        finish_reason=FINISH_REASONS.get(request.status),
        stop_reason=request.stop_reason,
        token_kinds="".join(history.token_kinds[tokens:]),
        rejected_drafts=[r for r in rejected if r[0] >= tokens] if tokens else list(rejected),
    )
