"""Whether the token a request just appended ends it, and how.

Checked in vLLM's order: a stop token id or an end-of-sequence token (both only once min_tokens
tokens are out), a stop string found by the detokenizer, a grammar that is complete, then the
length limit. A stop string's text is cut by the detokenizer; any other ending flushes what the
detokenizer was holding back in case a stop string began there.
"""

from __future__ import annotations

from engine.detokenizer import IncrementalDetokenizer
from engine.request import Request, RequestStatus


def check_stop(
    request: Request, token: int, detok: IncrementalDetokenizer, grammar_complete: bool
) -> RequestStatus | None:
    """The finished status `token` (already appended) gives the request, or None; sets
    request.stop_reason (the stop token id or string). Feeds the token to detok, whose
    exceptions are the caller's (that request's detokenizer failed)."""
    p = request.params
    status = None
    may_stop = request.num_output_tokens > p.min_tokens  # vLLM: stops count after min_tokens
    if may_stop:
        if token in p.stop_token_ids:
            status, request.stop_reason = RequestStatus.FINISHED_STOPPED, token
        elif token in request.eos_token_ids:
            status = RequestStatus.FINISHED_STOPPED
    stop = detok.add_token(token, may_stop) if status is None else None
    if stop is not None:
        status, request.stop_reason = RequestStatus.FINISHED_STOPPED, stop
    if status is None and grammar_complete:  # e.g. with ignore_eos
        status = RequestStatus.FINISHED_STOPPED
    if status is None and request.num_output_tokens >= request.max_output_tokens:
        status = RequestStatus.FINISHED_LENGTH
    if status is not None and not isinstance(request.stop_reason, str):
        detok.flush()
    return status
