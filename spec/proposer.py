"""What the engine asks of a proposer and of a forced-token source; the n-gram proposer.

After the scheduler has reserved up to k draft slots for a request (`SchedulerOutput.num_drafts`),
the engine puts the request's forced tokens first in `SchedulerOutput.drafts[request]` (tokens a
grammar allows alone: free drafts, no proposer work), and `propose` extends that list to at most
k tokens, setting `SchedulerOutput.draft_probs[request]` to the proposal distribution q ([d, V])
where the proposal is sampled (absent: deterministic). The verifier is lossless whatever a
proposer returns; proposers only decide how much is accepted.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from engine.request import Request
from engine.scheduler import SchedulerOutput


class Proposer(Protocol):
    def propose(self, sched: SchedulerOutput, tables: dict[Request, list[int]]) -> None: ...


class ForcedTokens(Protocol):
    """The tokens a request must emit next whatever the model computes, at most `limit` (a
    grammar with a single allowed token, or its jump-forward string). They ride in the draft
    slots ahead of the proposer's drafts and are verified like them."""

    def forced_tokens(self, request: Request, limit: int) -> list[int]: ...

    def applies_to(self, request: Request) -> bool:
        """Whether it may force tokens for this request at all (then each of its steps waits
        for the last one's tokens: what is forced next depends on them)."""
        ...


def drafts_wanted(sched: SchedulerOutput, skip=frozenset()):
    """(request, its drafts so far, drafts still to propose) for every request with draft
    slots left, but those in skip; the proposer extends the list in place."""
    for request, _, k in sched.scheduled():
        drafts = sched.drafts.setdefault(request, []) if k else []
        if k > len(drafts) and request not in skip:
            yield request, drafts, k - len(drafts)


class NgramProposer:
    """Prompt lookup: find the latest earlier occurrence of the request's last n tokens (n from
    max_n down to min_n) in its own prompt and output, and propose the tokens that followed."""

    def __init__(self, min_n: int = 1, max_n: int = 4):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"ngram sizes need 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.min_n, self.max_n = min_n, max_n

    def propose(self, sched: SchedulerOutput, tables: dict[Request, list[int]]) -> None:
        for request, drafts, k in drafts_wanted(sched):
            drafts += self.lookup(request.token_ids + drafts, k)

    def lookup(self, tokens: list[int], k: int) -> list[int]:
        arr = np.asarray(tokens)
        length = len(arr)
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            suffix = arr[length - n :]
            # Candidate starts i < length - n whose n tokens equal the suffix.
            windows = np.lib.stride_tricks.sliding_window_view(arr[: length - 1], n)
            hits = np.flatnonzero((windows == suffix).all(axis=1))
            if len(hits):
                follow = int(hits[-1]) + n
                return arr[follow : follow + k].tolist()
        return []
