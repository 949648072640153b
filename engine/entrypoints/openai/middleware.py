"""The server's ASGI middlewares: a request body size limit and the API key check, both pure
ASGI (not BaseHTTPMiddleware), so the app still sees client disconnects."""

from __future__ import annotations

import hmac

from fastapi.responses import JSONResponse

from engine.entrypoints.openai.protocol import APIError


def error_response(err: APIError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status)


class BodySizeLimit:
    """ASGI middleware: 413 for a body over max_bytes, declared or streamed. The body is read
    here (at most max_bytes are held) and replayed to the app."""

    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD"):
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            return await self._refuse(scope, receive, send)
        messages, seen = [], 0
        while True:
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request":
                break
            seen += len(message.get("body", b""))
            if seen > self.max_bytes:
                return await self._refuse(scope, receive, send)
            if not message.get("more_body", False):
                break

        async def replay():
            return messages.pop(0) if messages else await receive()

        await self.app(scope, replay, send)

    async def _refuse(self, scope, receive, send) -> None:
        err = APIError(f"request body exceeds {self.max_bytes} bytes", status=413)
        await error_response(err)(scope, receive, send)


_KEYED_PATHS = ("/v1", "/tokenize", "/detokenize")


class APIKeyCheck:
    """ASGI middleware: /v1, /tokenize and /detokenize requests need `Authorization: Bearer
    <key>` (compared in constant time). Pure ASGI, not BaseHTTPMiddleware, so the app still sees
    client disconnects."""

    def __init__(self, app, key: str):
        self.app, self.key = app, key.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith(_KEYED_PATHS):
            given = dict(scope.get("headers") or []).get(b"authorization", b"")
            token = given[7:] if given[:7].lower() == b"bearer " else b""
            if not hmac.compare_digest(token, self.key):
                err = APIError("invalid or missing API key", status=401, code="invalid_api_key")
                return await error_response(err)(scope, receive, send)
        return await self.app(scope, receive, send)
