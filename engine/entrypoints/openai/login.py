"""/login: how a browser opens the playground on a server with an API key. A page cannot send
`Authorization` on navigation, so the form posts the key once and the answer sets it as a
cookie that APIKeyCheck reads: HttpOnly (no script reads it), SameSite=Strict (no other site's
page sends it, so no cross-site request carries the key)."""

from __future__ import annotations

import hmac
from collections.abc import Sequence
from urllib.parse import parse_qs, urlsplit

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response

from engine.entrypoints.openai.middleware import KEY_COOKIE, cookie_token

_FORM = """<!doctype html><html><head><title>Tandem: sign in</title></head><body>
<form method="post" action="/login"><p>{message}</p>
<label>API key <input type="password" name="key" autofocus></label>
<button type="submit">Sign in</button></form></body></html>"""


def add_login_routes(app: FastAPI, keys: Sequence[str]) -> None:
    encoded = [k.encode() for k in keys]

    @app.get("/login", include_in_schema=False)
    async def login_form() -> Response:
        return HTMLResponse(_FORM.format(message="This server needs its API key."))

    @app.post("/login", include_in_schema=False)
    async def login(request: Request) -> Response:
        origin = request.headers.get("origin")
        if origin and urlsplit(origin).netloc.lower() != request.headers.get("host", "").lower():
            return HTMLResponse(_FORM.format(message="Sign in from this server's own page."), 403)
        form = parse_qs((await request.body()).decode("utf-8", "replace"))
        given = (form.get("key") or [""])[0].encode()
        if not any([hmac.compare_digest(given, key) for key in encoded]):
            return HTMLResponse(_FORM.format(message="That is not this server's key."), 401)
        answer = RedirectResponse("/", status_code=303)
        token = cookie_token(given).decode()
        answer.set_cookie(KEY_COOKIE, token, httponly=True, samesite="strict", path="/")
        return answer
