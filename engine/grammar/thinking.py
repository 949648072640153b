"""A thinking budget: after N reasoning tokens the closing tag is forced.

A request with `thinking_token_budget = N` reasons for at most N tokens. Its thinking starts
after the opening tag's tokens (`<think>`): at the output's start when the prompt left the tag
open (a template such as DeepSeek-R1's writes it), else when the output's first tokens are the
tag. Once N tokens follow it without the closing tag's tokens (`</think>`), those tokens are the
only ones allowed, one after another; the model's own closing tag before that ends the budget's
part, and an output that does not open with the tag is never cut.

The budget is a grammar to the engine: its matcher (`BudgetMatcher`) stands where xgrammar's
does in engine.grammar.matcher, wrapping the request's own constraint when it has one (a token
must then pass both). So the forced tag rides in the draft slots as forced tokens do, and is
verified like any draft under a mask that allows it alone: the output is the model's own up to
the cut, then exactly the tag, then the model's own again. Requests without a budget never meet
this module (their rows are not masked for it).
"""

from __future__ import annotations

from collections import deque

import torch

OPEN, CLOSE = "<think>", "</think>"
WAITING, THINKING, DONE = 0, 1, 2  # before the output opens the tag; inside it; after it


class ThinkTags:
    """The tags' token ids in one tokenizer."""

    def __init__(self, tokenizer):
        self.open_ids: list[int] = tokenizer.encode(OPEN, add_special_tokens=False)
        self.close_ids: list[int] = tokenizer.encode(CLOSE, add_special_tokens=False)

    def leaves_open(self, prompt_ids: list[int]) -> bool:
        """Whether the prompt's last opening tag comes after its last closing tag."""
        return _last(prompt_ids, self.open_ids) > _last(prompt_ids, self.close_ids)


def _last(ids: list[int], tag: list[int]) -> int:
    """Where the tag last occurs in ids (-1: nowhere)."""
    n = len(tag)
    for i in range(len(ids) - n, -1, -1):
        if ids[i : i + n] == tag:
            return i
    return -1


class ThinkingBudget:
    """One request's budget: its tags, N, and whether its prompt opened the thinking."""

    __slots__ = ("tags", "budget", "starts_open")

    def __init__(self, tags: ThinkTags, budget: int, prompt_ids: list[int]):
        self.tags, self.budget = tags, budget
        self.starts_open = tags.leaves_open(prompt_ids)

    def matcher(self, inner, max_rollback: int) -> BudgetMatcher:
        """A matcher at the output's start, over the request's own matcher (or None)."""
        return BudgetMatcher(self, inner, max_rollback)


class BudgetMatcher:
    """xgrammar's GrammarMatcher interface (what engine.grammar.matcher calls) over the budget's
    state and the request's own matcher. A state is (phase, reasoning tokens, how many of the
    next tag's tokens have matched so far)."""

    def __init__(self, budget: ThinkingBudget, inner, max_rollback: int):
        self.budget, self.inner = budget, inner
        start = (THINKING, 0, 0) if budget.starts_open else (WAITING, 0, 0)
        self.states: deque[tuple[int, int, int]] = deque([start], maxlen=max_rollback + 1)

    def forced(self) -> int | None:
        """The one token the budget allows next (None: any). Counting the tag's tokens matched
        so far as the tag's, it forces the rest of the tag once they and the reasoning reach N:
        the reasoning never passes N tokens."""
        phase, num_reasoning, num_matched = self.states[-1]
        if phase == THINKING and num_reasoning + num_matched >= self.budget.budget:
            return self.budget.tags.close_ids[num_matched]
        return None

    def accept_token(self, token: int) -> bool:
        forced = self.forced()
        if forced is not None and token != forced:
            return False
        if self.inner is not None and not self.inner.accept_token(token):
            return False
        self.states.append(self._next(token))
        return True

    def _next(self, token: int) -> tuple[int, int, int]:
        phase, num_reasoning, num_matched = self.states[-1]
        tags = self.budget.tags
        if phase == WAITING:
            if token != tags.open_ids[num_matched]:
                return (DONE, 0, 0)
            if num_matched + 1 == len(tags.open_ids):
                return (THINKING, 0, 0)
            return (WAITING, 0, num_matched + 1)
        if phase == DONE:
            return (DONE, 0, 0)
        if token == tags.close_ids[num_matched]:
            if num_matched + 1 == len(tags.close_ids):
                return (DONE, 0, 0)
            return (THINKING, num_reasoning, num_matched + 1)
        # Not the tag after all: the tokens matched so far were reasoning (this one may begin
        # the tag again).
        num_reasoning += num_matched
        if token == tags.close_ids[0]:
            return (THINKING, num_reasoning, 1)
        return (THINKING, num_reasoning + 1, 0)

    def rollback(self, num_tokens: int) -> None:
        for _ in range(num_tokens):
            self.states.pop()
        if self.inner is not None and num_tokens:
            self.inner.rollback(num_tokens)

    def is_terminated(self) -> bool:
        return self.inner is not None and self.inner.is_terminated()

    def fill_next_token_bitmask(self, bitmask: torch.Tensor, index: int) -> bool:
        """Row `index` of bitmask ([rows, ceil(V / 32)] int32): what both allow next. Returns
        whether anything is forbidden (False: the row needs no mask)."""
        needed = True
        if self.inner is not None:
            needed = self.inner.fill_next_token_bitmask(bitmask, index)
        else:
            bitmask[index].fill_(-1)
            needed = False
        forced = self.forced()
        if forced is None:
            return needed
        word, bit = divmod(forced, 32)
        allowed = bool(int(bitmask[index, word]) >> bit & 1)
        bitmask[index].zero_()
        if allowed:  # int32: bit 31 is the sign bit
            bitmask[index, word] = (1 << bit) - (1 << 32 if bit == 31 else 0)
        return True

    def find_jump_forward_string(self) -> str:
        """The constraint's (its tokens are then accepted here one by one, budget and all)."""
        return "" if self.inner is None else self.inner.find_jump_forward_string()
