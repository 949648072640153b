"""Reasoning models: the thinking a chat answer starts with, returned apart as `reasoning_content`.

Templates that think (Qwen3's, DeepSeek-R1's, QwQ's) have the model write its reasoning between
`<think>` and `</think>` before the answer. Some open `<think>` in the prompt themselves
(DeepSeek-R1's, Qwen3's Thinking-2507), so the output starts inside the thinking; Qwen3's leaves
it to the model, and writes `<think>\\n\\n</think>\\n\\n` into the prompt itself when the
request sets `enable_thinking: false`.

One rule for every such template:
- the output starts inside the thinking when the prompt's text leaves a `<think>` open (its last
  `<think>` comes after its last `</think>`), or when the output begins with `<think>` (after
  whitespace); any other output is all content (a `<think>` later on is text);
- the reasoning runs to the first `</think>` (to the output's end when there is none: a model
  cut off while thinking answered nothing), stripped of surrounding whitespace; none (null)
  when that leaves nothing;
- the content is what follows that `</think>`, less its leading whitespace; none when empty.

`ReasoningParser.feed` reads a stream by the same rule, piece by piece, and what it returns,
joined, is exactly `split`'s answer: a partial tag, and whitespace that may yet end the
reasoning, are held back until the next piece (or the stream's end) decides.
"""

from __future__ import annotations

from dataclasses import dataclass

OPEN, CLOSE = "<think>", "</think>"
PARSERS = ("auto", "qwen3", "deepseek_r1", "none")  # --reasoning-parser (vLLM's names)


def parser_enabled(name: str, chat_template) -> bool:
    """Whether chat answers are split (--reasoning-parser): qwen3 and deepseek_r1 (vLLM's names;
    one rule serves both here) always, none never, auto when the chat template writes `<think>`."""
    if name not in PARSERS:
        raise ValueError(f"reasoning parser must be one of {', '.join(PARSERS)}, got {name!r}")
    if name == "auto":
        return OPEN in str(chat_template or "")
    return name != "none"


def prompt_leaves_open(tokenizer, prompt_ids: list[int]) -> bool:
    """Whether the prompt ends inside a thinking block (its template opened `<think>`)."""
    text = tokenizer.decode(prompt_ids, skip_special_tokens=False)
    return text.rfind(OPEN) > text.rfind(CLOSE)


def split(text: str, starts_open: bool) -> tuple[str | None, str | None]:
    """(reasoning, content) of a finished answer, by the module's rule."""
    parser = ReasoningParser(starts_open)
    parser.feed(text, finished=True)
    return parser.reasoning or None, parser.content or None


@dataclass
class ReasoningDelta:
    reasoning: str = ""
    content: str = ""


class ReasoningParser:
    """One answer's split as its text grows: `feed` takes the next piece and returns what is new
    of the reasoning and of the content; `reasoning` and `content` hold what was sent."""

    def __init__(self, starts_open: bool):
        self.text = ""
        self.start: int | None = 0 if starts_open else None  # where the reasoning begins
        self.is_thinking: bool | None = True if starts_open else None  # None: undecided
        self.end: int | None = None  # where `</think>` begins, once found
        self.reasoning = ""
        self.content = ""

    def feed(self, piece: str, finished: bool = False) -> ReasoningDelta:
        self.text += piece
        if self.is_thinking is None:
            self._decide(finished)
        if self.is_thinking is None:
            return ReasoningDelta()
        if not self.is_thinking:
            return self._send("", self.text)
        if self.end is None:
            found = self.text.find(CLOSE, max(self.start, len(self.text) - len(piece) - len(CLOSE)))
            self.end = found if found >= 0 else None
        if self.end is not None:
            reasoning = self.text[self.start : self.end].strip()
            return self._send(reasoning, self.text[self.end + len(CLOSE) :].lstrip())
        safe = len(self.text) if finished else self._before_partial_close()
        return self._send(self.text[self.start : safe].strip(), "")

    def _decide(self, finished: bool) -> None:
        """Whether the answer opens with `<think>`: undecided while its text (less leading
        whitespace) is empty or could still grow into the tag, unless the stream has ended."""
        head = self.text.lstrip()
        if head.startswith(OPEN):
            self.is_thinking = True
            self.start = len(self.text) - len(head) + len(OPEN)
        elif finished or not OPEN.startswith(head):
            self.is_thinking = False

    def _before_partial_close(self) -> int:
        """The text's length less a trailing beginning of `</think>`."""
        text = self.text
        for n in range(min(len(CLOSE) - 1, len(text) - self.start), 0, -1):
            if CLOSE.startswith(text[-n:]):
                return len(text) - n
        return len(text)

    def _send(self, reasoning: str, content: str) -> ReasoningDelta:
        """What is new: the reasoning and content known so far begin with what was sent."""
        delta = ReasoningDelta(reasoning[len(self.reasoning) :], content[len(self.content) :])
        if len(reasoning) > len(self.reasoning):
            self.reasoning = reasoning
        if len(content) > len(self.content):
            self.content = content
        return delta
