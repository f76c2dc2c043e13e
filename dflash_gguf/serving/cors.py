"""CORS as llama-server has it (--cors-origins, --cors-methods, --cors-headers,
--cors-credentials), with a safe default: a server on localhost is reachable from every
web page its user opens, so by default only pages served from localhost may read its
replies (llama-server's `--cors-origins localhost`), where llama-server's own default,
`*`, lets any site read them.

A request's Origin is answered with Access-Control-Allow-Origin when it is allowed:
under 'localhost', an origin whose host is localhost, 127.0.0.1 or ::1 (any scheme and
port); under a list, an origin in it; under '*', any (echoed with credentials allowed,
as llama-server does). A preflight (OPTIONS) is answered here with an empty 200, the
methods, headers and credentials flag, and never reaches the API-key check."""
from __future__ import annotations

from typing import Optional
from urllib.parse import urlsplit

LOCALHOSTS = ("localhost", "127.0.0.1", "::1")


def is_localhost(origin: str) -> bool:
    try:
        return urlsplit(origin).hostname in LOCALHOSTS
    except ValueError:
        return False


def canonical(headers: list) -> list:
    """Header names in their usual capitals (Access-Control-Allow-Origin), as llama-server
    sends them: HTTP reads them either way, but clients that keep headers in a plain dict
    (llama.cpp's own tests) look them up by that spelling."""
    return [(b"-".join(part[:1].upper() + part[1:] for part in name.split(b"-")), value) for name, value in headers]


class Cors:
    def __init__(self, app, origins: str = "localhost", methods: str = "GET, POST, DELETE, OPTIONS",
                 headers: str = "*", credentials: bool = True):
        self.app = app
        self.origins = origins.strip()
        self.listed = {o.strip().rstrip("/") for o in self.origins.split(",") if o.strip()}
        self.methods = methods
        self.headers = headers
        self.credentials = credentials

    def allowed(self, origin: str) -> Optional[str]:
        """The Access-Control-Allow-Origin for `origin`, or None: not allowed."""
        if not origin:
            return None
        if self.origins == "*":
            return origin if self.credentials else "*"
        if self.origins == "localhost":
            return origin if is_localhost(origin) else None
        return origin if origin.rstrip("/") in self.listed else None

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        origin = dict(scope["headers"]).get(b"origin", b"").decode("latin-1")
        allow = self.allowed(origin)
        extra = [(b"access-control-allow-origin", allow.encode("latin-1"))] if allow else []
        if allow and self.origins != "*":
            extra.append((b"vary", b"Origin"))
        if scope["method"] == "OPTIONS":
            extra += [(b"access-control-allow-credentials", b"true" if self.credentials else b"false"),
                      (b"access-control-allow-methods", self.methods.encode("latin-1")),
                      (b"access-control-allow-headers", self.headers.encode("latin-1")),
                      (b"content-type", b"text/html"), (b"content-length", b"0")]
            await send({"type": "http.response.start", "status": 200, "headers": canonical(extra)})
            await send({"type": "http.response.body", "body": b""})
            return

        async def send_with(message):
            if message["type"] == "http.response.start":
                message = {**message, "headers": canonical([*message.get("headers", []), *extra])}
            await send(message)

        await self.app(scope, receive, send_with)
