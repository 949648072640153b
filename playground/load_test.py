"""The playground's load-test button: N concurrent chat requests, half sharing a system prompt,
every third with an adapter (if any), every fourth constrained. It is a generator of requests
on purpose, so it takes what the server's admission control allows (the OpenAI routes' own
limits, through Gate.hold) at the click: as many of the N as fit are held and sent, the rest
are not, and the summary says how many went and which limit stopped the others."""

from __future__ import annotations

import asyncio
import functools
import time
import uuid
from dataclasses import dataclass

import gradio as gr

from engine.entrypoints.llm import chat_prompt_ids
from engine.entrypoints.openai.admission import Ticket
from engine.entrypoints.openai.protocol import APIError
from engine.sampling_params import SamplingParams
from lora.adapter import LoRARequest
from playground.gate import Gate

SYSTEM_PROMPT = (
    "You are Tandem's demo assistant. You answer in one or two short sentences, plainly, "
    "without lists, and you never repeat the question back."
)
QUESTIONS = [
    "What is a KV cache?",
    "Name a prime number.",
    "Why is the sky blue?",
    "What does a compiler do?",
    "Give me a colour.",
    "What is speculative decoding?",
    "Describe a cat in one sentence.",
    "What is 12 times 12?",
]
_CONSTRAINTS = {  # request index % 4 -> its constraint
    1: {
        "json": {
            "type": "object",
            "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer"}},
            "required": ["name", "age"],
        }
    },
    3: {"choice": ["yes", "no", "maybe"]},
}


@dataclass
class Job:
    """One of the load test's requests."""

    request_id: str
    messages: list[dict]
    params: SamplingParams
    lora: LoRARequest | None
    ticket: Ticket | None = None  # its share of the admitted work, once held
    ids: list[int] | None = None


def jobs(num_requests: int, adapters: list[LoRARequest]) -> list[Job]:
    """N requests: half share a system prompt, every third uses an adapter (if any), every
    fourth is constrained (JSON schema or choice)."""
    out = []
    for i in range(num_requests):
        messages = [{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}]
        if i % 2 == 0:
            messages.insert(0, {"role": "system", "content": SYSTEM_PROMPT})
        constraint = _CONSTRAINTS.get(i % 4)
        params = SamplingParams(
            temperature=0.7, seed=i, max_tokens=48, structured_outputs=constraint
        )
        lora = adapters[(i // 3) % len(adapters)] if adapters and i % 3 == 2 else None
        out.append(Job(f"load-{i}-{uuid.uuid4().hex[:6]}", messages, params, lora))
    return out


def hold_what_fits(gate: Gate, wanted: list[Job]) -> tuple[list[Job], str | None]:
    """The first jobs the server's limits take now (the click is one request of N prompts:
    --max-prompts-per-request bounds N, then each job is held as the API holds a request),
    each on its own ticket; and why the rest were refused (None: none were)."""
    admission = gate.state.admission
    refusal = None
    try:
        admission.check_num_prompts(len(wanted))
    except APIError as exc:
        refusal, wanted = str(exc), wanted[: admission.limits.max_prompts_per_request]
    tokenizer = gate.state.tokenizer
    held = []
    for job in wanted:
        ticket = gate.ticket()
        try:
            job.ids = gate.hold(ticket, functools.partial(chat_prompt_ids, tokenizer, job.messages))
        except APIError as exc:
            ticket.release()
            return held, str(exc)
        job.ticket = ticket
        held.append(job)
    return held, refusal


async def run(gate: Gate, tenant: str | None, num_requests: int) -> str:
    """The load test under the tenant's cache salt; its summary line. The first request goes
    ahead until its first token, so its prompt blocks are cached when the others arrive
    (requests admitted in the same step do not share what none of them has computed yet)."""
    held, refusal = hold_what_fits(gate, jobs(num_requests, list(gate.state.adapters.values())))
    if not held:
        raise gr.Error(f"load test: none of {num_requests} requests sent: {refusal}")
    start = time.monotonic()
    started = asyncio.Event()
    tasks = [asyncio.ensure_future(_run_one(gate, held[0], tenant, started))]
    try:
        await started.wait()
        tasks += [asyncio.ensure_future(_run_one(gate, job, tenant)) for job in held[1:]]
        results = await asyncio.gather(*tasks, return_exceptions=True)
    finally:
        for task in tasks:
            task.cancel()
        for job in held:  # (those that ran gave theirs back already)
            job.ticket.release()
    seconds = time.monotonic() - start
    # (None: a request that ended with no output at all, aborted before its first token)
    done = [r for r in results if r is not None and not isinstance(r, BaseException)]
    errors = [r for r in results if isinstance(r, BaseException)]
    tokens = sum(len(o.outputs[0].token_ids) for o in done)
    cached = sum(o.num_cached_tokens for o in done)
    summary = (
        f"load test: {len(done)}/{len(results)} requests finished in {seconds:.1f} s, "
        f"{tokens} tokens ({tokens / seconds:.1f} tokens/s), {cached} prompt tokens "
        "from the prefix cache"
    )
    if errors:
        summary += f"; {len(errors)} failed: {errors[0]!r}"
    if refusal is not None:
        summary += f"; {num_requests - len(held)} of {num_requests} not sent: {refusal}"
    return summary


async def _run_one(gate: Gate, job: Job, tenant: str | None, started=None):
    """The job's finished output; `started` (an asyncio.Event), if given, is set at its first
    output, or when it ends without one. Its ticket is given back when it ends."""
    stream = None
    try:
        stream = await gate.add(job.request_id, job.ids, job.params, job.lora, tenant)
        return await stream.last(started.set if started is not None else None)
    finally:
        if stream is not None:
            stream.close()
        job.ticket.release()
        if started is not None:
            started.set()
