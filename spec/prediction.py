"""Predicted Outputs: the text a request's answer will mostly repeat (OpenAI's `prediction`, such
as the file an edit rewrites), drafted in step with the output as it grows.

A cursor follows the output through the prediction's tokens. While every new output token is
the one at the cursor, the cursor moves on and the tokens after it are the next drafts. At the
first token that differs the prediction is out of step (an edit began); each step after that it
looks for where the output's last tokens (up to MAX_MATCH) occur in the prediction: first at or
after the last place where output and prediction agreed (an edit moves forward), the longest
such match and then the earliest; failing that, the latest earlier match of at least two tokens
(the answer went back, e.g. it repeats a line). A match of L tokens found by search drafts 2^L
tokens until the output confirms it (a single common token is a guess; eight in a row rarely
are); a confirmed one drafts up to the step's limit (engine.config.MAX_PREDICTED_DRAFTS, more
than a proposer's MAX_SPECULATIVE_TOKENS: an aligned prediction is long and almost always right).

The drafts are deterministic (q one-hot), verified like every other draft, so the output is the
one the request would produce without a prediction; the prediction only decides how much of it
comes per step.
"""

from __future__ import annotations

import numpy as np

from engine.errors import ParamError

MAX_PREDICTION_TOKENS = 32768
MAX_MATCH = 8  # output tokens a realignment matches at most


def prediction_ids(prediction, tokenizer, vocab_size: int) -> list[int] | None:
    """A request's prediction (text, or token ids in [0, vocab_size)) as token ids; ParamError
    names `prediction` for anything else or for more than MAX_PREDICTION_TOKENS tokens."""
    if prediction is None:
        return None
    if isinstance(prediction, str):
        ids = tokenizer.encode(prediction, add_special_tokens=False)
    elif isinstance(prediction, list | tuple) and all(
        isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab_size for t in prediction
    ):
        ids = list(prediction)
    else:
        why = f"a string or a list of token ids in [0, {vocab_size})"
        raise ParamError("prediction", f"prediction must be {why}, got {prediction!r:.100}")
    if len(ids) > MAX_PREDICTION_TOKENS:
        raise ParamError(
            "prediction",
            f"prediction has {len(ids)} tokens, at most {MAX_PREDICTION_TOKENS} are accepted",
        )
    return ids


class Prediction:
    """One request's prediction and where its output stands in it."""

    __slots__ = ("token_ids", "cursor", "anchor", "aligned", "num_matched", "num_seen")

    def __init__(self, token_ids: list[int]):
        self.token_ids = np.asarray(token_ids, dtype=np.int64)  # [P]
        self.cursor = 0  # where the output's next token is expected in the prediction
        self.anchor = 0  # the cursor after the last output token the prediction agreed with
        self.aligned = True  # at the start, the prediction's first tokens are the drafts
        self.num_matched = 0  # aligned by a search of this many tokens, unconfirmed (0: none)
        self.num_seen = 0  # output tokens followed so far

    def drafts(self, output: list[int], forced: list[int], limit: int) -> list[int]:
        """The drafts after `output` and the step's forced tokens, at most `limit`."""
        self._follow(output)
        if not self.aligned or limit <= 0:
            return []
        start = self.cursor + len(forced)
        if forced and self.token_ids[self.cursor : start].tolist() != forced:
            return []  # the forced tokens leave the prediction: realigned next step
        n = min(limit, 2**self.num_matched) if self.num_matched else limit
        return self.token_ids[start : start + n].tolist()

    def _follow(self, output: list[int]) -> None:
        """Move the cursor over the output tokens that came since the last call."""
        predicted, size = self.token_ids, len(self.token_ids)
        for token in output[self.num_seen :]:
            if self.aligned and self.cursor < size and predicted[self.cursor] == token:
                self.cursor += 1
                self.anchor, self.num_matched = self.cursor, 0
            else:
                self.aligned = False
        self.num_seen = len(output)
        if not self.aligned and output:
            self._realign(output[-MAX_MATCH:])

    def _realign(self, tail: list[int]) -> None:
        predicted = self.token_ids
        # Candidate ends: positions i holding the output's last token; then how far back from
        # each the prediction keeps matching the output (at most len(tail) tokens).
        ends = np.flatnonzero(predicted == tail[-1])
        if not len(ends):
            return
        length = np.ones(len(ends), dtype=np.int64)
        still = np.ones(len(ends), dtype=bool)
        for j in range(1, len(tail)):
            back = ends - j
            ok = back >= 0
            ok[ok] = predicted[back[ok]] == tail[-1 - j]
            still &= ok
            length += still
        ahead = ends >= self.anchor
        if ahead.any():
            pick = _longest_then_first(length, ahead)
        else:
            behind = length >= 2
            if not behind.any():
                return
            pick = _longest_then_first(length, behind, last=True)
        self.cursor = int(ends[pick]) + 1
        self.aligned, self.num_matched = True, int(length[pick])


def _longest_then_first(length: np.ndarray, allowed: np.ndarray, last: bool = False) -> int:
    """The index of the longest allowed match: the first of equals (the last with `last`)."""
    scores = np.where(allowed, length, -1)
    best = np.flatnonzero(scores == scores.max())
    return int(best[-1] if last else best[0])
