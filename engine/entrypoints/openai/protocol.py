"""OpenAI-compatible request parsing (completions and chat completions; responses.py shapes
the answers).

Request bodies are plain dicts checked field by field, so every error names its parameter.
Sampling fields use OpenAI's names plus ours (vLLM's names for the rest); constraints come as
`response_format` (json_schema / json_object) or `structured_outputs` {json, regex, grammar,
choice} (also vLLM's older guided_json / guided_regex / guided_grammar / guided_choice).
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass

from engine.entrypoints.beam_search import BeamSearchParams
from engine.entrypoints.llm import chat_prompt_ids
from engine.sampling_params import SamplingParams


@dataclass(eq=False)
class APIError(Exception):
    """An error answered in OpenAI's shape: {"error": {message, type, param, code}}."""

    message: str
    param: str | None = None
    status: int = 400
    code: str | None = None
    type: str = "invalid_request_error"  # OpenAI's field name
    headers: dict[str, str] | None = None  # sent with the answer (a 429's Retry-After)

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
    elif param == "logprobs" and "messages" in body:  # chat's count is top_logprobs
        param = "top_logprobs"
    elif param == "beam_width":  # the beams are best_of (completions) or n
        param = "best_of" if body.get("best_of") is not None else "n"
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
    "thinking_token_budget": (int,),  # vLLM's: reasoning tokens before `</think>` is forced
}
# OpenAI fields that do not apply to a local engine: accepted (their types checked) and ignored.
IGNORED_FIELDS: dict[str, tuple[type, ...]] = {
    "metadata": (dict,),  # stored-completion tags
    "store": (bool,),  # OpenAI's storage of completions
    "service_tier": (str,),
    "safety_identifier": (str,),
    "prompt_cache_key": (str,),  # our prefix cache needs no key (cache_salt isolates)
    "reasoning_effort": (str,),  # chat: a template variable (ecosystem.reasoning_effort_kwargs)
    # vLLM's and llama.cpp's that change no output here:
    "cache_prompt": (bool,),  # llama.cpp's; prefix caching is automatic
    "id_slot": (int,),  # llama.cpp's slot choice (one engine batches every request)
    "timings_per_token": (bool,),  # llama.cpp's timing report
    "priority": (int,),  # vLLM's scheduling priority (requests run first come, first served)
    "request_id": (str,),  # vLLM's; response ids stay the server's (unique across clients)
    "spaces_between_special_tokens": (bool,),  # no effect with fast tokenizers (as in vLLM)
    "guided_decoding_backend": (str,),  # one backend (xgrammar)
}
# Fields vLLM's and llama.cpp's clients send that the server honours (ecosystem.py says how).
ECOSYSTEM_FIELDS: dict[str, tuple[type, ...]] = {
    "n_predict": (int,),  # llama.cpp's max_tokens (-1: no limit)
    "n_probs": (int,),  # llama.cpp's top logprobs per token
    "truncate_prompt_tokens": (int,),  # vLLM's: keep the prompt's last N tokens
    "thinking_budget_tokens": (int,),  # llama.cpp's thinking_token_budget (-1: none)
}
CHAT_TEMPLATE_FIELDS: dict[str, tuple[type, ...]] = {  # vLLM's, for the chat template
    "chat_template_kwargs": (dict,),
    "add_generation_prompt": (bool,),
    "continue_final_message": (bool,),
    "add_special_tokens": (bool,),
    "documents": (list,),
}
_COMMON_FIELDS: dict[str, tuple[type, ...]] = {
    **IGNORED_FIELDS,
    **ECOSYSTEM_FIELDS,
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
    "use_beam_search": (bool,),  # vLLM's: n (or best_of) beams, the best n returned
    "length_penalty": _NUMBER,
    "prediction": (dict,),  # OpenAI's Predicted Outputs (prediction_content)
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
    **CHAT_TEMPLATE_FIELDS,
    "reasoning_effort": (str,),
    "model": (str,),
    "prompt": (str,),
    "messages": (list,),
    "return_token_strs": (bool,),
}
DETOKENIZE_FIELDS = {"model": (str,), "tokens": (list,)}
LOAD_LORA_FIELDS = {"lora_name": (str,), "lora_path": (str,)}  # vLLM's adapter hot-load
UNLOAD_LORA_FIELDS = {"lora_name": (str,), "lora_int_id": (int,)}
CHAT_FIELDS = {
    **_COMMON_FIELDS,
    **CHAT_TEMPLATE_FIELDS,
    "messages": (list,),
    "max_completion_tokens": (int,),
    "logprobs": (bool,),
    "top_logprobs": (int,),
    "tools": (list,),
    "tool_choice": (str, dict),
    "parallel_tool_calls": (bool,),
}


MAX_JSON_DEPTH = 100  # arrays and objects inside one another in a request body


def parse_body(raw: bytes):
    """A request body as JSON: 400 for text that is not JSON and for nesting past
    MAX_JSON_DEPTH (deeper still, the parser itself would run out of stack: a RecursionError)."""
    try:
        body = json.loads(raw)
    except RecursionError:
        body, depth = None, None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise APIError(f"the request body is not valid JSON: {exc}") from None
    else:
        depth = nesting_depth(body, MAX_JSON_DEPTH)
    if depth is None or depth > MAX_JSON_DEPTH:
        shown = "far deeper" if depth is None else depth
        raise APIError(
            f"the request body nests {shown} levels deep; at most {MAX_JSON_DEPTH} "
            "(arrays and objects inside one another)"
        )
    return body


def nesting_depth(value, limit: int) -> int:
    """How deep arrays and objects nest in value (a scalar: 0), counted up to limit + 1;
    iterative, so no depth overflows the stack."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else item
        if not isinstance(item, dict | list):
            continue
        deepest = max(deepest, depth)
        if deepest > limit:
            return deepest
        stack.extend((child, depth + 1) for child in children if isinstance(child, dict | list))
    return deepest


async def read_json(request):
    """The body as JSON; a large one is parsed off the event loop (which answers /health)."""
    raw = await request.body()
    if len(raw) > PARSE_INLINE_BYTES:
        return await asyncio.to_thread(parse_body, raw)
    return parse_body(raw)


PARSE_INLINE_BYTES = 64 * 1024


def check_fields(body, fields: dict[str, tuple[type, ...]]) -> dict:
    """A body of the adapter admin routes: every field known (a misspelt one would load
    something else), each of its type."""
    if not isinstance(body, dict):
        raise APIError("the request body must be a JSON object")
    for name, value in body.items():
        if name not in fields:
            raise APIError(f"unknown parameter {name!r}", name)
        check_type(name, value, fields[name])
    return body


def check_type(name: str, value, kinds: tuple[type, ...]) -> None:
    if value is None:
        return
    ok = isinstance(value, kinds) and not (isinstance(value, bool) and bool not in kinds)
    if not ok:
        names = " or ".join(_TYPE_NAMES[k] for k in kinds)
        raise APIError(f"{name} must be {names}, got {value!r:.100}", name)


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
    kwargs["prediction"] = prediction_content(body.get("prediction"))
    try:
        return SamplingParams(**kwargs, structured_outputs=structured_outputs(body))
    except ValueError as exc:
        raise param_error(exc, body, "structured_outputs") from None


def prediction_content(prediction: dict | None) -> str | None:
    """The text of OpenAI's `prediction` ({"type": "content", "content": a string or a list of
    {"type": "text", "text": ...} parts}); 400 naming it for any other shape."""
    if prediction is None:
        return None
    content = prediction.get("content")
    if isinstance(content, list) and all(
        isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
        for p in content
    ):
        content = "".join(p["text"] for p in content)
    if prediction.get("type") != "content" or not isinstance(content, str) or len(prediction) > 2:
        raise APIError(
            'prediction must be {"type": "content", "content": a string or a list of text '
            f"parts}}, got {prediction!r:.100}",
            "prediction",
        )
    return content


def refuse_unsupported(body: dict) -> None:
    """Completion fields the engine does not serve."""
    if body.get("suffix"):
        raise APIError("suffix is not supported", "suffix")
    best_of = body.get("best_of")
    if best_of is not None and best_of != (body.get("n") or 1):
        raise APIError("best_of is not supported (it must equal n)", "best_of")


# Fields that shape sampled output, which beam search (greedy beams) does not take.
_NOT_WITH_BEAMS = (
    "stream",
    "logprobs",
    "top_logprobs",
    "echo",
    "suffix",
    "tools",
    "response_format",
    "structured_outputs",
    "prediction",
    "thinking_token_budget",
    *_LEGACY_CONSTRAINTS,
)


def beam_params(body: dict, max_tokens_default: int | None) -> BeamSearchParams:
    """vLLM's use_beam_search: beam_width = best_of (completions) or n; n best come back."""
    for name in _NOT_WITH_BEAMS:
        if body.get(name):
            raise APIError(f"{name} cannot be combined with use_beam_search", name)
    if body.get("temperature") not in (None, 0):
        raise APIError(
            "use_beam_search ranks beams by log-probability: temperature must be 0 or absent",
            "temperature",
        )
    n = body.get("n") or 1
    width = body.get("best_of") or n
    if width < n:
        raise APIError(f"best_of={width} must be >= n={n}", "best_of")
    max_tokens = body.get("max_completion_tokens") or body.get("max_tokens") or max_tokens_default
    try:
        return BeamSearchParams(
            width,
            max_tokens,
            1.0 if body.get("length_penalty") is None else body["length_penalty"],
            bool(body.get("ignore_eos")),
        )
    except ValueError as exc:
        raise param_error(exc, body, "use_beam_search") from None


def include_usage(body: dict) -> bool:
    """Streams end with a usage chunk unless stream_options.include_usage is false."""
    options = body.get("stream_options") or {}
    return options.get("include_usage", True) is not False


def check_messages(messages: list) -> list[dict]:
    """Chat messages with their content as text; an assistant's tool_calls and a tool result's
    tool_call_id are kept (engine.entrypoints.tools.render_messages checks the calls)."""
    if not messages:
        raise APIError("messages must be a non-empty array", "messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant", "tool"):
            raise APIError(
                f"messages[{i}] needs a role of system, user, assistant or tool, got {m!r:.100}",
                "messages",
            )
        message = {"role": m["role"], "content": _text_content(i, m)}
        if m["role"] == "assistant" and m.get("tool_calls"):
            message["tool_calls"] = m["tool_calls"]
        if m["role"] == "assistant" and isinstance(m.get("reasoning_content"), str):
            message["reasoning_content"] = m["reasoning_content"]  # (templates may show it)
        if m["role"] == "tool" and m.get("tool_call_id") is not None:
            message["tool_call_id"] = str(m["tool_call_id"])
        out.append(message)
    return out


def _text_content(i: int, m: dict) -> str | None:
    """A message's content as one string (None only beside an assistant's tool calls)."""
    content = m.get("content")
    if content is None and m["role"] == "assistant" and m.get("tool_calls"):
        return None
    if isinstance(content, list):  # content parts: text only
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text":
                raise APIError(f"messages[{i}].content: only text parts are supported", "messages")
            texts.append(str(part.get("text", "")))
        content = "".join(texts)
    if not isinstance(content, str):
        raise APIError(f"messages[{i}].content must be a string, got {content!r:.100}", "messages")
    return content


def tokenize(body: dict, tokenizer, max_model_len: int, template: dict | None = None) -> dict:
    """vLLM's /tokenize answer: a prompt's ids (special tokens added unless
    add_special_tokens is false), or chat messages' through the chat template with the
    template's arguments (ecosystem.chat_template_options: ready for the reply unless
    add_generation_prompt is false, continue_final_message, chat_template_kwargs ...)."""
    if (body.get("prompt") is None) == (body.get("messages") is None):
        raise APIError("give exactly one of prompt and messages", "prompt")
    if body.get("prompt") is not None:
        ids = tokenizer.encode(
            body["prompt"], add_special_tokens=body.get("add_special_tokens") is not False
        )
    else:
        messages = check_messages(body["messages"])
        if not getattr(tokenizer, "chat_template", None):
            raise APIError("this model has no chat template; tokenize a prompt", "messages")
        ids = chat_prompt_ids(tokenizer, messages, **(template or {}))
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
