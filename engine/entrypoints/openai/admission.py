"""Admission control: how much work the server takes on before it answers 429.

Three limits (`tandem serve` flags): prompts in one request, requests the server holds
(waiting or running; a prompt with n completions counts n, as the engine runs them), and the
prompt tokens of those requests. A request holds its share from admission until its response
ends (whole, streamed to the end, failed or disconnected), so a burst past the limits is
refused at the door instead of growing the engine's queue without bound.

Requests are counted before their prompts are tokenized (the count is known from the body),
so a burst cannot spend the tokenizer on requests it then refuses; tokens are counted once
tokenized. A request that could never fit (more prompts or more tokens than the limits
themselves) is a 400 naming `prompt`: retrying it would not help.
"""

from __future__ import annotations

from dataclasses import dataclass

from fastapi.responses import StreamingResponse

from engine.entrypoints.openai.protocol import APIError

RETRY_AFTER_S = 1  # the 429's Retry-After: requests finish in seconds; a client backs off


@dataclass(frozen=True)
class AdmissionLimits:
    max_prompts_per_request: int = 256
    max_queued_requests: int = 1024
    max_queued_tokens: int = 262_144

    def __post_init__(self) -> None:
        for name in ("max_prompts_per_request", "max_queued_requests", "max_queued_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")


class Admission:
    """The server's count of admitted work (touched only on the event loop: no lock)."""

    def __init__(self, limits: AdmissionLimits):
        self.limits = limits
        self.num_requests = 0  # admitted requests (prompts x n) not yet answered
        self.num_tokens = 0  # their prompt tokens, once tokenized
        self.num_refused = 0  # 429s answered

    def check_num_prompts(self, num_prompts: int) -> None:
        limit = self.limits.max_prompts_per_request
        if num_prompts > limit:
            raise APIError(
                f"prompt holds {num_prompts} prompts; at most {limit} per request "
                "(--max-prompts-per-request)",
                "prompt",
            )

    def busy(self, message: str) -> APIError:
        self.num_refused += 1
        return APIError(
            f"{message}: retry after {RETRY_AFTER_S} s",
            status=429,
            code="rate_limit_exceeded",
            type="requests",
            headers={"Retry-After": str(RETRY_AFTER_S)},
        )


class Ticket:
    """One HTTP request's share of the admitted work: admit() its requests, then
    add_tokens() its prompt tokens; release() gives back whatever it holds (once)."""

    def __init__(self, admission: Admission):
        self.admission, self.num_requests, self.num_tokens = admission, 0, 0

    def admit(self, num_prompts: int, n: int) -> None:
        """Hold num_prompts x n requests, or raise (400 past the per-request limit, 429 when
        the server holds too many already)."""
        adm, limits = self.admission, self.admission.limits
        adm.check_num_prompts(num_prompts)
        num_requests = num_prompts * n
        if num_requests > limits.max_queued_requests:  # never fits: retrying would not help
            raise APIError(
                f"{num_prompts} prompts x n={n} make {num_requests} requests; the server takes "
                f"at most {limits.max_queued_requests} at once (--max-queued-requests)",
                "n" if n > 1 else "prompt",
            )
        if adm.num_requests + num_requests > limits.max_queued_requests:
            raise adm.busy(
                f"the server holds {adm.num_requests} requests and takes at most "
                f"{limits.max_queued_requests} (--max-queued-requests); this one adds "
                f"{num_requests}"
            )
        adm.num_requests += num_requests
        self.num_requests += num_requests

    def add_tokens(self, num_prompt_tokens: int) -> None:
        """Hold the request's prompt tokens (every prompt's, n times each), or raise."""
        adm, limit = self.admission, self.admission.limits.max_queued_tokens
        if num_prompt_tokens > limit:
            raise APIError(
                f"the request's prompts hold {num_prompt_tokens} tokens; the server takes at "
                f"most {limit} at once (--max-queued-tokens)",
                "prompt",
            )
        if adm.num_tokens + num_prompt_tokens > limit:
            raise adm.busy(
                f"the server holds {adm.num_tokens} prompt tokens and takes at most {limit} "
                f"(--max-queued-tokens); this request adds {num_prompt_tokens}"
            )
        adm.num_tokens += num_prompt_tokens
        self.num_tokens += num_prompt_tokens

    def release(self) -> None:
        adm = self.admission
        adm.num_requests -= self.num_requests
        adm.num_tokens -= self.num_tokens
        self.num_requests = self.num_tokens = 0


class TicketedStream(StreamingResponse):
    """A stream that gives its request's admitted share back when it ends, however it ends
    (its generator may never start: a client gone before the first byte)."""

    def __init__(self, content, ticket: Ticket, **kwargs):
        super().__init__(content, **kwargs)
        self.ticket = ticket

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.ticket.release()
