"""dflash-server's HTTP application (Starlette): its routes, the API-key check and the
error handlers, over a server.Server kept in the application's state. Generating
endpoints read the body, prepare the prompt off the event loop, queue a job and answer
through serving/replies.py."""
from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import time
import uuid

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from ..speculation.suffix import corpus_key
from . import anthropic_api, replies, webui
from .anthropic_models import MessagesRequest
from .api_errors import BadRequest, validated
from .openai_models import ChatRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from .replies import SSE_HEADERS, Reply, error
from .scheduler import QueueFull, ShuttingDown

RETRY_AFTER_SECONDS = 1
MAX_BODY_BYTES = 64 << 20  # far above any prompt a context holds
PUBLIC_PATHS = ("/health",) + webui.PATHS  # answered without an API key


def _server(request: Request):
    return request.app.state.server


def _is_anthropic(path: str) -> bool:
    return path.startswith("/v1/messages")


async def read_body(request: Request) -> dict:
    """The request's JSON object, read up to MAX_BODY_BYTES and parsed off the event loop."""
    parts, size = [], 0
    async for part in request.stream():
        size += len(part)
        if size > MAX_BODY_BYTES:
            raise BadRequest(f"the request body exceeds {MAX_BODY_BYTES >> 20} MiB", status=413)
        parts.append(part)
    raw = b"".join(parts)
    try:
        body = await run_in_threadpool(json.loads, raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise BadRequest(f"the request body is not valid JSON: {e}") from None
    except RecursionError:
        raise BadRequest("the request body is nested too deeply") from None
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    return body


def _busy(message: str, kind: str, anthropic: bool) -> JSONResponse:
    return error(503, message, kind, headers={"Retry-After": str(RETRY_AFTER_SECONDS)}, anthropic=anthropic)


def _prepare(server, kind: str, body: dict):
    """The body checked as its API's request (off the event loop: a schema compiles) and
    its prompt made ready."""
    if kind == "completion":
        return server.completion_prompt(validated(CompletionRequest, body))
    if kind == "messages":
        return server.chat_prompt(anthropic_api.to_openai(validated(MessagesRequest, body)))
    return server.chat_prompt(validated(ChatRequest, body))


async def _generate(request: Request, kind: str) -> Response:
    """kind: "completion", "chat" (OpenAI) or "messages" (Anthropic)."""
    server = _server(request)
    anthropic = kind == "messages"
    try:
        body = await read_body(request)
        prepared = await run_in_threadpool(_prepare, server, kind, body)
        stream, include_usage = prepared.request.stream, prepared.request.include_usage
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()

        def sink(kind: str, value) -> None:  # called on the engine's thread
            try:
                loop.call_soon_threadsafe(events.put_nowait, (kind, value))
            except RuntimeError:  # the event loop is gone: nobody is listening any more
                job.cancel()

        job = server.make_job(prepared, sink, _corpus(request))
    except BadRequest as e:
        return error(e.status, str(e), param=e.param, anthropic=anthropic)
    try:
        server.scheduler.submit(job)
    except QueueFull as e:
        return _busy(f"the server is busy: {e}; retry later", "server_busy", anthropic)
    except ShuttingDown as e:
        return _busy(str(e), "server_shutting_down", anthropic)
    if anthropic:
        r = Reply(server, request, job, events, prepared, anthropic_api.new_id())
        if stream:
            return StreamingResponse(replies.messages_stream(r), media_type="text/event-stream", headers=SSE_HEADERS)
        return await replies.messages_reply(r)
    rid = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24]
    r = Reply(server, request, job, events, prepared, rid, int(time.time()))
    if stream:
        sse = replies.chat_stream(r, include_usage) if kind == "chat" else replies.completion_stream(r, include_usage)
        return StreamingResponse(sse, media_type="text/event-stream", headers=SSE_HEADERS)
    return await (replies.chat_reply if kind == "chat" else replies.completion_reply)(r)


async def chat_completions(request: Request) -> Response:
    return await _generate(request, "chat")


async def completions(request: Request) -> Response:
    return await _generate(request, "completion")


async def messages(request: Request) -> Response:
    return await _generate(request, "messages")


async def count_tokens(request: Request) -> Response:
    server = _server(request)
    try:
        body = await read_body(request)
        prepared = await run_in_threadpool(_prepare, server, "messages", {"max_tokens": 1, **body})
    except BadRequest as e:
        return error(e.status, str(e), param=e.param, anthropic=True)
    return JSONResponse({"input_tokens": len(prepared.tokens)})


def _tokenizer_route(name: str, model):
    async def route(request: Request) -> Response:
        try:
            body = validated(model, await read_body(request))
            return JSONResponse(await run_in_threadpool(getattr(_server(request), name), body))
        except BadRequest as e:
            return error(e.status, str(e), param=e.param)
    return route


async def models(request: Request) -> Response:
    # the OpenAI shape, with the Anthropic one's fields and the context length beside
    server = _server(request)
    n_ctx = server.engine.target.n_ctx
    info = server.engine.target.info()
    created = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(server.started))
    model = {"id": server.model_id, "object": "model", "created": server.started, "owned_by": "dflash-gguf",
             "type": "model", "display_name": server.model_id, "created_at": created, "max_model_len": n_ctx,
             "meta": {"n_ctx": n_ctx, "n_ctx_train": info["n_ctx_train"], "n_vocab": info["n_vocab"]}}
    return JSONResponse({"object": "list", "data": [model], "has_more": False, "first_id": server.model_id,
                         "last_id": server.model_id})


async def props(request: Request) -> Response:
    return JSONResponse(_server(request).props())


async def health(request: Request) -> Response:
    server = _server(request)
    if server.shutting_down:
        return JSONResponse({"status": "shutting down"}, status_code=503)
    return JSONResponse({"status": "ok", "queue_depth": server.scheduler.queue_depth,
                         "running": server.scheduler.running})


async def metrics(request: Request) -> Response:
    return PlainTextResponse(_server(request).metrics(), media_type="text/plain; version=0.0.4")


async def _http_error(request: Request, exc: HTTPException) -> Response:
    return error(exc.status_code, exc.detail or "error", "not_found" if exc.status_code == 404 else
                 "invalid_request_error", headers=getattr(exc, "headers", None),
                 anthropic=_is_anthropic(request.url.path))


async def _internal_error(request: Request, exc: Exception) -> Response:
    return error(500, f"internal error ({type(exc).__name__})", "server_error",
                 anthropic=_is_anthropic(request.url.path))


def given_key(headers: dict) -> str:
    """The API key a request presents (raw ASGI headers: bytes to bytes; "" when none)."""
    auth = headers.get(b"authorization", b"").decode("latin-1")
    return auth[7:].strip() if auth[:7].lower() == "bearer " else headers.get(b"x-api-key", b"").decode("latin-1")


def _corpus(request: Request):
    """The request's suffix corpus key: under --api-key a digest of its key, so that each
    key drafts only from its own earlier requests (docs/serving.md); without, None (one
    corpus shared by every request)."""
    if not _server(request).api_keys:
        return None
    return corpus_key(given_key(dict(request.scope["headers"])))


class RequireApiKey:
    """--api-key: requests other than PUBLIC_PATHS and CORS preflights carry one of the
    keys, as "Authorization: Bearer KEY" (OpenAI clients) or "x-api-key: KEY" (Anthropic
    clients); others get 401."""

    def __init__(self, app, keys):
        self.app = app
        self.keys = [k.encode("latin-1") for k in keys]

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["method"] != "OPTIONS" and scope["path"] not in PUBLIC_PATHS:
            given = given_key(dict(scope["headers"]))
            if not any(hmac.compare_digest(given.encode("latin-1"), key) for key in self.keys):
                reply = error(401, "invalid or missing API key (give 'Authorization: Bearer KEY' or "
                                   "'x-api-key: KEY')", "authentication_error", anthropic=_is_anthropic(scope["path"]))
                await reply(scope, receive, send)
                return
        await self.app(scope, receive, send)


@contextlib.asynccontextmanager
async def _lifespan(app):
    yield
    server = app.state.server
    server.shutting_down = True
    await asyncio.get_running_loop().run_in_executor(None, server.scheduler.close)


ROUTES = [
    Route("/v1/chat/completions", chat_completions, methods=["POST"]),
    Route("/v1/completions", completions, methods=["POST"]),
    Route("/v1/messages", messages, methods=["POST"]),
    Route("/v1/messages/count_tokens", count_tokens, methods=["POST"]),
    Route("/v1/models", models, methods=["GET"]),
    Route("/tokenize", _tokenizer_route("tokenize", TokenizeRequest), methods=["POST"]),
    Route("/detokenize", _tokenizer_route("detokenize", DetokenizeRequest), methods=["POST"]),
    Route("/props", props, methods=["GET"]),
    Route("/health", health, methods=["GET"]),
    Route("/metrics", metrics, methods=["GET"]),
]


def create_app(server) -> Starlette:
    """The Starlette application serving `server` (a server.Server)."""
    # browser clients (a web UI on another origin) may call the API: CORS outermost, so
    # preflights and refusals carry its headers too
    middleware = [Middleware(CORSMiddleware, allow_origins=["*"], allow_methods=["*"], allow_headers=["*"])]
    if server.api_keys:
        middleware.append(Middleware(RequireApiKey, keys=server.api_keys))
    routes = ROUTES + (webui.routes() if server.webui else [])  # the chat page at / (--no-webui: none)
    app = Starlette(routes=routes, lifespan=_lifespan, middleware=middleware,
                    exception_handlers={HTTPException: _http_error, Exception: _internal_error})
    app.state.server = server
    return app
