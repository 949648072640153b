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

    def since(self, chars: int, tokens: int) -> CompletionOutput:
        """What is new after the first `chars` characters and `tokens` tokens (streaming)."""
        return replace(
            self,
            text=self.text[chars:],
            token_ids=self.token_ids[tokens:],
            token_kinds=self.token_kinds[tokens:],
            logprobs=self.logprobs[tokens:] if self.logprobs is not None else None,
        )


# What of one completion a stream has already carried: (characters, tokens, its finish).
Sent = tuple[int, int, bool]
NOTHING_SENT: Sent = (0, 0, False)


def advance(sent: Sent, num_chars: int, num_tokens: int, finished: bool) -> Sent | None:
    """The completion's new cursor if it has something a stream has not carried yet (text,
    tokens, or its finish, which is sent once), else None. Shared by the engine's DELTA outputs
    and the server's SSE chunks, which must agree on what counts as new."""
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
