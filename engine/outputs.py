"""Public output types, shaped like vLLM's so client code carries over."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from spec.metrics import SpecStats


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

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


# What of one completion a stream has already carried: (characters, tokens, its finish).
Sent = tuple[int, int, bool]
NOTHING_SENT: Sent = (0, 0, False)


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
    first_scheduled_time: float | None = None
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
    extra: dict = field(default_factory=dict)
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
        out.num_cached_tokens, out.extra = delta.num_cached_tokens, delta.extra
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
