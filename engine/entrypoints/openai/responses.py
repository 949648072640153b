"""OpenAI-compatible response shapes: choices whole and streamed (tool calls parsed, echo
prepended), logprobs in each endpoint's shape, usage, and beam search results as choices."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field

from engine.entrypoints import reasoning
from engine.entrypoints.beam_search import BeamSearchOutput
from engine.entrypoints.tools import ToolCallParser, parse_tool_calls
from engine.outputs import CompletionOutput, Logprob, RequestOutput
from spec.stats import SpecStats


@dataclass
class Echo:
    """What /v1/completions' echo puts before a prompt's completions."""

    text: str  # the prompt as given (token ids decoded)
    first_token: str  # its first token's text (the one token without a logprob)
    only: bool = False  # max_tokens 0: the prompt alone, no completion


@dataclass
class ResponseContext:
    """What shapes one request's responses: its kind and model, n and logprobs as asked, echo
    per prompt (completions), whether chat answers are read for reasoning and for tool calls,
    and what a stream has sent so far of each choice (its reasoning and tool-call parsers;
    whether its echo went out)."""

    kind: str  # "completion" | "chat"
    model: str
    n: int = 1  # choices per prompt: prompt i's choice j is choices[i * n + j]
    logprobs: int | None = None  # top logprobs per token; None: no logprobs
    echoes: list[Echo] | None = None  # per prompt
    tools: bool = False
    # Chat answers split into reasoning_content and content (engine.entrypoints.reasoning):
    # None: not split; else whether the prompt left `<think>` open.
    starts_in_reasoning: bool | None = None
    with_prompt_logprobs: bool = False  # vLLM's prompt_logprobs field, when asked for
    with_cached_tokens: bool = False  # usage shows cached_tokens (the server's flag)
    with_prediction: bool = False  # usage shows the prediction's accepted and rejected tokens
    id: str = ""
    created: int = 0
    parsers: dict[int, ToolCallParser] = field(default_factory=dict)
    reasoners: dict[int, reasoning.ReasoningParser] = field(default_factory=dict)
    echoed: set[int] = field(default_factory=set)
    next_offset: dict[int, int] = field(default_factory=dict)  # text_offset a chunk starts at

    def __post_init__(self) -> None:
        prefix = "chatcmpl" if self.kind == "chat" else "cmpl"
        self.id = self.id or f"{prefix}-{uuid.uuid4().hex}"
        self.created = self.created or int(time.time())

    def envelope(self, choices: list[dict], chunk: bool = False) -> dict:
        if self.kind == "chat":
            obj = "chat.completion.chunk" if chunk else "chat.completion"
        else:
            obj = "text_completion"
        return {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    @property
    def echo_only(self) -> bool:
        return bool(self.echoes) and self.echoes[0].only


def usage(
    prompt_tokens: int,
    completion_tokens: int,
    cached: int | None = None,
    predicted: SpecStats | None = None,
) -> dict:
    """OpenAI's usage; prompt_tokens_details.cached_tokens only when given (a server flag:
    it tells a client which prefixes others sent); completion_tokens_details with a prediction's
    drafts accepted and rejected when the request gave one (`predicted`: its counters)."""
    body = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
    if cached is not None:
        body["prompt_tokens_details"] = {"cached_tokens": cached}
    if predicted is not None:
        accepted = predicted.num_predicted_accepted
        body["completion_tokens_details"] = {
            "accepted_prediction_tokens": accepted,
            "rejected_prediction_tokens": predicted.num_predicted - accepted,
        }
    return body


def prediction_stats(ctx: ResponseContext, outs: list[RequestOutput]) -> SpecStats | None:
    """The requests' speculation counters summed, for usage, when they gave a prediction."""
    if not ctx.with_prediction:
        return None
    return SpecStats.merged(o.metrics.spec for o in outs if o.metrics and o.metrics.spec)


def _top(position: dict[int, Logprob], limit: int) -> list[tuple[int, Logprob]]:
    return sorted(
        ((t, lp) for t, lp in position.items() if lp.rank <= limit), key=lambda x: x[1].rank
    )


Entries = tuple[list[str], list[float | None], list[dict | None]]  # tokens, logprobs, tops


def _entries(token_ids, positions, limit: int) -> Entries:
    tokens, token_lps, tops = [], [], []
    for token, position in zip(token_ids, positions, strict=False):
        chosen = position[token]
        tokens.append(chosen.decoded_token or "")
        token_lps.append(chosen.logprob)
        tops.append({lp.decoded_token: lp.logprob for _, lp in _top(position, limit)})
    return tokens, token_lps, tops


def _echo_entries(out: RequestOutput, echo: Echo, limit: int) -> Entries:
    """The prompt's tokens: OpenAI's echo gives the first no logprob (null)."""
    tokens, token_lps, tops = _entries(out.prompt_token_ids[1:], out.prompt_logprobs[1:], limit)
    return [echo.first_token, *tokens], [None, *token_lps], [None, *tops]


def completion_logprobs(
    c: CompletionOutput, limit: int, prefix: Entries | None = None, start: int = 0
) -> dict:
    """Completions' logprobs: tokens, token_logprobs, top_logprobs, text_offset (prefix: the
    echoed prompt's, first; start: the offset of the first token, for a stream's later
    chunks)."""
    tokens, token_lps, tops = _entries(c.token_ids, c.logprobs or [], limit)
    if prefix is not None:
        tokens, token_lps, tops = prefix[0] + tokens, prefix[1] + token_lps, prefix[2] + tops
    offsets = []
    for text in tokens:
        offsets.append(start)
        start += len(text)
    return {
        "tokens": tokens,
        "token_logprobs": token_lps,
        "top_logprobs": tops,
        "text_offset": offsets,
    }


def chat_logprobs(c: CompletionOutput, limit: int) -> dict:
    def entry(lp: Logprob) -> dict:
        text = lp.decoded_token or ""
        return {"token": text, "logprob": lp.logprob, "bytes": list(text.encode())}

    content = []
    for token, position in zip(c.token_ids, c.logprobs or [], strict=False):
        tops = [entry(lp) for _, lp in _top(position, limit)]
        content.append(entry(position[token]) | {"top_logprobs": tops})
    return {"content": content}


def choice(
    ctx: ResponseContext, index: int, c: CompletionOutput, delta: bool, out: RequestOutput
) -> dict:
    """One choice: whole (delta=False) or a stream chunk's piece (c holds only what is new;
    out is the output it came in)."""
    if ctx.kind == "chat":
        body = _chat_choice(ctx, index, c, delta)
    else:
        body = _completion_choice(ctx, index, c, delta, out)
    if ctx.logprobs is not None and ctx.kind == "chat" and c.logprobs is not None:
        body["logprobs"] = chat_logprobs(c, ctx.logprobs)
    body.setdefault("logprobs", None)
    if body["finish_reason"] is not None:
        body["stop_reason"] = c.stop_reason
    return body


def _chat_choice(ctx: ResponseContext, index: int, c: CompletionOutput, delta: bool) -> dict:
    finish = c.finish_reason
    if not ctx.tools and ctx.starts_in_reasoning is None:
        if delta:
            return {"index": index, "delta": {"content": c.text}, "finish_reason": finish}
        message = {"role": "assistant", "content": c.text}
        return {"index": index, "message": message, "finish_reason": finish}
    if not delta:
        thought, content = None, c.text
        if ctx.starts_in_reasoning is not None:
            thought, content = reasoning.split(c.text, ctx.starts_in_reasoning)
        calls = []
        if ctx.tools and content is not None:
            content, calls = parse_tool_calls(content)
        message = {"role": "assistant", "content": content}
        if ctx.starts_in_reasoning is not None:  # (null when the answer did not think)
            message["reasoning_content"] = thought
        if calls:
            message["tool_calls"] = [
                {
                    "id": t.id,
                    "type": "function",
                    "function": {"name": t.name, "arguments": t.arguments},
                }
                for t in calls
            ]
        return {"index": index, "message": message, "finish_reason": _tool_finish(finish, calls)}
    return _chat_delta(ctx, index, c)


def _chat_delta(ctx: ResponseContext, index: int, c: CompletionOutput) -> dict:
    """A stream chunk's piece of a chat answer that is split into reasoning, content and tool
    calls (c holds only what is new)."""
    finish, piece, text = c.finish_reason, {}, c.text
    if ctx.starts_in_reasoning is not None:
        reader = ctx.reasoners.setdefault(index, reasoning.ReasoningParser(ctx.starts_in_reasoning))
        new = reader.feed(c.text, finished=finish is not None)
        if new.reasoning:
            piece["reasoning_content"] = new.reasoning
        text = new.content
    if not ctx.tools:
        if text:
            piece["content"] = text
        return {"index": index, "delta": piece, "finish_reason": finish}
    parser = ctx.parsers.setdefault(index, ToolCallParser())
    calls = parser.feed(parser.text + text)
    if finish is not None:
        calls.content += parser.finish().content
    if calls.content:
        piece["content"] = calls.content
    if calls.calls:
        piece["tool_calls"] = calls.calls
    return {"index": index, "delta": piece, "finish_reason": _tool_finish(finish, parser.calls)}


def _tool_finish(finish: str | None, calls: list) -> str | None:
    """OpenAI's finish_reason for an answer that made calls and stopped on its own."""
    return "tool_calls" if calls and finish == "stop" else finish


def _completion_choice(
    ctx: ResponseContext, index: int, c: CompletionOutput, delta: bool, out: RequestOutput
) -> dict:
    """A completion's text, with the prompt before it the first time when echo is on."""
    echo = ctx.echoes[index // ctx.n] if ctx.echoes else None
    prefix = echo is not None and index not in ctx.echoed
    if prefix and delta:
        ctx.echoed.add(index)
    if echo is not None and echo.only:  # the one token generated is not part of the answer
        finish = "length" if c.finish_reason else None
        c = CompletionOutput(c.index, "", [], logprobs=[], finish_reason=finish)
    text = (echo.text if prefix else "") + c.text
    body: dict = {"index": index, "text": text, "finish_reason": c.finish_reason}
    if ctx.logprobs is not None and c.logprobs is not None:
        head = _echo_entries(out, echo, ctx.logprobs) if prefix else None
        start = ctx.next_offset.get(index, 0) if delta else 0
        lps = completion_logprobs(c, ctx.logprobs, head, start)
        if delta:  # a stream's offsets run on across its chunks
            ctx.next_offset[index] = start + sum(map(len, lps["tokens"]))
        body["logprobs"] = lps
    return body


def spec_stats(outs: list[RequestOutput]) -> dict:
    """The requests' speculation counters summed (drafted, accepted, forced, by position)."""
    return SpecStats.merged(o.metrics.spec for o in outs if o.metrics and o.metrics.spec).as_dict()


def _prompt_logprobs(out: RequestOutput) -> list[dict | None]:
    """vLLM's extension: per prompt position, token id -> logprob, rank, decoded_token."""
    return [
        None
        if position is None
        else {
            str(t): {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": lp.decoded_token}
            for t, lp in position.items()
        }
        for position in out.prompt_logprobs
    ]


def final_response(
    ctx: ResponseContext, outs: list[RequestOutput], with_spec_stats: bool = False
) -> dict:
    choices = []
    for i, out in enumerate(outs):
        for c in out.outputs:
            choices.append(choice(ctx, i * ctx.n + c.index, c, False, out))
            if ctx.with_prompt_logprobs:
                choices[-1]["prompt_logprobs"] = _prompt_logprobs(out)
    body = ctx.envelope(choices)
    body["usage"] = usage(
        sum(len(out.prompt_token_ids) for out in outs),
        completion_tokens(ctx, outs),
        sum(out.num_cached_tokens for out in outs) if ctx.with_cached_tokens else None,
        prediction_stats(ctx, outs),
    )
    if with_spec_stats:
        body["speculation"] = spec_stats(outs)
    return body


def completion_tokens(ctx: ResponseContext, outs: list[RequestOutput]) -> int:
    """Tokens the answer holds (none when echo shows the prompt alone)."""
    return 0 if ctx.echo_only else sum(len(c.token_ids) for out in outs for c in out.outputs)


def beam_outputs(outs: list[BeamSearchOutput], n: int) -> list[RequestOutput]:
    """Each prompt's n best beams as a finished RequestOutput (the responses' shapes)."""
    return [
        RequestOutput(
            "",
            None,
            out.prompt_token_ids,
            [
                CompletionOutput(
                    i, s.text, s.token_ids, s.cum_logprob, finish_reason=s.finish_reason
                )
                for i, s in enumerate(out.sequences[:n])
            ],
            finished=True,
        )
        for out in outs
    ]
