"""What a web page may do with the server: CORS for the origins the operator lists, and, on a
server without an API key, the checks that keep other sites out (a page the operator visits
would otherwise drive the server, and with DNS rebinding read its answers):

- Host must be one of the server's own names (localhost, 127.0.0.1, ::1, the bind address,
  `--allowed-hosts`): a rebound name (evil.example resolving to 127.0.0.1) is refused;
- Origin, when sent, must be the server's own or in `--allowed-origins`;
- a request with a body must say `Content-Type: application/json`: the bodies a cross-site
  form or `fetch` may send without a preflight (text/plain, forms) are refused.

With an API key, the key is what keeps pages out (a page cannot learn it; the /login cookie is
SameSite=Strict), and only CORS applies. CORS answers as llama.cpp's server does (the request's
Origin echoed with credentials allowed; a preflight names the methods GET and POST and the
headers asked for), but only for listed origins: any other gets no CORS header, so a browser
keeps the answer from the page.
"""

from __future__ import annotations

from collections.abc import Iterable
from urllib.parse import urlsplit

from engine.entrypoints.openai.middleware import error_response, is_preflight
from engine.entrypoints.openai.protocol import APIError

LOCAL_HOSTS = ("localhost", "127.0.0.1", "::1")
_ANY_ADDRESS = ("0.0.0.0", "::", "")
_JSON_TYPES = (b"application/json",)


def host_name(host: str) -> str:
    """A Host header's name without its port, lowercased ("[::1]:8000" -> "::1")."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1 : host.find("]")] if "]" in host else host
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


def server_hosts(bind_host: str | None, allowed_hosts: Iterable[str]) -> frozenset[str]:
    """The names a key-less server answers to: its loopback names, the address it is bound to
    (not a wildcard: that is every address, named by --allowed-hosts) and the listed ones."""
    names = set(LOCAL_HOSTS) | {host_name(h) for h in allowed_hosts}
    if bind_host is not None and bind_host not in _ANY_ADDRESS:
        names.add(host_name(bind_host))
    return frozenset(names)


class BrowserGuard:
    """ASGI middleware: CORS for `allowed_origins`; without an API key (`check_requests`),
    Host, Origin and Content-Type checks as the module says. `allowed_hosts` may hold "*"
    (any Host), `allowed_origins` "*" (any Origin)."""

    def __init__(self, app, hosts: frozenset[str], origins: Iterable[str], check_requests: bool):
        self.app, self.hosts, self.check_requests = app, hosts, check_requests
        self.origins = frozenset(o.rstrip("/").lower() for o in origins)

    async def __call__(self, scope, receive, send):
        if scope["type"] not in ("http", "websocket"):
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        host = headers.get(b"host", b"").decode("latin-1")
        origin = headers.get(b"origin", b"").decode("latin-1")
        listed = bool(origin) and ("*" in self.origins or origin.lower() in self.origins)
        allowed = listed or not origin or _same_origin(origin, host)
        if scope["type"] == "http" and is_preflight(scope):
            return await self._preflight(scope, receive, send, origin, listed)
        refusal = self._refusal(scope, headers, host, origin, allowed)
        if refusal is not None:
            if scope["type"] == "websocket":
                return await send({"type": "websocket.close", "code": 1008})
            return await error_response(refusal)(scope, receive, send)
        if not listed:
            return await self.app(scope, receive, send)

        async def send_with_cors(message):
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), *_cors(origin)]
            await send(message)

        return await self.app(scope, receive, send_with_cors)

    def _refusal(self, scope, headers, host: str, origin: str, allowed: bool) -> APIError | None:
        if not self.check_requests:
            return None
        name = host_name(host)
        if "*" not in self.hosts and name not in self.hosts:
            return APIError(
                f"Host {host!r} is not a name of this server (it answers to "
                f"{', '.join(sorted(self.hosts))}; add a name with --allowed-hosts)",
                "Host",
                status=403,
                code="host_not_allowed",
            )
        if not allowed:
            return APIError(
                f"Origin {origin!r} is not allowed (start the server with --allowed-origins "
                f"{origin} to let its pages call it)",
                "Origin",
                status=403,
                code="origin_not_allowed",
            )
        if scope["type"] == "http" and _has_body(scope, headers):
            media = headers.get(b"content-type", b"").split(b";")[0].strip().lower()
            if media not in _JSON_TYPES:
                shown = media.decode("latin-1") or "none"
                return APIError(
                    f"Content-Type must be application/json, got {shown} (a server without an "
                    "API key takes only JSON bodies)",
                    "Content-Type",
                    status=415,
                    code="unsupported_media_type",
                )
        return None

    async def _preflight(self, scope, receive, send, origin: str, listed: bool) -> None:
        if not listed:
            err = APIError(
                f"Origin {origin!r} is not allowed (--allowed-origins lists the sites whose "
                "pages may call this server)",
                "Origin",
                status=403,
                code="origin_not_allowed",
            )
            return await error_response(err)(scope, receive, send)
        asked = dict(scope["headers"]).get(b"access-control-request-headers", b"")
        headers = [
            *_cors(origin),
            (b"access-control-allow-methods", b"GET, POST"),
            (b"access-control-allow-headers", asked or b"Authorization, Content-Type"),
            (b"access-control-max-age", b"600"),
            (b"content-length", b"0"),
        ]
        await send({"type": "http.response.start", "status": 204, "headers": headers})
        await send({"type": "http.response.body", "body": b""})


def _cors(origin: str) -> list[tuple[bytes, bytes]]:
    return [
        (b"access-control-allow-origin", origin.encode("latin-1")),
        (b"access-control-allow-credentials", b"true"),
        (b"vary", b"Origin"),
    ]


def _same_origin(origin: str, host: str) -> bool:
    """The page is the server's own (the playground): Origin's host and port are the Host's."""
    parts = urlsplit(origin)
    return parts.scheme in ("http", "https") and parts.netloc.lower() == host.strip().lower()


def _has_body(scope, headers) -> bool:
    if scope["method"] in ("GET", "HEAD", "OPTIONS"):
        return False
    length = headers.get(b"content-length")
    return length is None or length.strip() != b"0"
