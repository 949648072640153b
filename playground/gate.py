"""How the playground puts work on the engine: under the signed-in key's tenant, and through
the server's own admission control (the Ticket the OpenAI routes hold), so the page queues no
more than the API would take: past a limit a handler raises gr.Error with the message the
API's 429 (or 400) carries, which names the flag."""

from __future__ import annotations

from collections.abc import Callable

import gradio as gr

from engine.entrypoints.async_engine import RequestStream
from engine.entrypoints.openai.admission import Ticket
from engine.entrypoints.openai.middleware import KeyRing
from engine.entrypoints.openai.server import ServerState
from engine.sampling_params import SamplingParams
from lora.adapter import LoRARequest


class Gate:
    def __init__(self, state: ServerState):
        self.state = state
        self.keys = KeyRing(state.api_keys) if state.api_keys else None

    def tenant(self, request: gr.Request | None) -> str | None:
        """The signed-in key's tenant: its own cache salt (as its API requests get: tenants
        share no KV through the playground either), and what the live views show it; None
        on a server without keys (one user: every request is theirs)."""
        if self.keys is None:
            return None
        headers = getattr(request, "headers", None) or {}
        salt = self.keys.tenant_salt(headers.get("authorization", ""), headers.get("cookie", ""))
        if salt is None:  # (APIKeyCheck lets no such request through)
            raise gr.Error("sign in with this server's API key at /login")
        return salt

    def ticket(self) -> Ticket:
        """A share of the server's admitted work: release() it when its requests end."""
        return Ticket(self.state.admission)

    def hold(self, ticket: Ticket, tokenize: Callable[[], list[int]], n: int = 1) -> list[int]:
        """The playground's one admission check, the OpenAI routes' own: a request's n
        completions held on `ticket` before its prompt is tokenized (tokenize()), then its
        prompt tokens; APIError past a limit (what the ticket took stays on it)."""
        ticket.admit(1, n)
        ids = tokenize()
        ticket.add_tokens(len(ids) * n)
        return ids

    async def add(
        self,
        request_id: str,
        ids: list[int],
        params: SamplingParams,
        lora: LoRARequest | None,
        tenant: str | None,
    ) -> RequestStream:
        """A held request (hold()) onto the engine, under its tenant's cache salt."""
        engine = self.state.engine
        return await engine.add_request(
            request_id, ids, params, lora_request=lora, cache_salt=tenant, tenant=tenant
        )
