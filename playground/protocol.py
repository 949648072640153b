"""OpenAI-compatible request parsing and response shapes (completions and chat completions).

Request bodies are plain dicts checked field by field, so every error names its parameter.
Sampling fields use OpenAI's names plus ours (vLLM's names for the rest); constraints come as
`response_format` (json_schema / json_object) or `structured_outputs` {json, regex, grammar,
choice} (also vLLM's older guided_json / guided_regex / guided_grammar / guided_choice).
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass

from engine.llm import chat_prompt_ids
from engine.outputs import CompletionOutput, Logprob, RequestOutput
from engine.sampling_params import SamplingParams
from engine.spec_stats import SpecStats


@dataclass(eq=False)
class APIError(Exception):
    """An error answered in OpenAI's shape: {"error": {message, type, param, code}}."""

    message: str
    param: str | None = None
    status: int = 400
    code: str | None = None
    type: str = "invalid_request_error"  # OpenAI's field name

    def __str__(self) -> str:
        return self.message

    def body(self) -> dict:
        return {"error": {k: getattr(self, k) for k in ("message", "type", "param", "code")}}


def param_error(exc: ValueError, body: dict, default_param: str) -> APIError:
    """A 400 naming the field the request used: the engine's ParamError carries a parameter
    (any other ValueError is about default_param); its "structured_outputs" is whichever field
    held the constraint, and its "prompt" is chat's messages."""
    param = getattr(exc, "param", None) or default_param
    if param == "structured_outputs":
        param = constraint_field(body)
    elif param == "prompt" and "messages" in body:
        param = "messages"
    return APIError(str(exc), param)


# Fields every generation endpoint takes, and the type each must have.
_NUMBER = (int, float)
_SAMPLING_FIELDS: dict[str, tuple[type, ...]] = {
    "n": (int,),
    "temperature": _NUMBER,
    "top_p": _NUMBER,
    "top_k": (int,),
    "min_p": _NUMBER,
    "seed": (int,),
    "max_tokens": (int,),
    "min_tokens": (int,),
    "stop": (str, list),
    "stop_token_ids": (list,),
    "ignore_eos": (bool,),
    "include_stop_str_in_output": (bool,),
    "skip_special_tokens": (bool,),
    "repetition_penalty": _NUMBER,
    "presence_penalty": _NUMBER,
    "frequency_penalty": _NUMBER,
    "logit_bias": (dict,),
    "num_speculative_tokens": (int,),
}
# OpenAI fields that do not apply to a local engine: accepted (their types checked) and ignored.
IGNORED_FIELDS: dict[str, tuple[type, ...]] = {
    "metadata": (dict,),  # stored-completion tags
    "store": (bool,),  # OpenAI's storage of completions
    "service_tier": (str,),
    "safety_identifier": (str,),
    "prompt_cache_key": (str,),  # our prefix cache needs no key (cache_salt isolates)
    "reasoning_effort": (str,),  # no reasoning models here
}
_COMMON_FIELDS: dict[str, tuple[type, ...]] = {
    **IGNORED_FIELDS,
    "model": (str,),
    "stream": (bool,),
    "stream_options": (dict,),
    "user": (str,),
    "response_format": (dict,),
    "structured_outputs": (dict,),
    "guided_json": (dict, str),
    "guided_regex": (str,),
    "guided_grammar": (str,),
    "guided_choice": (list,),
    "cache_salt": (str,),
    "return_spec_stats": (bool,),  # ours: the request's speculation counters in the response
    **_SAMPLING_FIELDS,
}
COMPLETION_FIELDS = {
    **_COMMON_FIELDS,
    "prompt": (str, list),
    "logprobs": (int,),
    "echo": (bool,),
    "suffix": (str,),
    "best_of": (int,),
    "prompt_logprobs": (int,),
}
TOKENIZE_FIELDS = {  # vLLM's /tokenize: a prompt, or chat messages
    "model": (str,),
    "prompt": (str,),
    "messages": (list,),
    "add_special_tokens": (bool,),
    "add_generation_prompt": (bool,),
    "continue_final_message": (bool,),
    "return_token_strs": (bool,),
}
DETOKENIZE_FIELDS = {"model": (str,), "tokens": (list,)}
CHAT_FIELDS = {
    **_COMMON_FIELDS,
    "messages": (list,),
    "max_completion_tokens": (int,),
    "logprobs": (bool,),
    "top_logprobs": (int,),
    "tools": (list,),
    "tool_choice": (str, dict),
    "parallel_tool_calls": (bool,),
}


def check_fields(body, fields: dict[str, tuple[type, ...]]) -> dict:
    if not isinstance(body, dict):
        raise APIError("the request body must be a JSON object")
    for name, value in body.items():
        if name not in fields:
            raise APIError(f"unknown parameter {name!r}", name)
        if value is None:
            continue
        kinds = fields[name]
        ok = isinstance(value, kinds) and not (isinstance(value, bool) and bool not in kinds)
        if not ok:
            names = " or ".join(_TYPE_NAMES[k] for k in kinds)
            raise APIError(f"{name} must be {names}, got {value!r:.100}", name)
    return body


_TYPE_NAMES = {
    int: "an integer",
    float: "a number",
    str: "a string",
    list: "an array",
    dict: "an object",
    bool: "a boolean",
}


def structured_outputs(body: dict) -> dict | None:
    """The constraint a request asks for, as engine.grammar StructuredOutputs fields."""
    found: list[tuple[str, dict]] = []
    fmt = body.get("response_format")
    if fmt is not None:
        kind = fmt.get("type")
        if kind == "json_schema":
            spec = fmt.get("json_schema")
            if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
                raise APIError(
                    "response_format json_schema needs json_schema.schema (an object)",
                    "response_format",
                )
            found.append(("response_format", {"json": spec["schema"]}))
        elif kind == "json_object":
            found.append(("response_format", {"json_object": True}))
        elif kind != "text":
            raise APIError(
                f"response_format type must be 'text', 'json_object' or 'json_schema', "
                f"got {kind!r}",
                "response_format",
            )
    if body.get("structured_outputs") is not None:
        found.append(("structured_outputs", dict(body["structured_outputs"])))
    for legacy, key in _LEGACY_CONSTRAINTS.items():
        if body.get(legacy) is not None:
            found.append((legacy, {key: body[legacy]}))
    if len(found) > 1:
        names = ", ".join(name for name, _ in found)
        raise APIError(f"give one constraint, got {names}", found[1][0])
    return found[0][1] if found else None


def constraint_field(body: dict) -> str:
    """The field a request gave its constraint in (for errors found when it compiles)."""
    names = ("response_format", "structured_outputs", *_LEGACY_CONSTRAINTS)
    return next((name for name in names if body.get(name) is not None), "structured_outputs")


_LEGACY_CONSTRAINTS = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_grammar": "grammar",
    "guided_choice": "choice",
}


def sampling_params(body: dict, max_tokens_default: int | None, **overrides) -> SamplingParams:
    kwargs = {k: body[k] for k in _SAMPLING_FIELDS if body.get(k) is not None}
    kwargs.setdefault("max_tokens", max_tokens_default)
    kwargs.update({k: v for k, v in overrides.items() if v is not None})
    if isinstance(kwargs.get("logit_bias"), dict):  # JSON keys are strings
        kwargs["logit_bias"] = {_token_key(k): v for k, v in kwargs["logit_bias"].items()}
    try:
        return SamplingParams(**kwargs, structured_outputs=structured_outputs(body))
    except ValueError as exc:
        raise param_error(exc, body, "structured_outputs") from None


def _token_key(key):
    try:
        return int(key)
    except (TypeError, ValueError):
        raise APIError(f"logit_bias keys must be token ids, got {key!r}", "logit_bias") from None


def refuse_unsupported(body: dict, chat: bool) -> None:
    if not chat:
        if body.get("echo"):
            raise APIError("echo is not supported", "echo")
        if body.get("suffix"):
            raise APIError("suffix is not supported", "suffix")
        best_of = body.get("best_of")
        if best_of is not None and best_of != body.get("n", 1):
            raise APIError("best_of is not supported (it must equal n)", "best_of")
    elif body.get("tools"):
        raise APIError("tools are not supported", "tools")
    elif body.get("tool_choice") not in (None, "none"):
        raise APIError("tool_choice is not supported", "tool_choice")


def include_usage(body: dict) -> bool:
    """Streams end with a usage chunk unless stream_options.include_usage is false."""
    options = body.get("stream_options") or {}
    return options.get("include_usage", True) is not False


def check_messages(messages: list) -> list[dict]:
    if not messages:
        raise APIError("messages must be a non-empty array", "messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant", "tool"):
            raise APIError(
                f"messages[{i}] needs a role of system, user, assistant or tool, got {m!r:.100}",
                "messages",
            )
        content = m.get("content")
        if isinstance(content, list):  # content parts: text only
            texts = []
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text":
                    raise APIError(
                        f"messages[{i}].content: only text parts are supported", "messages"
                    )
                texts.append(str(part.get("text", "")))
            content = "".join(texts)
        if not isinstance(content, str):
            raise APIError(
                f"messages[{i}].content must be a string, got {content!r:.100}", "messages"
            )
        out.append({"role": m["role"], "content": content})
    return out


def tokenize(body: dict, tokenizer, max_model_len: int) -> dict:
    """vLLM's /tokenize answer: a prompt's ids (special tokens added unless
    add_special_tokens is false), or chat messages' through the chat template (ready for the
    reply unless add_generation_prompt is false; continue_final_message leaves the last
    message open; no special tokens added unless asked)."""
    if (body.get("prompt") is None) == (body.get("messages") is None):
        raise APIError("give exactly one of prompt and messages", "prompt")
    if body.get("prompt") is not None:
        ids = tokenizer.encode(
            body["prompt"], add_special_tokens=body.get("add_special_tokens", True)
        )
    else:
        messages = check_messages(body["messages"])
        generation = body.get("add_generation_prompt", True)
        cont = bool(body.get("continue_final_message"))
        if generation and cont:
            raise APIError(
                "continue_final_message needs add_generation_prompt=false", "continue_final_message"
            )
        if not getattr(tokenizer, "chat_template", None):
            raise APIError("this model has no chat template; tokenize a prompt", "messages")
        special = body.get("add_special_tokens", False)
        ids = chat_prompt_ids(tokenizer, messages, generation, cont, special)
    strs = tokenizer.convert_ids_to_tokens(ids) if body.get("return_token_strs") else None
    return {"count": len(ids), "max_model_len": max_model_len, "tokens": ids, "token_strs": strs}


def detokenize_ids(body: dict, vocab_size: int) -> list[int]:
    """/detokenize's token ids, each checked to be in the vocabulary."""
    ids = body.get("tokens")
    if ids is None:
        raise APIError("tokens is required", "tokens")
    bad = [
        t for t in ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab_size
    ]
    if bad:
        raise APIError(
            f"tokens must be token ids in [0, {vocab_size}), got {bad[0]!r:.50}", "tokens"
        )
    return ids


def completion_prompts(prompt) -> list[str | list[int]]:
    """OpenAI's prompt: a string, a list of strings, a list of token ids, or a list of those."""
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt, list) and prompt:
        if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return [list(prompt)]
        if all(isinstance(p, str) for p in prompt):
            return list(prompt)
        if all(isinstance(p, list) and p and all(isinstance(t, int) for t in p) for p in prompt):
            return [list(p) for p in prompt]
    raise APIError(
        "prompt must be a string, an array of strings, an array of token ids or an array of "
        f"those, got {prompt!r:.100}",
        "prompt",
    )


# ---- responses -----------------------------------------------------------------------------
@dataclass
class ResponseContext:
    """What shapes one request's responses: its kind and model, and n and logprobs as asked."""

    kind: str  # "completion" | "chat"
    model: str
    n: int = 1  # choices per prompt: prompt i's choice j is choices[i * n + j]
    logprobs: int | None = None  # top logprobs per token; None: no logprobs
    id: str = ""
    created: int = 0

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


def usage(prompt_tokens: int, completion_tokens: int, cached: int = 0) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def _top(position: dict[int, Logprob], limit: int) -> list[tuple[int, Logprob]]:
    return sorted(
        ((t, lp) for t, lp in position.items() if lp.rank <= limit), key=lambda x: x[1].rank
    )


def completion_logprobs(c: CompletionOutput, limit: int) -> dict:
    """Completions' logprobs: tokens, token_logprobs, top_logprobs, text_offset."""
    tokens, token_lps, tops, offsets = [], [], [], []
    offset = 0
    for token, position in zip(c.token_ids, c.logprobs or [], strict=False):
        chosen = position[token]
        text = chosen.decoded_token or ""
        tokens.append(text)
        token_lps.append(chosen.logprob)
        tops.append({lp.decoded_token: lp.logprob for _, lp in _top(position, limit)})
        offsets.append(offset)
        offset += len(text)
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


def choice(ctx: ResponseContext, index: int, c: CompletionOutput, delta: bool) -> dict:
    """One choice: whole (delta=False) or a stream chunk's piece (c holds only what is new)."""
    lps = None
    if ctx.logprobs is not None and c.logprobs is not None:
        to_dict = chat_logprobs if ctx.kind == "chat" else completion_logprobs
        lps = to_dict(c, ctx.logprobs)
    out: dict = {"index": index}
    if ctx.kind == "chat" and delta:
        out["delta"] = {"content": c.text}
    elif ctx.kind == "chat":
        out["message"] = {"role": "assistant", "content": c.text}
    else:
        out["text"] = c.text
    out["logprobs"] = lps
    out["finish_reason"] = c.finish_reason
    if c.finish_reason is not None:
        out["stop_reason"] = c.stop_reason
    return out


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
            choices.append(choice(ctx, i * ctx.n + c.index, c, delta=False))
            if out.prompt_logprobs is not None:
                choices[-1]["prompt_logprobs"] = _prompt_logprobs(out)
    body = ctx.envelope(choices)
    body["usage"] = usage(
        sum(len(out.prompt_token_ids) for out in outs),
        sum(len(c.token_ids) for out in outs for c in out.outputs),
        sum(out.num_cached_tokens for out in outs),
    )
    if with_spec_stats:
        body["speculation"] = spec_stats(outs)
    return body
