"""vLLM's adapter hot-load endpoints, POST /v1/load_lora_adapter and /v1/unload_lora_adapter:
404 unless the server has a lora_dir; adapters only from inside it, under bounded names, at
most the server's max_adapters of them; errors name paths by their place in lora_dir, not by
where it is on this machine."""

from __future__ import annotations

import re
from contextlib import suppress
from typing import TYPE_CHECKING

from fastapi import FastAPI, Request
from fastapi.responses import Response

from engine.entrypoints.openai import protocol
from engine.entrypoints.openai.protocol import APIError
from lora.adapter import LoRARequest

if TYPE_CHECKING:
    from engine.entrypoints.openai.server import ServerState

ADAPTER_NAME = re.compile(r"[A-Za-z0-9._-]{1,64}")  # a hot-loaded adapter's name


def _check_hot_loading(state: ServerState) -> None:
    if state.lora_dir is None:
        raise APIError("adapter loading is off: start the server with --lora-dir DIR", status=404)


def _name_taken(name: str) -> APIError:
    return APIError(f"the name {name!r} is taken; unload it first", "lora_name")


def _hot_adapter(state: ServerState, body: dict) -> LoRARequest:
    """The adapter a load names: lora_path (default: lora_name) inside the server's lora_dir;
    a path that leaves it (.., an absolute path elsewhere, a symlink out) is refused."""
    _check_hot_loading(state)
    name = body.get("lora_name")
    if not name:
        raise APIError("lora_name is required", "lora_name")
    if not ADAPTER_NAME.fullmatch(name):
        raise APIError(
            f"lora_name must be 1 to 64 letters, digits, '.', '_' or '-', got {name!r:.80}",
            "lora_name",
        )
    if name == state.model_name:  # (a loaded adapter's name: load() checks, on the loop)
        raise _name_taken(name)
    root = state.lora_dir.resolve()
    try:
        path = (root / (body.get("lora_path") or name)).resolve()
    except (ValueError, OSError) as exc:  # e.g. a NUL byte, a symlink loop
        raise APIError(f"lora_path is not a usable path: {exc}", "lora_path") from None
    if not path.is_relative_to(root) or path == root:
        raise APIError("lora_path must be a directory inside the server's --lora-dir", "lora_path")
    return LoRARequest(name, str(path))


def add_lora_routes(app: FastAPI, state: ServerState) -> None:
    """vLLM's adapter hot-load endpoints (404 unless the server has a lora_dir)."""

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: Request) -> Response:
        body = protocol.check_fields(await protocol.read_json(request), protocol.LOAD_LORA_FIELDS)
        adapter = _hot_adapter(state, body)

        def load() -> None:  # on the loop thread: loads and unloads of one name take turns
            if adapter.name in state.adapters:
                raise _name_taken(adapter.name)
            if len(state.adapters) >= state.max_adapters:
                most = state.max_adapters
                raise APIError(
                    f"{most} adapters are loaded, this server's most: {adapter.name!r} is not",
                    "lora_name",
                )
            try:
                state.engine.engine.load_lora(adapter)
            except ValueError as exc:  # named by its place in lora_dir, not on this machine
                message = str(exc).replace(str(state.lora_dir.resolve()), "<lora-dir>")
                raise APIError(message, "lora_path") from None
            state.adapters[adapter.name] = adapter

        await state.engine.call(load)
        return Response(f"Success: LoRA adapter '{adapter.name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: Request) -> Response:
        body = protocol.check_fields(await protocol.read_json(request), protocol.UNLOAD_LORA_FIELDS)
        name = body.get("lora_name")
        _check_hot_loading(state)

        def unload() -> None:
            if name not in state.adapters:
                raise APIError(f"no adapter named {name!r} is loaded", "lora_name", status=404)
            del state.adapters[name]  # new requests no longer find it; running ones keep it
            with suppress(ValueError):  # the registry evicted it already (max_cpu_loras)
                state.engine.engine.unload_lora(name)

        await state.engine.call(unload)
        return Response(f"Success: LoRA adapter '{name}' removed successfully.")
