"""Grammar state per request and the masks it puts on a batch of logits rows.

A request's matcher always sits at the state after its committed output tokens (the matcher
advances only on tokens the engine appended). Work for the coming step advances it and rolls
back before returning: the forced tokens (a single allowed token, or xgrammar's jump-forward
string, tokenized), the check that cuts a draft list at its first invalid token, and the mask
rows of a verification span (one row per draft position and the bonus position). Matchers are
made on first use and released when a request finishes, is aborted or is preempted; a
re-admitted request replays its output into a fresh one. A request with a thinking budget
(engine.grammar.thinking) gets the budget's matcher, over xgrammar's when it also has a
constraint.
"""

from __future__ import annotations

import functools
import time
from typing import TYPE_CHECKING

import numpy as np
import torch
import xgrammar as xgr

from engine.config import MAX_PREDICTED_DRAFTS
from engine.device import to_device
from engine.errors import RequestError
from engine.grammar.compiler import GrammarCompiler, tokenizer_info
from engine.grammar.thinking import ThinkingBudget, ThinkTags

if TYPE_CHECKING:
    from engine.config import EngineConfig
    from engine.request import Request

# Tokens a matcher walks past its committed state and then rolls back: at most a verification
# span, every draft (a prediction's are the most a step gives a request) plus the bonus position.
MAX_ROLLBACK_TOKENS = MAX_PREDICTED_DRAFTS + 1


class GrammarError(RuntimeError):
    """A token the grammar does not allow reached the matcher: a bug, never the user's input."""


class RequestGrammar:
    """One request's compiled grammar and thinking budget (either may be None) and, while it
    runs, its matcher (the budget's over xgrammar's, when it has a budget)."""

    __slots__ = ("compiled", "kind", "budget", "_manager", "_matcher")

    def __init__(
        self,
        compiled: xgr.CompiledGrammar | None,
        kind: str,
        manager: GrammarManager,
        budget: ThinkingBudget | None = None,
    ):
        self.compiled = compiled
        self.kind = kind
        self.budget = budget
        self._manager = manager
        self._matcher: xgr.GrammarMatcher | None = None

    def matcher(self, committed: list[int]) -> xgr.GrammarMatcher:
        if self._matcher is None:
            matcher = None
            if self.compiled is not None:
                matcher = xgr.GrammarMatcher(self.compiled, max_rollback_tokens=MAX_ROLLBACK_TOKENS)
            if self.budget is not None:
                matcher = self.budget.matcher(matcher, MAX_ROLLBACK_TOKENS)
            for token in committed:
                if not matcher.accept_token(token):
                    raise GrammarError(f"replaying output: token {token} not allowed")
            self._matcher = matcher
            self._manager.num_matchers += 1
        return self._matcher

    @property
    def is_live(self) -> bool:
        return self._matcher is not None

    def release(self) -> None:
        if self._matcher is not None:
            self._matcher = None
            self._manager.num_matchers -= 1


def single_token(row: np.ndarray) -> int | None:
    """The token id if exactly one bit of this bitmask row ([ceil(V / 32)] int32) is set."""
    words = np.flatnonzero(row)
    if len(words) != 1:
        return None
    word = int(row[words[0]]) & 0xFFFFFFFF
    if word & (word - 1):
        return None
    return int(words[0]) * 32 + word.bit_length() - 1


def apply_bitmask(
    logits: torch.Tensor,  # [R, >= V] float
    bitmask: torch.Tensor,  # [rows, ceil(V / 32)] int32, bit j of word w = token 32 w + j
    indices: list[int],  # rows of both to apply
    vocab_size: int,
) -> None:
    """logits[i, t] = -inf where bitmask row i forbids t. On CPU, unpacking the bits with numpy
    and one masked_fill is several times faster than xgrammar's CPU kernel on mostly-forbidden
    rows (bench.choices); other devices use xgrammar's kernels."""
    if logits.device.type != "cpu" or not np.little_endian:
        bitmask = to_device(bitmask[: max(indices) + 1], logits.device)
        xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=vocab_size, indices=indices)
        return
    every_row = indices == list(range(logits.shape[0]))
    rows = None if every_row else torch.tensor(indices)
    words = bitmask[: len(indices)] if every_row else bitmask.index_select(0, rows)  # [n, W]
    banned = np.unpackbits(~words.numpy().view(np.uint8), axis=1, bitorder="little")
    banned = torch.from_numpy(banned[:, :vocab_size].view(bool))  # [n, V]
    if every_row:
        logits[:, :vocab_size].masked_fill_(banned, float("-inf"))
        return
    masked = logits.index_select(0, rows)
    masked[:, :vocab_size].masked_fill_(banned, float("-inf"))
    logits.index_copy_(0, rows, masked)


def _timed(method):
    """Adds the method's wall time to self.seconds (the grammar's share of the engine's time)."""

    @functools.wraps(method)
    def timed(self, *args):
        t0 = time.perf_counter()
        try:
            return method(self, *args)
        finally:
            self.seconds += time.perf_counter() - t0

    return timed


class GrammarManager:
    """Compiles constraints (through `compiler`), owns the bitmask (allocated once, grown only if
    a step ever has more sampling rows) and the count of live matchers."""

    def __init__(self, compiler: GrammarCompiler, tokenizer, vocab_size: int, max_rows: int):
        self.compiler = compiler
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.bitmask = xgr.allocate_token_bitmask(max_rows, vocab_size)  # [rows, ceil(V/32)]
        self._scratch = xgr.allocate_token_bitmask(1, vocab_size)  # [1, ceil(V/32)]
        self._scratch_row = self._scratch[0].numpy()  # the same memory
        self.num_matchers = 0
        self.num_drafts_cut = 0  # proposed drafts the grammar refused before verification
        self.seconds = 0.0  # spent in masks, forced tokens, draft checks and commits
        self.jump_forward = True  # False: only single-allowed tokens are forced
        self.think_tags: ThinkTags | None = None  # made for the first thinking budget

    @classmethod
    def build(
        cls, tokenizer, vocab_size: int, eos_token_ids: set[int], cfg: EngineConfig
    ) -> GrammarManager:
        """A manager with its own compiler, cached and timed as the engine's config says, and
        mask rows for the largest step: 1 + drafts per request, within the step's token budget."""
        compiler = GrammarCompiler(
            tokenizer_info(tokenizer, vocab_size, eos_token_ids),
            cfg.grammar_cache_size,
            cfg.grammar_compile_timeout,
            cfg.grammar_compile_workers,
            cfg.grammar_cache_bytes,
            cfg.grammar_max_schema_depth,
            cfg.grammar_max_schema_nodes,
        )
        rows = min(cfg.max_num_seqs * (MAX_PREDICTED_DRAFTS + 1), cfg.max_num_batched_tokens)
        return cls(compiler, tokenizer, vocab_size, rows)

    def attach(
        self, request: Request, compiled: xgr.CompiledGrammar | None, kind: str | None = None
    ) -> None:
        """Give the request its grammar: its compiled constraint (of `kind`: by default its
        params'), its params' thinking budget."""
        params = request.params
        if kind is None:
            kind = "thinking_token_budget" if compiled is None else params.structured_outputs.kind
        budget = None
        if params.thinking_token_budget is not None:
            if self.think_tags is None:
                self.think_tags = ThinkTags(self.tokenizer)
            tags, n = self.think_tags, params.thinking_token_budget
            budget = ThinkingBudget(tags, n, request.prompt_token_ids)
        request.grammar = RequestGrammar(compiled, kind, self, budget)

    def _matcher(self, request: Request) -> xgr.GrammarMatcher:
        return request.grammar.matcher(request.output_token_ids)

    # ---- tokens the engine appended --------------------------------------------------------
    @_timed
    def commit(self, request: Request, token: int) -> bool:
        """Advance past the token just appended to the request; True when the grammar has
        terminated."""
        matcher = request.grammar.matcher(request.output_token_ids[:-1])
        if not matcher.accept_token(token):
            raise GrammarError(f"request {request.request_id}: emitted token {token} not allowed")
        return matcher.is_terminated()

    # ---- the coming step -------------------------------------------------------------------
    def applies_to(self, request: Request) -> bool:
        return request.grammar is not None

    @_timed
    def forced_tokens(self, request: Request, limit: int) -> list[int]:
        """Tokens the grammar forces next (ForcedTokens protocol): while exactly one token is
        allowed take it, else tokenize xgrammar's jump-forward string; at most `limit`."""
        if request.grammar is None or limit <= 0:
            return []
        matcher = self._matcher(request)
        tokens: list[int] = []
        try:
            while len(tokens) < limit and not matcher.is_terminated():
                matcher.fill_next_token_bitmask(self._scratch, 0)
                token = single_token(self._scratch_row)
                if token is not None:
                    matcher.accept_token(token)
                    tokens.append(token)
                    continue
                text = matcher.find_jump_forward_string() if self.jump_forward else ""
                ids = self.tokenizer.encode(text, add_special_tokens=False) if text else []
                taken = 0
                for token in ids[: limit - len(tokens)]:
                    if not matcher.accept_token(token):
                        break
                    tokens.append(token)
                    taken += 1
                if not taken:
                    break
        finally:
            matcher.rollback(len(tokens))
        return tokens

    @_timed
    def valid_prefix(self, request: Request, drafts: list[int]) -> int:
        """How many leading drafts the grammar accepts (none after one that terminates it)."""
        if request.grammar is None or not drafts:
            return len(drafts)
        matcher = self._matcher(request)
        n = 0
        for token in drafts:
            if matcher.is_terminated():
                break  # drafts past the end are dropped, not refused
            if not matcher.accept_token(token):
                self.num_drafts_cut += len(drafts) - n
                break
            n += 1
        matcher.rollback(n)
        return n

    @_timed
    def mask(self, logits: torch.Tensor, rows: list[tuple[Request, list[int]]]) -> None:
        """logits [R, V] in place: row i may only take what request i's grammar allows after
        its committed tokens plus drafts i (rows of one request come in order of growing draft
        prefixes, so each span is walked once). Rows of unconstrained requests are untouched."""
        if not any(r.grammar is not None for r, _ in rows):
            return
        if len(rows) > self.bitmask.shape[0]:
            self.bitmask = xgr.allocate_token_bitmask(len(rows), self.vocab_size)
        indices = []
        matcher, walked = None, []  # the span being walked and the drafts it has accepted
        try:
            for i, (request, drafts) in enumerate(rows):
                if request.grammar is None:
                    continue
                m = self._matcher(request)
                if m is not matcher or drafts[: len(walked)] != walked:
                    if matcher is not None:
                        matcher.rollback(len(walked))
                    matcher, walked = m, []
                for token in drafts[len(walked) :]:
                    if m.is_terminated():
                        break
                    if not m.accept_token(token):
                        raise GrammarError(f"draft {token} reached the verifier unchecked")
                    walked.append(token)
                if m.is_terminated():
                    continue  # a position after the stop token: never emitted
                needed = m.fill_next_token_bitmask(self.bitmask, i)
                if not self.bitmask[i].any():  # neither a token nor the end: a dead end
                    drafted = f" and {len(walked)} drafted" if walked else ""
                    raise RequestError(
                        "structured_outputs admits no continuation after "
                        f"{request.num_output_tokens} output tokens{drafted} (the grammar has "
                        "a dead end)"
                    )
                if needed is not False:  # (False: every token is allowed)
                    indices.append(i)
        finally:
            if matcher is not None:
                matcher.rollback(len(walked))
        if indices:
            apply_bitmask(logits, self.bitmask, indices, self.vocab_size)
