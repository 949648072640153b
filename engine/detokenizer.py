"""Incremental detokenization and stop-string matching.

Decodes a short window of tokens each time (prefix/read offsets, as in HF's TextStreamer and
vLLM): the text is emitted only once it no longer ends in U+FFFD, so a multi-byte character
split across tokens is never streamed half-done. Stop strings are matched on the output text;
`visible_len` holds back enough characters that a stop string can still be cut cleanly. The
text is the tokens' exact decoding: no space clean-up, so streamed and whole outputs agree.
"""

from __future__ import annotations

from functools import partial

INITIAL_CONTEXT = 5  # prompt tokens decoded with the first output token (leading spaces)


class ExactDecoder:
    """Exact decoding, never HF's clean_up_tokenization_spaces (as vLLM): that clean-up rewrites
    " ," to "," and " 's" to "'s" over whatever text it is given, so applied to the short windows
    below it loses characters ("a , b" would stream as "a  b"). For a fast tokenizer the Rust
    decode itself, several times cheaper per call than the wrapper's argument handling
    (bench.choices), which adds up at large batches. One token's text alone is remembered (at
    most one entry per vocabulary id and flag): the detokenizer's window before the newest
    token is usually one token, and so is every logprob entry."""

    def __init__(self, tokenizer):
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is not None:
            self._decode = backend.decode
        else:
            self._decode = partial(tokenizer.decode, clean_up_tokenization_spaces=False)
        self._one: tuple[dict[int, str], dict[int, str]] = ({}, {})  # by skip_special_tokens

    def __call__(self, ids: list[int], skip_special_tokens: bool) -> str:
        if len(ids) != 1:
            return self._decode(ids, skip_special_tokens=skip_special_tokens)
        known = self._one[skip_special_tokens]
        text = known.get(ids[0])
        if text is None:
            text = known[ids[0]] = self._decode(ids, skip_special_tokens=skip_special_tokens)
        return text


class IncrementalDetokenizer:
    def __init__(
        self,
        decode: ExactDecoder,
        prompt_token_ids: list[int],
        skip_special_tokens: bool,
        stop: list[str],
        include_stop_str_in_output: bool,
    ):
        self.decode = decode
        self.skip_special_tokens = skip_special_tokens
        self.ids = list(prompt_token_ids[-INITIAL_CONTEXT:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""
        self.stop = stop
        self.include_stop = include_stop_str_in_output
        self.hold_back = max((len(s) for s in stop), default=1) - 1
        self.num_visible = 0  # characters already shown to the caller

    def _decode(self, ids: list[int]) -> str:
        return self.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add_token(self, token_id: int, check_stop: bool = True) -> str | None:
        """Append a token; returns the stop string if the output now contains one (the text is
        then cut there), else None. check_stop=False (before min_tokens) only extends text."""
        self.ids.append(token_id)
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return None
        new_text = full[len(prefix) :]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        search_from = max(0, len(self.text) - self.hold_back - 1)
        self.text += new_text
        return self._check_stop(search_from) if check_stop else None

    def _check_stop(self, search_from: int) -> str | None:
        best = None
        for s in self.stop:
            at = self.text.find(s, search_from)
            if at != -1 and (best is None or at < best[0]):
                best = (at, s)
        if best is None:
            return None
        at, s = best
        self.text = self.text[: at + len(s)] if self.include_stop else self.text[:at]
        return s

    def flush(self) -> None:
        """At finish: emit whatever is still held back, even a dangling partial character."""
        if self.read_offset < len(self.ids):
            prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
            full = self._decode(self.ids[self.prefix_offset :])
            self.text += full[len(prefix) :]
            self.read_offset = len(self.ids)

    def visible_len(self, finished: bool) -> int:
        """How much of the text is safe to show: all of it when finished, else all but the
        stop-string hold-back. It only ever grows: a stop string can only cut inside the
        held-back tail."""
        if finished or not self.stop:
            return len(self.text)
        self.num_visible = max(self.num_visible, len(self.text) - self.hold_back)
        return self.num_visible
