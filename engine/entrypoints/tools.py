"""Tool calling in the Hermes format Qwen2.5 is trained on (OpenAI's request and response shapes).

A call is written as

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

`Tools.parse` checks a request's `tools`, `tool_choice` and `parallel_tool_calls`;
`Tools.constraint` turns them into an xgrammar structural tag: `required` and a named function
force each call's opening text and constrain its arguments to the function's JSON schema; `auto`
leaves the text free until the model writes `<tool_call>`, then constrains the rest of the call
the same way; `none` adds nothing (and the tools are left out of the prompt). The forced text
rides as free drafts like every grammar-forced token.

`render_messages` prepares a conversation with tool calls and tool results for a chat template:
templates that know tools (Qwen2.5's) get them as they are; templates that do not (SmolLM2's)
get the same Hermes instructions in the system message, calls as text in the assistant's
message and results as user messages in `<tool_response>` tags.

`ToolCallParser` reads a completion's text as it grows: content up to the first `<tool_call>`,
then each call's name as soon as it is complete and its arguments piece by piece.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field, replace

from engine.errors import ParamError
from engine.grammar.compiler import check_schema
from engine.grammar.constraint import StructuredOutputs
from engine.sampling_params import SamplingParams

MAX_TOOLS = 128  # OpenAI's limit
NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for function names
CHOICES = ("none", "auto", "required")
OPEN, CLOSE = "<tool_call>", "</tool_call>"
# A call's opening up to where its arguments start; the name is a JSON string.
_HEADER = re.compile(
    r'<tool_call>\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*'
)
_EMPTY_PARAMETERS = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # the arguments object's JSON text, as the model wrote it


def _tool_error(i: int, why: str) -> ParamError:
    return ParamError("tools", f"tools[{i}]: {why}")


def _check_tool(i: int, tool) -> dict:
    """One function tool in OpenAI's shape; returns its `function` object."""
    if not isinstance(tool, dict) or tool.get("type") != "function":
        raise _tool_error(i, f'must be {{"type": "function", "function": ...}}, got {tool!r:.80}')
    fn = tool.get("function")
    if not isinstance(fn, dict):
        raise _tool_error(i, f"function must be an object, got {fn!r:.80}")
    name = fn.get("name")
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise _tool_error(i, f"function.name must match [A-Za-z0-9_-]{{1,64}}, got {name!r:.80}")
    if not isinstance(fn.get("description", ""), str):
        raise _tool_error(i, "function.description must be a string")
    parameters = fn.get("parameters", _EMPTY_PARAMETERS)
    if not isinstance(parameters, dict):
        raise _tool_error(
            i, f"function.parameters must be a JSON schema object, got {parameters!r:.80}"
        )
    try:
        check_schema(parameters)
    except ValueError as e:
        raise _tool_error(i, f"function.parameters: {e}") from None
    return fn


@dataclass(frozen=True)
class Tools:
    """A request's function tools (OpenAI's shape), its tool_choice and parallel_tool_calls."""

    tools: tuple[dict, ...]
    choice: str | dict = "auto"  # "none" | "auto" | "required" | {"type": "function", ...}
    parallel: bool = True

    @classmethod
    def parse(cls, tools=None, tool_choice=None, parallel_tool_calls=None) -> Tools | None:
        """None when the request has no tools (tool_choice then may only be none or auto)."""
        if parallel_tool_calls is not None and not isinstance(parallel_tool_calls, bool):
            raise ParamError(
                "parallel_tool_calls",
                f"parallel_tool_calls must be a bool, got {parallel_tool_calls!r}",
            )
        if tools is None:
            if tool_choice not in (None, "none", "auto"):
                raise ParamError("tool_choice", f"tool_choice {tool_choice!r:.80} needs tools")
            return None
        if not isinstance(tools, list | tuple) or not 1 <= len(tools) <= MAX_TOOLS:
            raise ParamError(
                "tools",
                f"tools must be a list of 1 to {MAX_TOOLS} function tools, got "
                + (f"{len(tools)}" if isinstance(tools, list | tuple) else f"{tools!r:.80}"),
            )
        names = tuple(_check_tool(i, t)["name"] for i, t in enumerate(tools))
        if len(set(names)) < len(names):
            raise ParamError("tools", f"tools has functions of the same name: {list(names)}")
        choice = "auto" if tool_choice is None else tool_choice
        if isinstance(choice, dict):
            fn = choice.get("function")
            name = fn.get("name") if isinstance(fn, dict) else None
            if choice.get("type") != "function" or name not in names:
                raise ParamError(
                    "tool_choice",
                    f"tool_choice must name one of the tools {list(names)}, got {choice!r:.120}",
                )
            choice = {"type": "function", "function": {"name": name}}
        elif choice not in CHOICES:
            raise ParamError(
                "tool_choice",
                f"tool_choice must be one of {list(CHOICES)} or a named function, "
                f"got {choice!r:.80}",
            )
        return cls(tuple(tools), choice, parallel_tool_calls is not False)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(t["function"]["name"] for t in self.tools)

    @property
    def in_prompt(self) -> list[dict] | None:
        """The tools the prompt shows: none when the model may not call any."""
        return None if self.choice == "none" else list(self.tools)

    def constraint(self) -> StructuredOutputs | None:
        """The structural tag the output must follow (None for tool_choice none): `auto` is
        free text in which each `<tool_call>` starts a constrained call; `required` is calls
        only, one per line, at least one; a named function is exactly one call of it. Without
        parallel_tool_calls, at most one call."""
        if self.choice == "none":
            return None
        tags = {name: _call_tag(tool) for name, tool in zip(self.names, self.tools, strict=True)}
        if isinstance(self.choice, dict):
            fmt = tags[self.choice["function"]["name"]]
        elif self.choice == "required":
            fmt = {"type": "tags_with_separator", "tags": list(tags.values()), "separator": "\n"}
            fmt |= {"at_least_one": True, "stop_after_first": not self.parallel}
        else:
            fmt = {"type": "triggered_tags", "triggers": [OPEN], "tags": list(tags.values())}
            fmt |= {"at_least_one": False, "stop_after_first": not self.parallel}
        return StructuredOutputs(structural_tag={"type": "structural_tag", "format": fmt})

    def apply(self, params: SamplingParams) -> SamplingParams:
        """params with the calls' constraint (a request constrains its output one way only)."""
        constraint = self.constraint()
        if constraint is None:
            return params
        if params.structured_outputs is not None:
            raise ParamError(
                "tool_choice",
                f"tool_choice {self.choice!r} constrains the output; it cannot be combined with "
                "structured outputs (use tool_choice 'none', or drop the response format)",
            )
        return replace(params, structured_outputs=constraint)


def _call_tag(tool: dict) -> dict:
    """xgrammar's tag for one call of a function: the opening text up to the arguments, which
    follow the function's schema (in compact JSON: engine.grammar.compiler.compiled_tag), then
    the closing text."""
    fn = tool["function"]
    schema = fn.get("parameters", _EMPTY_PARAMETERS)
    return {
        "type": "tag",
        "begin": f'{OPEN}\n{{"name": "{fn["name"]}", "arguments": ',
        "content": {"type": "json_schema", "json_schema": schema},
        "end": f"}}\n{CLOSE}",
    }


# The instructions a template without tool support gets in its system message (the same
# format Qwen2.5's template describes).
_SYSTEM_TOOLS = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
    "{tools}\n</tools>\n\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>'
)


def template_knows_tools(tokenizer) -> bool:
    """Whether the chat template renders `tools` and tool messages itself."""
    return "tools" in (getattr(tokenizer, "chat_template", None) or "")


def _call_text(call: dict) -> str:
    fn = call["function"]
    body = json.dumps({"name": fn["name"], "arguments": fn["arguments"]}, ensure_ascii=False)
    return f"{OPEN}\n{body}\n{CLOSE}"


def _parsed_calls(i: int, calls) -> list[dict]:
    """An assistant message's tool_calls with each call's arguments as an object (templates
    write `arguments | tojson`; OpenAI clients send them as JSON text)."""
    if not isinstance(calls, list):
        raise ParamError("messages", f"messages[{i}].tool_calls must be a list")
    out = []
    for j, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ParamError("messages", f"messages[{i}].tool_calls[{j}] needs function.name")
        args = fn.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args or "{}")
            except json.JSONDecodeError:
                raise ParamError(
                    "messages", f"messages[{i}].tool_calls[{j}].function.arguments is not JSON"
                ) from None
        out.append({**call, "function": {**fn, "arguments": args}})
    return out


def render_messages(
    messages: list[dict], tools: list[dict] | None, knows_tools: bool
) -> list[dict]:
    """The conversation as the chat template takes it (see the module docstring)."""
    out = []
    for i, m in enumerate(messages):
        m = dict(m)
        if m.get("tool_calls"):
            m["tool_calls"] = _parsed_calls(i, m["tool_calls"])
        out.append(m)
    if knows_tools:
        return out
    plain, after_tool = [], False
    for m in out:
        if m.get("tool_calls"):
            calls = "\n".join(_call_text(c) for c in m["tool_calls"])
            text = f"{m['content']}\n{calls}" if m.get("content") else calls
            plain.append({"role": "assistant", "content": text})
        elif m["role"] == "tool":
            text = f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"
            if after_tool:  # one user message for adjacent results
                plain[-1]["content"] += "\n" + text
            else:
                plain.append({"role": "user", "content": text})
        else:
            plain.append(m)
        after_tool = m["role"] == "tool"
    if tools:
        listing = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
        instructions = _SYSTEM_TOOLS.format(tools=listing)
        if plain and plain[0]["role"] == "system":
            plain[0] = {"role": "system", "content": f"{plain[0]['content']}\n\n{instructions}"}
        else:
            plain.insert(0, {"role": "system", "content": instructions})
    return plain


def _json_end(text: str, start: int) -> int | None:
    """Where the JSON object or array starting at text[start] ends (one past its closing
    bracket), or None while it is still open. Tracks strings and escapes, not validity."""
    depth, in_string, escaped = 0, False, False
    for i in range(start, len(text)):
        ch = text[i]
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
    return None


@dataclass
class _Call:
    id: str
    name: str
    args_start: int  # where its arguments start in the text
    args_end: int | None = None  # one past them, once they are complete
    num_args_sent: int = 0


@dataclass
class ToolDelta:
    content: str = ""  # content text new since the last feed
    calls: list[dict] = field(default_factory=list)  # OpenAI's streamed tool_calls entries


class ToolCallParser:
    """Splits a completion's text into content and tool calls; `feed` takes the whole text so
    far and returns what is new, in OpenAI's streaming shape (a call's id and name first,
    then its arguments in fragments); `tool_calls` and `content` are the whole answer."""

    def __init__(self) -> None:
        self.text = ""
        self.calls: list[_Call] = []
        self.num_content_sent = 0

    def content_end(self) -> int:
        """How much of the text is content: up to the first call, less trailing whitespace and
        a partial `<tool_call>` (held back until the next text decides)."""
        text, start = self.text, self.text.find(OPEN)
        if start < 0:
            start = len(text)
            for n in range(min(len(OPEN) - 1, len(text)), 0, -1):
                if OPEN.startswith(text[-n:]):
                    start -= n
                    break
        return len(text[:start].rstrip())

    def feed(self, text: str) -> ToolDelta:
        self.text = text
        delta = ToolDelta()
        end = self.content_end()
        if end > self.num_content_sent:
            delta.content = text[self.num_content_sent : end]
            self.num_content_sent = end
        self._read_calls(delta)
        return delta

    def _read_calls(self, delta: ToolDelta) -> None:
        """Open calls whose name is complete, and send what their arguments gained."""
        text = self.text
        while True:
            if not self.calls or self.calls[-1].args_end is not None:
                call = self._open_call(self.calls[-1].args_end if self.calls else 0)
                if call is None:
                    return
                delta.calls.append(
                    {
                        "index": len(self.calls),
                        "id": call.id,
                        "type": "function",
                        "function": {"name": call.name, "arguments": ""},
                    }
                )
                self.calls.append(call)
            call = self.calls[-1]
            call.args_end = _json_end(text, call.args_start)
            args = text[call.args_start : call.args_end]
            if len(args) > call.num_args_sent:
                fragment = args[call.num_args_sent :]
                delta.calls.append(
                    {"index": len(self.calls) - 1, "function": {"arguments": fragment}}
                )
                call.num_args_sent = len(args)
            if call.args_end is None:
                return

    def _open_call(self, pos: int) -> _Call | None:
        """The next call after pos once its name and the first character of its arguments
        are there; None before that, or if its arguments are not an object (then the text
        stays as the model wrote it)."""
        match = _HEADER.search(self.text, pos)
        if match is None:
            return None
        rest = self.text[match.end() :]
        start = match.end() + len(rest) - len(rest.lstrip())
        if start == len(self.text) or self.text[start] not in "{[":
            return None
        try:
            name = json.loads(f'"{match.group(1)}"')
        except json.JSONDecodeError:  # not a JSON string: not a call (constrained text never)
            return None
        return _Call(f"call_{uuid.uuid4().hex[:24]}", name, start)

    @property
    def tool_calls(self) -> list[ToolCall]:
        text = self.text
        return [ToolCall(c.id, c.name, text[c.args_start : c.args_end]) for c in self.calls]

    @property
    def content(self) -> str | None:
        """The text before the first call (all of it when no call was read); None if empty."""
        text = self.text[: self.content_end()] if self.calls else self.text
        return text or None

    def finish(self) -> ToolDelta:
        """What is left to stream once the text is complete: with no call read, the text that
        was held back as a possible call is content after all."""
        delta = ToolDelta()
        if not self.calls and len(self.text) > self.num_content_sent:
            delta.content = self.text[self.num_content_sent :]
            self.num_content_sent = len(self.text)
        return delta


def parse_tool_calls(text: str) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) of a finished completion's text."""
    parser = ToolCallParser()
    parser.feed(text)
    return parser.content, parser.tool_calls
