"""What clients written for other servers send, and the one rule for it.

Request bodies of /v1/completions, /v1/chat/completions, /tokenize and /detokenize are read as
vLLM reads them:
- a field the endpoint knows is checked (its type, then its value) and honoured, or accepted
  and ignored where it changes no output here (protocol.IGNORED_FIELDS);
- a field it knows but cannot honour (REFUSED_FIELDS: it would change the output) is a 400
  naming it, unless its value is one that changes nothing (`modalities: ["text"]`);
- any other field is ignored: a warning in the server log, and its name in the response's
  X-Tandem-Ignored-Fields header.
The adapter admin routes stay strict (protocol.check_fields): a misspelt field there would
load something else.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator
from contextlib import contextmanager

import jinja2

from engine.entrypoints.openai.protocol import APIError, check_type

logger = logging.getLogger("tandem.server")

# name -> (the values that change nothing, why any other is refused).
_NO_VALUE: tuple = ()
REFUSED_FIELDS: dict[str, tuple[tuple, str]] = {
    # OpenAI's
    "audio": (_NO_VALUE, "audio output is not served (text only)"),
    "modalities": ((["text"],), 'only ["text"] is served'),
    "web_search_options": (_NO_VALUE, "web search is not served"),
    "functions": (_NO_VALUE, "the legacy functions field is not served; use tools"),
    "function_call": (_NO_VALUE, "the legacy function_call is not served; use tool_choice"),
    # vLLM's
    "chat_template": (
        _NO_VALUE,
        "a request's own chat template is not trusted (as vLLM's default); "
        "the model's is used, chat_template_kwargs reach it",
    ),
    "logits_processors": (_NO_VALUE, "no code is loaded by name"),
    "allowed_token_ids": (([],), "use logit_bias"),
    "bad_words": (([],), "use logit_bias"),
    "structural_tag": (_NO_VALUE, "use structured_outputs or tools"),
    "guided_whitespace_pattern": (_NO_VALUE, "JSON whitespace follows the grammar's rule"),
    "return_tokens_as_token_ids": ((False,), "logprobs name tokens by their text"),
    # llama.cpp's
    "samplers": (_NO_VALUE, "the sampler order is fixed (penalties, top-k, top-p, min-p)"),
    "t_max_predict_ms": ((0, -1), "generation has no time limit; use max_tokens"),
    "return_tokens": ((False,), "ask /tokenize for token ids"),
    "typical_p": ((1, 1.0), "typical sampling is not served"),
    "mirostat": ((0,), "mirostat is not served"),
    "dry_multiplier": ((0, 0.0), "DRY sampling is not served"),
    "xtc_probability": ((0, 0.0), "XTC sampling is not served"),
    "grammar": (_NO_VALUE, "use guided_grammar or structured_outputs.grammar"),
    "json_schema": (_NO_VALUE, "use response_format or guided_json"),
}
CHAT_REFUSED_FIELDS = {
    **REFUSED_FIELDS,
    "echo": ((False,), "chat does not echo; /v1/completions does"),
    "prompt_logprobs": (_NO_VALUE, "prompt logprobs come from /v1/completions"),
}
NO_REFUSED_FIELDS: dict[str, tuple[tuple, str]] = {}


def check_request(body, fields: dict, refused: dict = REFUSED_FIELDS) -> tuple[dict, list[str]]:
    """(the body's known fields, checked; the names of the fields ignored) under the module's
    rule. A refused field with a value that changes nothing is dropped silently."""
    if not isinstance(body, dict):
        raise APIError("the request body must be a JSON object")
    known, ignored = {}, []
    for name, value in body.items():
        if name in fields:
            check_type(name, value, fields[name])
            known[name] = value
        elif name in refused:
            no_ops, reason = refused[name]
            if value is not None and not any(_same(value, v) for v in no_ops):
                raise APIError(f"{name} is not supported: {reason}", name)
        else:
            ignored.append(name)
    return known, ignored


def _same(value, no_op) -> bool:
    """Equal and of the same kind (True is not 1 here)."""
    return isinstance(value, bool) == isinstance(no_op, bool) and value == no_op


MAX_SHOWN_FIELDS = 16  # names in the header and the log line; the rest are counted
_SHOWABLE = re.compile(r"[A-Za-z0-9_.\-]{1,64}")


def ignored_headers(ignored: list[str], path: str) -> dict[str, str]:
    """The response header naming the ignored fields (and the server log's warning). Names
    are the client's text: only plain ones are shown (no header or log line can be forged),
    at most MAX_SHOWN_FIELDS, so the header stays small whatever the body holds."""
    if not ignored:
        return {}
    plain = [n for n in ignored if _SHOWABLE.fullmatch(n)][:MAX_SHOWN_FIELDS]
    more = len(ignored) - len(plain)
    shown = ", ".join(plain + ([f"+{more} more"] if more else []))
    logger.warning("%s: fields ignored (not part of this API): %s", path, shown)
    return {"X-Tandem-Ignored-Fields": shown}


MAX_LOGPROBS = 20  # SamplingParams' limit


def resolve_aliases(body: dict, is_chat: bool) -> dict:
    """llama.cpp's names for OpenAI's (and vLLM's) fields: n_predict is max_tokens (-1: no
    limit, the context's end, even on completions), n_probs is logprobs (chat: logprobs with
    top_logprobs), thinking_budget_tokens is thinking_token_budget (-1: none). Given beside the
    other field, it must agree with it."""
    body = dict(body)
    n = body.get("n_predict")
    if n is not None:
        if n == 0 or n < -1:
            raise APIError(f"n_predict must be -1 (no limit) or >= 1, got {n}", "n_predict")
        given = [body.get(k) for k in ("max_tokens", "max_completion_tokens")]
        if any(g is not None and g != n for g in given):
            raise APIError("n_predict and max_tokens disagree; give one", "n_predict")
        body["max_tokens"] = None if n == -1 else n
    budget = body.get("thinking_budget_tokens")
    if budget is not None:
        if budget < -1:
            message = f"thinking_budget_tokens must be -1 (no limit) or >= 0, got {budget}"
            raise APIError(message, "thinking_budget_tokens")
        budget = None if budget == -1 else budget
        if body.get("thinking_token_budget") not in (None, budget):
            message = "thinking_budget_tokens and thinking_token_budget disagree; give one"
            raise APIError(message, "thinking_budget_tokens")
        body["thinking_token_budget"] = budget
    probs = body.get("n_probs")
    if probs:  # 0: none, as in llama.cpp
        if not 0 < probs <= MAX_LOGPROBS:
            raise APIError(f"n_probs must be in [0, {MAX_LOGPROBS}], got {probs}", "n_probs")
        field = "top_logprobs" if is_chat else "logprobs"
        if body.get(field) not in (None, probs) or (is_chat and body.get("logprobs") is False):
            raise APIError(f"n_probs and {field} disagree; give one", "n_probs")
        body[field] = probs
        if is_chat:
            body["logprobs"] = True
    return body


def truncate(ids: list[int], body: dict) -> list[int]:
    """vLLM's truncate_prompt_tokens: the prompt's last N tokens (-1 or absent: all)."""
    n = body.get("truncate_prompt_tokens")
    if n is None or n == -1:
        return ids
    if n < 1:
        raise APIError(
            f"truncate_prompt_tokens must be -1 or >= 1, got {n}", "truncate_prompt_tokens"
        )
    return ids[-n:]


# apply_chat_template's own arguments, and what the server sets: not a template variable.
_RESERVED_TEMPLATE_NAMES = frozenset(
    {
        "messages",
        "conversation",
        "tools",
        "documents",
        "chat_template",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
    }
)


def chat_template_options(body: dict) -> dict:
    """The chat template's arguments a request sets (vLLM's fields): add_generation_prompt
    (default true), continue_final_message (the last message left open; needs
    add_generation_prompt false), add_special_tokens, documents, and chat_template_kwargs
    (variables the template reads, such as Qwen3's enable_thinking), reasoning_effort's among
    them."""
    generation = body.get("add_generation_prompt") is not False
    cont = bool(body.get("continue_final_message"))
    if generation and cont:
        raise APIError(
            "continue_final_message needs add_generation_prompt=false", "continue_final_message"
        )
    kwargs = body.get("chat_template_kwargs") or {}
    taken = sorted(_RESERVED_TEMPLATE_NAMES.intersection(kwargs))
    if taken:
        raise APIError(
            f"chat_template_kwargs cannot set {taken[0]!r} (a request field or the server's)",
            "chat_template_kwargs",
        )
    kwargs = reasoning_effort_kwargs(body.get("reasoning_effort"), kwargs)
    documents = body.get("documents")
    if documents is not None and not all(isinstance(d, dict) for d in documents):
        raise APIError("documents must be an array of objects", "documents")
    return {
        "add_generation_prompt": generation,
        "continue_final_message": cont,
        "add_special_tokens": bool(body.get("add_special_tokens")),
        "documents": documents,
        "template_kwargs": kwargs,
    }


REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")  # OpenAI's


def reasoning_effort_kwargs(effort: str | None, kwargs: dict) -> dict:
    """OpenAI's reasoning_effort on chat, for templates that read it: the template variable
    `reasoning_effort` (gpt-oss's templates read it, as in vLLM), and "none" also sets
    `enable_thinking: false` (Qwen3's and others' switch). chat_template_kwargs win where
    they set the same variables; the effort sets no thinking budget (thinking_token_budget
    does)."""
    if effort is None:
        return kwargs
    if effort not in REASONING_EFFORTS:
        raise APIError(
            f"reasoning_effort must be one of {', '.join(REASONING_EFFORTS)}, got {effort!r:.50}",
            "reasoning_effort",
        )
    implied = {"reasoning_effort": effort}
    if effort == "none":
        implied["enable_thinking"] = False
    return implied | kwargs


# The tokenizer's settings /tokenizer_info answers (vLLM's answer holds the tokenizer's init
# arguments; these are the ones without a file or path in them).
_TOKENIZER_SETTINGS = (
    "bos_token",
    "eos_token",
    "pad_token",
    "unk_token",
    "sep_token",
    "cls_token",
    "mask_token",
    "add_bos_token",
    "add_eos_token",
    "clean_up_tokenization_spaces",
    "padding_side",
    "truncation_side",
    "model_input_names",
)


def tokenizer_info(tokenizer, max_model_len: int) -> dict:
    """vLLM's GET /tokenizer_info, which lm-evaluation-harness's remote tokenizer reads
    (eos_token, bos_token, pad_token, chat_template): tokenizer_class, the special tokens as
    text, the settings above, model_max_length (the server's context), the added tokens by id
    and the chat template. Never a path on this machine."""
    init = getattr(tokenizer, "init_kwargs", None) or {}
    info: dict = {"tokenizer_class": type(tokenizer).__name__}
    for name in _TOKENIZER_SETTINGS:
        value = getattr(tokenizer, name, None) if name.endswith("_token") else init.get(name)
        if value is not None:
            info[name] = _plain(value)
    info["model_max_length"] = max_model_len
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    info["added_tokens_decoder"] = {str(i): _plain(t) for i, t in added.items()}
    if getattr(tokenizer, "chat_template", None):
        info["chat_template"] = tokenizer.chat_template
    return info


def _plain(value):
    """A setting as JSON: an AddedToken as its text."""
    if hasattr(value, "content"):
        return str(value.content)
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if isinstance(value, str | int | float | bool):
        return value
    return str(value)


@contextmanager
def template_errors(options: dict) -> Iterator[None]:
    """A chat template that fails on a request's own variables (chat_template_kwargs,
    documents) fails for that request's fault: a 400 naming chat_template_kwargs."""
    try:
        yield
    except (jinja2.TemplateError, TypeError) as exc:
        if not options.get("template_kwargs") and not options.get("documents"):
            raise
        raise APIError(
            f"the chat template failed with this request's variables: {exc}",
            "chat_template_kwargs",
        ) from None
