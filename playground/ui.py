"""The Gradio playground, mounted on the HTTP server's app: a multi-turn chat (or completion)
panel with sampling, speculation, prediction, adapter and constraint controls; a race of the
same request with and without speculation; live views of the engine (refreshed twice a second,
so requests from HTTP clients show up too; with API keys, the signed-in key's requests alone)
and a load-test button (playground.load_test). Every request goes through the server's
admission control (playground.gate)."""

from __future__ import annotations

import asyncio
import functools
import json
import time
import uuid
from collections import namedtuple

import gradio as gr
from fastapi import FastAPI

from engine.entrypoints.llm import chat_prompt_ids
from engine.entrypoints.openai.admission import Ticket
from engine.entrypoints.openai.protocol import APIError
from engine.entrypoints.openai.server import ServerState
from engine.entrypoints.tools import Tools, parse_tool_calls
from engine.sampling_params import SamplingParams
from playground import load_test, views
from playground.gate import Gate

BASE = "(base model)"
CONSTRAINTS = ["none", "json schema", "regex", "grammar (EBNF)", "choice"]


# The generate form's fields, in the order its handler (and the `generate` API endpoint) takes
# them: the components when the page is built, their values when a request comes.
Form = namedtuple(
    "Form",
    "mode prompt temperature top_p top_k max_tokens seed method k adaptive adapter "
    "constraint_kind constraint_text tools tool_choice prediction",
)
TOOL_CHOICES = ["auto", "required", "none"]
EXAMPLE_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather forecast for a city",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string"},
                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                },
                "required": ["city", "unit"],
            },
        },
    }
]
_CONSTRAINT_KEYS = {"json schema": "json", "regex": "regex", "grammar (EBNF)": "grammar"}


def constraint_from(kind: str, text: str) -> dict | None:
    text = (text or "").strip()
    if kind == "none":
        return None
    if not text:
        raise ValueError(f"constraint: {kind} needs a value in the box")
    if kind == "choice":
        return {"choice": [line.strip() for line in text.splitlines() if line.strip()]}
    if kind not in _CONSTRAINT_KEYS:
        raise ValueError(f"constraint: unknown kind {kind!r}")
    if kind == "json schema":
        try:
            text = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"constraint: the JSON schema is not valid JSON: {exc}") from None
    return {_CONSTRAINT_KEYS[kind]: text}


def tools_from(mode: str, text: str, choice: str) -> Tools | None:
    """The tools box (OpenAI's JSON list; empty: none) and tool choice (auto, required, none, or
    a function's name) -> engine.entrypoints.tools.Tools."""
    text = (text or "").strip()
    if not text or (mode != "chat" and choice == "none"):  # completion mode ignores the box
        return None
    if mode != "chat":
        raise ValueError("tools: tool calls need chat mode")
    try:
        tools = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"tools: not valid JSON: {exc}") from None
    if choice not in TOOL_CHOICES:
        choice = {"type": "function", "function": {"name": choice}}
    return Tools.parse(tools, choice)


def spec_k(method: str, k: int, adaptive: bool) -> int | None:
    """Speculation controls -> SamplingParams.num_speculative_tokens (None: the engine plans)."""
    if method == "off":
        return 0
    return None if adaptive else int(k)


class Playground:
    def __init__(self, state: ServerState):
        self.state = state
        self.history = views.History()
        self.method = state.engine.engine.config.spec_method
        self.gate = Gate(state)

    # ---- handlers -----------------------------------------------------------------------------
    async def generate(self, request: gr.Request, *values):
        """Stream one request (values: the form's, in Form's order, then the conversation the
        page shows: chat messages; request: Gradio's, for the key it came with): yields
        (token-shaded HTML, stats line, conversation). In chat mode a finished reply joins the
        conversation, so the next prompt is its next turn; completion mode leaves it alone. The
        conversation lives in the page (the Chatbot's value), so what a request continues is
        exactly what its page showed."""
        form, conversation = Form(*values[:-1]), _messages(values[-1])
        with_tools = form.mode == "chat" and form.tool_choice != "none" and bool(form.tools)
        ticket, stream = self.gate.ticket(), None
        try:
            try:
                stream = await self._submit(form, conversation, ticket, self.gate.tenant(request))
            except (ValueError, APIError) as exc:
                raise gr.Error(str(exc)) from None
            render = _Renderer(self.state.tokenizer)
            # Every yield carries every output: Gradio's streamed diffs went wrong with gr.skip().
            shown = ("", "", conversation)
            async for out in stream.cumulative():
                shown = (render(out), _stats(out, render.seconds, with_tools), *shown[2:])
                if form.mode == "chat" and out.finished:
                    turn = [
                        {"role": "user", "content": form.prompt},
                        {"role": "assistant", "content": out.outputs[0].text},
                    ]
                    shown = (*shown[:2], conversation + turn)
                yield shown
        finally:
            if stream is not None:
                stream.close()
            ticket.release()

    async def race(self, request: gr.Request, *values):
        """The form's request twice at once, with the form's speculation (and prediction) and
        without any: yields each side's token-shaded HTML and stats as either streams. Greedy,
        both sides emit the same tokens (verification is lossless); the speculating side gets
        there in fewer steps. Chat mode continues the conversation without adding to it."""
        form, conversation = Form(*values[:-1]), _messages(values[-1])
        if form.method == "off" and not (form.prediction or "").strip():
            form = form._replace(method=self.method or "off")  # something to race with
        plain = form._replace(method="off", prediction="")
        ticket, streams, tasks = self.gate.ticket(), [], []
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(side: int, stream) -> None:
            render = _Renderer(self.state.tokenizer)
            try:
                async for out in stream.cumulative():
                    await queue.put((side, render(out), _stats(out, render.seconds)))
            finally:
                await queue.put((side, None, None))

        try:  # (a refused second side closes the first: nothing stays held)
            try:
                tenant = self.gate.tenant(request)
                for f in (form, plain):
                    streams.append(await self._submit(f, conversation, ticket, tenant))
            except (ValueError, APIError) as exc:
                raise gr.Error(str(exc)) from None
            shown = [("", ""), ("", "")]
            tasks = [asyncio.ensure_future(pump(i, st)) for i, st in enumerate(streams)]
            running = len(tasks)
            while running:
                side, html, stats = await queue.get()
                if html is None:
                    running -= 1
                    continue
                shown[side] = (html, stats)
                yield *shown[0], *shown[1]
        finally:
            for task in tasks:
                task.cancel()
            for st in streams:
                st.close()
            ticket.release()

    async def _submit(
        self, form: Form, conversation: list[dict], ticket: Ticket, tenant: str | None
    ):
        """The form's request (in chat mode, the next turn of `conversation`) held on `ticket`
        (Gate.hold: APIError past a limit) and added to the engine as the tenant's; ValueError
        for a bad field."""
        seed = None if form.seed is None or int(form.seed) < 0 else int(form.seed)
        params = SamplingParams(
            temperature=float(form.temperature),
            top_p=float(form.top_p),
            top_k=int(form.top_k),
            max_tokens=int(form.max_tokens),
            seed=seed,
            num_speculative_tokens=spec_k(form.method, form.k, form.adaptive),
            structured_outputs=constraint_from(form.constraint_kind, form.constraint_text),
            prediction=form.prediction or None,
        )
        if not (form.prompt or "").strip():
            raise ValueError("prompt is empty")
        tokenizer = self.state.tokenizer
        tools = tools_from(form.mode, form.tools, form.tool_choice)
        if tools is not None:
            params = tools.apply(params)
        if form.mode == "chat":
            messages = [*conversation, {"role": "user", "content": form.prompt}]
            shown = tools.in_prompt if tools else None
            tokenize = functools.partial(chat_prompt_ids, tokenizer, messages, tools=shown)
        else:
            tokenize = functools.partial(tokenizer.encode, form.prompt)
        lora = self.state.adapters.get(form.adapter) if form.adapter != BASE else None
        ids = self.gate.hold(ticket, tokenize, params.n)
        return await self.gate.add(f"ui-{uuid.uuid4().hex[:8]}", ids, params, lora, tenant)

    async def refresh(self, request: gr.Request):
        """The live views, as the signed-in key may see them (engine.entrypoints.tenancy)."""
        tenant = self.gate.tenant(request)
        snap = await asyncio.to_thread(self.state.engine.snapshot, tenant)
        snap["is_tenant_view"] = tenant is not None  # (blocks not listed may be others')
        views.add_text(snap, self.state.tokenizer)
        self.history.observe(snap)
        return (
            views.render_blocks(snap),
            views.render_sharing(snap, self.history),
            views.render_speculation(snap, self.history),
            views.render_adapters(snap),
        )

    async def load_test(self, request: gr.Request, num_requests):
        """N concurrent requests, as many as the server's limits take (playground.load_test;
        Gradio holds N to the slider's range, over its API too); a summary line."""
        return await load_test.run(self.gate, self.gate.tenant(request), int(num_requests))

    # ---- layout -------------------------------------------------------------------------------
    def _controls(self) -> Form:
        """The form's controls (right column), each made once; mode and prompt come first,
        from the left column, and are filled in by the caller."""
        methods = ["off"] + ([self.method] if self.method else [])
        with gr.Accordion("Sampling", open=True):
            temperature = gr.Slider(0, 2, value=0.0, step=0.05, label="temperature")
            top_p = gr.Slider(0.05, 1, value=1.0, step=0.05, label="top_p")
            top_k = gr.Slider(0, 200, value=0, step=1, label="top_k (0: off)")
            max_tokens = gr.Slider(1, 1024, value=128, step=1, label="max_tokens")
            seed = gr.Number(value=-1, precision=0, label="seed (-1: none)")
        with gr.Accordion("Speculation", open=True):
            method = gr.Dropdown(methods, value=methods[-1], label="method")
            k = gr.Slider(0, 15, value=4, step=1, label="k: drafts per step")
            adaptive = gr.Checkbox(value=True, label="adaptive k (k is the cap)")
            prediction = gr.Textbox(
                lines=3,
                label="prediction: text the answer will mostly repeat (Predicted Outputs)",
                elem_id="prediction",
            )
        adapter = gr.Dropdown([BASE, *self.state.adapters], value=BASE, label="LoRA adapter")
        with gr.Accordion("Constraint", open=False):
            kind = gr.Dropdown(CONSTRAINTS, value="none", label="kind", elem_id="constraint-kind")
            text = gr.Textbox(
                lines=4,
                label="JSON schema / regex / EBNF grammar / choices (one per line)",
                elem_id="constraint-text",
            )
        with gr.Accordion("Tools (chat)", open=False):
            tools = gr.Code(
                json.dumps(EXAMPLE_TOOLS, indent=1),
                language="json",
                label="tools: OpenAI's function tools (empty: none)",
                elem_id="tools",
            )
            tool_choice = gr.Dropdown(
                ["none", "auto", "required"],
                value="none",
                allow_custom_value=True,
                label="tool_choice (or a function's name)",
                elem_id="tool-choice",
            )
        controls = dict(temperature=temperature, top_p=top_p, top_k=top_k, max_tokens=max_tokens)
        controls |= dict(tools=tools, tool_choice=tool_choice, prediction=prediction)
        controls |= dict(seed=seed, method=method, k=k, adaptive=adaptive, adapter=adapter)
        return Form(mode=None, prompt=None, constraint_kind=kind, constraint_text=text, **controls)

    def build(self) -> gr.Blocks:
        with gr.Blocks(title="Tandem playground") as demo:
            gr.Markdown(
                f"## Tandem playground · `{self.state.model_name}` · speculation: "
                f"`{self.method or 'off'}` · OpenAI API at `/v1`"
            )
            with gr.Row():
                with gr.Column(scale=3):
                    mode = gr.Radio(["chat", "completion"], value="chat", label="mode")
                    chat = gr.Chatbot(label="conversation", height=260, elem_id="conversation")
                    prompt = gr.Textbox(
                        label="prompt",
                        lines=3,
                        elem_id="prompt",
                        value="Write a short poem about paged attention.",
                    )
                    with gr.Row():
                        go = gr.Button("Generate", variant="primary", elem_id="generate")
                        stop = gr.Button("Stop", elem_id="stop")
                        race = gr.Button("Race: with vs without speculation", elem_id="race")
                        new_chat = gr.Button("New conversation", elem_id="new-chat")
                    gr.HTML(views.legend())
                    output = gr.HTML(elem_id="output")
                    stats = gr.Markdown(elem_id="stats")
                    with gr.Row():
                        with gr.Column():
                            gr.Markdown("**with speculation**")
                            race_spec = gr.HTML(elem_id="race-spec")
                            race_spec_stats = gr.Markdown(elem_id="race-spec-stats")
                        with gr.Column():
                            gr.Markdown("**without**")
                            race_plain = gr.HTML(elem_id="race-plain")
                            race_plain_stats = gr.Markdown(elem_id="race-plain-stats")
                with gr.Column(scale=2):
                    form = self._controls()._replace(mode=mode, prompt=prompt)
                    with gr.Accordion("Load test", open=True):
                        num_requests = gr.Slider(2, 32, value=12, step=1, label="requests")
                        load = gr.Button("Run load test", elem_id="load-test")
                        load_status = gr.Markdown(elem_id="load-status")
            with gr.Tabs():
                with gr.Tab("Blocks"):
                    blocks_view = gr.HTML(elem_id="blocks-view")
                with gr.Tab("Prefix sharing"):
                    sharing_view = gr.HTML(elem_id="sharing-view")
                with gr.Tab("Speculation"):
                    spec_view = gr.HTML(elem_id="spec-view")
                with gr.Tab("Adapters"):
                    adapters_view = gr.HTML(elem_id="adapters-view")
            run = gr.on(
                [go.click, prompt.submit],
                self.generate,
                [*form, chat],
                [output, stats, chat],
                api_name="generate",
                concurrency_limit=None,
            )
            racing = race.click(
                self.race,
                [*form, chat],
                [race_spec, race_spec_stats, race_plain, race_plain_stats],
                api_name="race",
                concurrency_limit=None,
            )
            stop.click(None, cancels=[run, racing])
            new_chat.click(lambda: [], None, [chat], api_name=False)
            load.click(
                self.load_test,
                [num_requests],
                [load_status],
                api_name="load_test",
                concurrency_limit=None,
            )
            live = [blocks_view, sharing_view, spec_view, adapters_view]
            gr.Timer(0.5).tick(self.refresh, None, live, api_name="views", concurrency_limit=None)
            demo.load(self.refresh, None, live, api_name=False)
        return demo


def _messages(chat) -> list[dict]:
    """The Chatbot's value (messages whose content is a string or a list of parts) -> chat
    messages for the template."""
    messages = []
    for m in chat or []:
        content = m["content"]
        if not isinstance(content, str):
            parts = content if isinstance(content, list) else [content]
            content = "".join(p.get("text", "") if isinstance(p, dict) else str(p) for p in parts)
        messages.append({"role": m["role"], "content": content})
    return messages


class _Renderer:
    """One stream's cumulative outputs -> token-shaded HTML; `seconds` since it was made."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.pieces = views.TokenPieces(tokenizer)
        self.start = time.monotonic()
        self.seconds = 0.0

    def __call__(self, out) -> str:
        self.seconds = time.monotonic() - self.start
        c = out.outputs[0]
        rejected = [(pos, self.tokenizer.decode(ids)) for pos, ids in c.rejected_drafts]
        return views.render_tokens(self.pieces.update(c.token_ids), c.token_kinds, rejected)


def _stats(out, seconds: float, with_tools: bool = False) -> str:
    c = out.outputs[0]
    kinds = c.token_kinds
    n = len(c.token_ids)
    line = (
        f"{out.request_id}: {n} tokens in {seconds:.1f} s "
        f"({n / seconds if seconds else 0:.1f} tokens/s) · "
        f"prompt {len(out.prompt_token_ids)} tokens, {out.num_cached_tokens} from cache · "
        f"accepted drafts {kinds.count('a')}, forced {kinds.count('f')}, "
        f"bonus {kinds.count('b')}, resampled {kinds.count('r')}"
    )
    if c.finish_reason:
        line += f" · finished: {c.finish_reason}"
    if with_tools and c.finish_reason:
        calls = parse_tool_calls(c.text)[1]
        line += " · tool calls: " + (", ".join(f"{t.name}({t.arguments})" for t in calls) or "none")
    return line


def mount_playground(app: FastAPI, state: ServerState) -> FastAPI:
    demo = Playground(state).build()
    return gr.mount_gradio_app(app, demo, path="/", ssr_mode=False, footer_links=["api"])
