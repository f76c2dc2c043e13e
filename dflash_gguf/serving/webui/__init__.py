"""The chat page dflash-server serves at / (llama-server's web UI, ours): index.html,
app.js and style.css beside this module, plain HTML, CSS and JavaScript with no build
step and nothing fetched from elsewhere. The page streams replies from
/v1/chat/completions, shows reasoning apart from the answer, stops a reply (the server
stops generating when the connection closes), keeps conversations in the browser's
localStorage, takes its settings from /props and shows what speculation did for each
reply (its final chunk's `timings` and `dflash` fields). `--no-webui` leaves it out:
then / answers 404, as llama-server's does without its UI."""
from __future__ import annotations

from pathlib import Path

from starlette.requests import Request
from starlette.responses import FileResponse, Response
from starlette.routing import Route

HERE = Path(__file__).resolve().parent

# path -> (file, media type); answered without an API key, as llama-server's UI files are
# (the page asks for the key and sends it with its API calls)
FILES = {
    "/": ("index.html", "text/html; charset=utf-8"),
    "/webui/app.js": ("app.js", "text/javascript; charset=utf-8"),
    "/webui/style.css": ("style.css", "text/css; charset=utf-8"),
}
PATHS = tuple(FILES)

# the page loads only its own files and talks only to its own server
HEADERS = {
    "Cache-Control": "no-cache",
    "X-Content-Type-Options": "nosniff",
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; frame-ancestors 'none'; base-uri 'none'; "
                               "form-action 'none'",
    "Referrer-Policy": "no-referrer",
}


def _route(path: str, name: str, media_type: str) -> Route:
    async def serve(request: Request) -> Response:
        return FileResponse(HERE / name, media_type=media_type, headers=HEADERS)
    return Route(path, serve, methods=["GET", "HEAD"], name=f"webui:{name}")


def routes() -> list:
    """The page's routes, for the application's route list."""
    return [_route(path, name, media_type) for path, (name, media_type) in FILES.items()]
