"""The server's ASGI middlewares: a request body size limit and the API key check, both pure
ASGI (not BaseHTTPMiddleware), so the app still sees client disconnects."""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Sequence

from fastapi.responses import JSONResponse

from engine.entrypoints.openai.protocol import APIError


def error_response(err: APIError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


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
            return await self._refuse(scope, receive, send, int(declared))
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

    async def _refuse(self, scope, receive, send, size: int | None = None) -> None:
        """413; `size`: the declared length (a streamed body is refused once past the limit)."""
        given = f"is {size} bytes" if size is not None else f"runs over {self.max_bytes} bytes"
        message = f"the request body {given}; at most {self.max_bytes} (--max-body-bytes)"
        await error_response(APIError(message, status=413))(scope, receive, send)


OPEN_PATHS = frozenset({"/health", "/login"})  # the only routes that answer without a key
KEY_COOKIE = "tandem_api_key"  # set by /login for browsers (HttpOnly, SameSite=Strict)


def tenant_salt(key: bytes) -> str:
    """The default cache salt of one API key's requests: a digest of the key, so no other
    tenant can name it, of a fixed length, so no salt of another shape can pass for it."""
    return "key-" + hashlib.sha256(b"tandem-tenant\x00" + key).hexdigest()[:32]


def cookie_token(key: bytes) -> bytes:
    """What the /login cookie holds for a key: a digest (cookie-safe text, and no bearer key
    for whoever reads the cookie)."""
    return hashlib.sha256(b"tandem-cookie\x00" + key).hexdigest().encode()


def presented(authorization: bytes, cookies: bytes) -> tuple[bytes, bytes]:
    """(the bearer token of `Authorization: Bearer <key>`, the /login cookie) from those two
    headers' values; b"" where absent."""
    bearer = authorization[7:] if authorization[:7].lower() == b"bearer " else b""
    for part in cookies.split(b";"):
        name, _, value = part.strip().partition(b"=")
        if name == KEY_COOKIE.encode():
            return bearer, value
    return bearer, b""


class KeyRing:
    """A server's API keys: which one a request presents (a bearer token or the /login
    cookie), each compared in constant time, and all of them always."""

    def __init__(self, keys: Sequence[str]):
        self.keys = [k.encode() for k in keys]
        self.tokens = [cookie_token(k) for k in self.keys]

    def match(self, authorization: bytes | str, cookies: bytes | str) -> bytes | None:
        """The key the headers present (their raw values), or None."""
        as_bytes = [
            v.encode("latin-1", "replace") if isinstance(v, str) else v
            for v in (authorization, cookies)
        ]
        bearer, cookie = presented(*as_bytes)
        matched = [
            hmac.compare_digest(bearer, key) | hmac.compare_digest(cookie, token)
            for key, token in zip(self.keys, self.tokens, strict=True)
        ]
        return self.keys[matched.index(True)] if any(matched) else None

    def tenant_salt(self, authorization: bytes | str, cookies: bytes | str) -> str | None:
        """The default cache salt of the key the headers present (None: no key matches)."""
        key = self.match(authorization, cookies)
        return None if key is None else tenant_salt(key)


class APIKeyCheck:
    """ASGI middleware: every route but /health and /login (the API, /metrics, /v1/snapshot,
    /openapi.json, the playground and its Gradio API) needs one of the keys (KeyRing).
    The matched key's tenant salt goes into the request's state (`tenant_salt`)."""

    def __init__(self, app, keys: Sequence[str]):
        self.app, self.ring = app, KeyRing(keys)

    async def __call__(self, scope, receive, send):
        if scope["type"] not in ("http", "websocket") or scope["path"] in OPEN_PATHS:
            return await self.app(scope, receive, send)
        if scope["type"] == "http" and is_preflight(scope):  # browsers send no key on these
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        key = self.ring.match(headers.get(b"authorization", b""), headers.get(b"cookie", b""))
        if key is None:
            if scope["type"] == "websocket":
                return await send({"type": "websocket.close", "code": 1008})
            err = APIError(
                "invalid or missing API key (browsers: sign in at /login)",
                status=401,
                code="invalid_api_key",
            )
            return await error_response(err)(scope, receive, send)
        scope.setdefault("state", {})["tenant_salt"] = tenant_salt(key)
        return await self.app(scope, receive, send)


def is_preflight(scope) -> bool:
    """A CORS preflight: OPTIONS with Origin and Access-Control-Request-Method."""
    headers = dict(scope.get("headers") or [])
    return (
        scope["method"] == "OPTIONS"
        and b"origin" in headers
        and b"access-control-request-method" in headers
    )
