"""`LLM`: the offline Python API (batch generate with a progress bar, streaming, chat)."""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence

from tqdm.auto import tqdm

from engine.config import EngineConfig
from engine.entrypoints.beam_search import BeamSearch, BeamSearchOutput, BeamSearchParams
from engine.entrypoints.tools import Tools, parse_tool_calls, render_messages, template_knows_tools
from engine.llm_engine import LLMEngine
from engine.outputs import RequestOutput
from engine.sampling_params import RequestOutputKind, SamplingParams
from lora.adapter import LoRARequest

Prompt = str | list[int] | dict


def _per_prompt(name: str, value, n: int) -> list:
    values = list(value) if isinstance(value, list | tuple) else [value] * n
    if len(values) != n:
        raise ValueError(f"{name} has {len(values)} entries for {n} prompts")
    return values


def chat_prompt_ids(
    tokenizer,
    messages: list[dict],
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    add_special_tokens: bool = False,
    tools: list[dict] | None = None,
    documents: list[dict] | None = None,
    template_kwargs: dict | None = None,
) -> list[int]:
    """The token ids of a conversation in the model's chat template: ready for the reply, or
    (continue_final_message) open at the end of the last message, to be continued. tools:
    the function tools the prompt shows (engine.entrypoints.tools.render_messages says how);
    documents and template_kwargs (variables the template reads, such as Qwen3's
    enable_thinking) go to the template as HF's apply_chat_template passes them."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("this model's tokenizer has no chat template; use generate()")
    knows_tools = template_knows_tools(tokenizer)
    text = tokenizer.apply_chat_template(
        render_messages(messages, tools, knows_tools),
        tools=tools if knows_tools else None,
        documents=documents,
        add_generation_prompt=add_generation_prompt,
        continue_final_message=continue_final_message,
        tokenize=False,
        **(template_kwargs or {}),
    )
    return tokenizer.encode(text, add_special_tokens=add_special_tokens)


def _prompt_input(prompt: Prompt) -> str | list[int]:
    if isinstance(prompt, dict):
        if "prompt_token_ids" in prompt:
            return list(prompt["prompt_token_ids"])
        if "prompt" in prompt:
            return prompt["prompt"]
        raise ValueError(f"prompt dict needs 'prompt' or 'prompt_token_ids', got {list(prompt)}")
    if isinstance(prompt, str) or (
        isinstance(prompt, list) and all(isinstance(t, int) for t in prompt)
    ):
        return prompt
    raise ValueError(f"prompt must be a string, a list of token ids or a dict, got {prompt!r:.80}")


class LLM:
    def __init__(self, model: str = "smollm2-135m-instruct", **engine_args):
        self.engine = LLMEngine(EngineConfig(model=model, **engine_args))
        self._ids = itertools.count()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def _normalize(self, prompts, params) -> tuple[list, list[SamplingParams]]:
        single = isinstance(prompts, str | dict) or (
            isinstance(prompts, list) and prompts and all(isinstance(t, int) for t in prompts)
        )
        prompts = [prompts] if single else list(prompts)
        if params is None:
            params = SamplingParams()
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(
                f"sampling_params has {len(params)} entries for {len(prompts)} prompts"
            )
        return [_prompt_input(p) for p in prompts], list(params)

    def _add_all(
        self, prompts: list, params: list[SamplingParams], lora_request=None, draft_lora=None
    ) -> list[str]:
        """Add every prompt, or none: a bad one aborts those already added and re-raises."""
        loras = _per_prompt("lora_request", lora_request, len(prompts))
        drafts = _per_prompt("draft_lora_request", draft_lora, len(prompts))
        ids = []
        try:
            for prompt, p, lora, draft in zip(prompts, params, loras, drafts, strict=True):
                rid = f"llm-{next(self._ids)}"
                self.engine.add_request(rid, prompt, p, lora_request=lora, draft_lora_request=draft)
                ids.append(rid)
        except Exception:
            self.engine.abort_request(ids)
            raise
        return ids

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        draft_lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """lora_request: one adapter for every prompt, or one (or None) per prompt;
        draft_lora_request: the same for the draft model (draft-model speculation only)."""
        prompts, params = self._normalize(prompts, sampling_params)
        # Only the last output of each request is kept: the engine builds no other.
        params = [p.with_output_kind(RequestOutputKind.FINAL_ONLY) for p in params]
        ids = self._add_all(prompts, params, lora_request, draft_lora_request)
        finals: dict[str, RequestOutput] = {}
        wanted = set(ids)
        bar = tqdm(total=len(ids), desc="generate", disable=not use_tqdm)
        try:
            while len(finals) < len(ids):
                for out in self.engine.step():
                    if out.finished and out.request_id in wanted:
                        finals[out.request_id] = out
                        bar.update(1)
            self._settle()
        except BaseException:
            self.engine.abort_request([i for i in ids if i not in finals])
            raise
        finally:
            bar.close()
        return [finals[i] for i in ids]

    def stream(
        self,
        prompt: Prompt,
        sampling_params: SamplingParams | None = None,
        lora_request: LoRARequest | None = None,
    ) -> Iterator[RequestOutput]:
        """Yields RequestOutputs whose completions hold only what is new since the last one."""
        prompts, params = self._normalize(prompt, sampling_params)
        params = [params[0].with_output_kind(RequestOutputKind.DELTA)]
        (rid,) = self._add_all(prompts[:1], params, lora_request)
        try:
            finished = False
            while not finished:
                for out in self.engine.step():
                    if out.request_id == rid:
                        finished = out.finished
                        yield out
        finally:
            if not finished:
                self.engine.abort_request(rid)
            self._settle()

    def _settle(self) -> None:
        """Async scheduling: with no request left, collect the step still in flight (it ran
        for requests that have ended), so the engine is idle when a call returns."""
        while not self.engine.groups and self.engine.has_unfinished_requests():
            self.engine.step()

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        tools: list[dict] | None = None,
        tool_choice: str | dict | None = None,
        parallel_tool_calls: bool | None = None,
        chat_template_kwargs: dict | None = None,
    ) -> list[RequestOutput]:
        """tools, tool_choice, parallel_tool_calls: OpenAI's (engine.entrypoints.tools); each
        completion's calls are then in its `tool_calls` (its text stays what the model wrote).
        chat_template_kwargs: variables the chat template reads (vLLM's; Qwen3's
        enable_thinking)."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        spec = Tools.parse(tools, tool_choice, parallel_tool_calls)
        shown = spec.in_prompt if spec else None
        prompts = [self.apply_chat_template(c, shown, chat_template_kwargs) for c in conversations]
        if spec is not None:
            _, params = self._normalize(prompts, sampling_params)
            sampling_params = [spec.apply(p) for p in params]
        outs = self.generate(prompts, sampling_params, use_tqdm=use_tqdm, lora_request=lora_request)
        for completion in (c for out in outs for c in out.outputs) if spec else ():
            completion.tool_calls = parse_tool_calls(completion.text)[1]
        return outs

    def beam_search(
        self, prompts: Prompt | Sequence[Prompt], params: BeamSearchParams
    ) -> list[BeamSearchOutput]:
        """Beam search (engine.entrypoints.beam_search: HF's rule; beams share KV blocks
        copy-on-write): per prompt, params.beam_width sequences, best first."""
        prompts, _ = self._normalize(prompts, None)
        ids = [self.tokenizer.encode(p) if isinstance(p, str) else p for p in prompts]
        try:  # (each prompt's first beam is checked as every request is; a refusal aborts all)
            return BeamSearch(self.engine, params).run(ids)
        finally:
            self._settle()

    def apply_chat_template(
        self,
        messages: list[dict],
        tools: list[dict] | None = None,
        chat_template_kwargs: dict | None = None,
    ) -> list[int]:
        return chat_prompt_ids(
            self.tokenizer, messages, tools=tools, template_kwargs=chat_template_kwargs
        )

    def abort(self, request_id: str | list[str]) -> None:
        self.engine.abort_request(request_id)

    def load_lora(self, lora_request: LoRARequest) -> None:
        self.engine.load_lora(lora_request)

    def unload_lora(self, name: str) -> None:
        self.engine.unload_lora(name)
