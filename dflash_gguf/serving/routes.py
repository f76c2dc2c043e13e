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
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from ..speculation.suffix import corpus_key
from . import anthropic_api, llama_api, replies, responses_api, webui
from .anthropic_models import MessagesRequest
from .api_errors import BadRequest, validated
from .cors import Cors
from .llama_models import ApplyTemplateRequest, InfillRequest, NativeCompletionRequest
from .openai_models import ChatRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from .replies import SSE_HEADERS, Reply, error, refused
from .responses_models import ResponsesRequest
from .scheduler import QueueFull, ShuttingDown

RETRY_AFTER_SECONDS = 1
MAX_BODY_BYTES = 64 << 20  # far above any prompt a context holds
PUBLIC_PATHS = ("/health", "/v1/health") + webui.PATHS  # answered without an API key


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
    if kind == "responses":
        return server.chat_prompt(responses_api.to_chat(validated(ResponsesRequest, body), body))
    return server.chat_prompt(validated(ChatRequest, body))


async def _generate(request: Request, kind: str) -> Response:
    """kind: "completion", "chat", "responses" (OpenAI) or "messages" (Anthropic)."""
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
        if kind in ("chat", "completion") and (prepared.request.n or 1) > 1:
            return await _choices(request, server, kind, prepared, job, events)
    except BadRequest as e:
        return refused(e, anthropic=anthropic)
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
    if kind == "responses":
        r = Reply(server, request, job, events, prepared, responses_api.new_id(), int(time.time()))
        if stream:
            return StreamingResponse(replies.responses_stream(r), media_type="text/event-stream", headers=SSE_HEADERS)
        return await replies.responses_reply(r)
    rid = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24]
    verbose = llama_api.result_json if server.verbose or prepared.request.verbose else None
    r = Reply(server, request, job, events, prepared, rid, int(time.time()), verbose)
    if stream:
        sse = replies.chat_stream(r, include_usage) if kind == "chat" else replies.completion_stream(r, include_usage)
        return StreamingResponse(sse, media_type="text/event-stream", headers=SSE_HEADERS)
    return await (replies.chat_reply if kind == "chat" else replies.completion_reply)(r)


async def _choices(request: Request, server, kind: str, prepared, first, events: asyncio.Queue) -> Response:
    """A chat or completion asking for n > 1 choices: each choice a job of its own on the
    same scheduler (the first made already), answered whole when all are done."""
    loop = asyncio.get_running_loop()
    rid = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24]
    created = int(time.time())
    rs = [Reply(server, request, first, events, prepared, rid, created)]
    for i in range(1, prepared.request.n):
        queue: asyncio.Queue = asyncio.Queue()

        def sink_i(kind_: str, value, queue=queue) -> None:
            loop.call_soon_threadsafe(queue.put_nowait, (kind_, value))

        rs.append(Reply(server, request, server.make_job(prepared, sink_i, _corpus(request), choice=i), queue,
                        prepared, rid, created))
    for r in rs:
        try:
            server.scheduler.submit(r.job)
        except (QueueFull, ShuttingDown) as e:
            for other in rs:
                other.job.cancel()
            kind_ = "server_busy" if isinstance(e, QueueFull) else "server_shutting_down"
            return _busy(f"the server cannot take {len(rs)} choices now: {e}; retry later", kind_, False)
    if kind == "chat":
        return await replies.choices_reply(rs, "chat.completion", replies.chat_choice)
    return await replies.choices_reply(rs, "text_completion", replies.completion_choice)


async def chat_completions(request: Request) -> Response:
    return await _generate(request, "chat")


async def completions(request: Request) -> Response:
    return await _generate(request, "completion")


async def messages(request: Request) -> Response:
    return await _generate(request, "messages")


async def responses(request: Request) -> Response:
    return await _generate(request, "responses")


async def count_tokens(request: Request) -> Response:
    server = _server(request)
    try:
        body = await read_body(request)
        prepared = await run_in_threadpool(_prepare, server, "messages", {"max_tokens": 1, **body})
    except BadRequest as e:
        return refused(e, anthropic=True)
    return JSONResponse({"input_tokens": len(prepared.tokens)})


def _input_tokens(kind: str, extra: dict):
    """llama-server's /chat/completions/input_tokens and /responses/input_tokens: a
    request's prompt tokens, counted."""
    async def route(request: Request) -> Response:
        server = _server(request)
        try:
            body = await read_body(request)
            prepared = await run_in_threadpool(_prepare, server, kind, body)
        except BadRequest as e:
            return refused(e)
        return JSONResponse({"input_tokens": len(prepared.tokens), **extra})
    return route


def _tokenizer_route(name: str, model):
    async def route(request: Request) -> Response:
        try:
            body = validated(model, await read_body(request))
            return JSONResponse(await run_in_threadpool(getattr(_server(request), name), body))
        except BadRequest as e:
            return refused(e)
    return route


def _native_prepare(server, kind: str, body: dict) -> list:
    """/completion's prompts (a batch, or one) or /infill's, made ready (off the event loop)."""
    if kind == "infill":
        return [server.infill_prompt(validated(InfillRequest, body))]
    return server.native_prompts(validated(NativeCompletionRequest, body))


async def _native(request: Request, kind: str) -> Response:
    """llama-server's /completion and /infill: a job per prompt on the same scheduler as
    the OpenAI routes; a batch of prompts is answered as a list, not streamed."""
    server = _server(request)
    loop = asyncio.get_running_loop()
    try:
        body = await read_body(request)
        if kind == "infill":
            fim = await run_in_threadpool(server.engine.tokenizer.fim_tokens)
            if min(fim["pre"], fim["suf"], fim["mid"]) < 0:  # the model first, as llama-server checks
                await run_in_threadpool(server.infill_prompt, InfillRequest())
        prepared = await run_in_threadpool(_native_prepare, server, kind, body)
        stream = prepared[0].request.stream
        if stream and len(prepared) > 1:
            raise BadRequest("a batch of prompts cannot be streamed: send them one by one", "stream")
        replies_ = []
        for p in prepared:
            events: asyncio.Queue = asyncio.Queue()

            def sink(kind_: str, value, events=events) -> None:
                loop.call_soon_threadsafe(events.put_nowait, (kind_, value))

            job = server.make_job(p, sink, _corpus(request))
            replies_.append(Reply(server, request, job, events, p, ""))
    except BadRequest as e:
        return refused(e)
    for r in replies_:
        try:
            server.scheduler.submit(r.job)
        except QueueFull as e:
            for other in replies_:
                other.job.cancel()
            return _busy(f"the server is busy: {e}; retry later", "server_busy", False)
        except ShuttingDown as e:
            return _busy(str(e), "server_shutting_down", False)
    if stream:
        return StreamingResponse(llama_api.completion_stream(replies_[0]), media_type="text/event-stream",
                                 headers=SSE_HEADERS)
    results = []
    for i, r in enumerate(replies_):
        outcome, value = await r.outcome()
        if outcome == "error":
            for other in replies_:
                other.job.cancel()
            return replies.engine_error(value)
        results.append(llama_api.result_json(r, index=i))
    return JSONResponse(results if len(results) > 1 else results[0])


async def completion_native(request: Request) -> Response:
    return await _native(request, "completion")


async def infill(request: Request) -> Response:
    return await _native(request, "infill")


async def apply_template(request: Request) -> Response:
    server = _server(request)
    try:
        body = await read_body(request)
        return JSONResponse(await run_in_threadpool(lambda: server.apply_template(validated(ApplyTemplateRequest,
                                                                                             body))))
    except BadRequest as e:
        return refused(e)


async def slots(request: Request) -> Response:
    server = _server(request)
    if not server.slots_enabled:
        return error(501, "This server does not support slots endpoint. Start it with `--slots`",
                     "not_supported_error")
    return JSONResponse(server.slots())


async def not_supported(request: Request) -> Response:
    return error(501, f"{request.url.path} is not supported by this server (dflash-server serves generation "
                      "models: no embeddings or reranking)", "not_supported_error")


async def models(request: Request) -> Response:
    # the OpenAI shape, with the Anthropic one's fields and the context length beside
    server = _server(request)
    n_ctx = server.engine.target.n_ctx
    info = server.engine.target.info()
    created = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(server.started))
    model = {"id": server.model_id, "aliases": server.aliases or [server.model_id], "tags": server.tags,
             "object": "model", "created": server.started, "owned_by": "dflash-gguf",
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
    server = _server(request)
    if not server.metrics_enabled:
        return error(501, "This server does not support metrics endpoint. Start it with `--metrics`",
                     "not_supported_error")
    text = await run_in_threadpool(server.metrics)
    return PlainTextResponse(text, media_type="text/plain; version=0.0.4",
                             headers={"Process-Start-Time-Unix": str(server.started)})


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
    # OpenAI's, chat also without /v1 as llama-server has it (its /completions is /completion)
    Route("/v1/chat/completions", chat_completions, methods=["POST"]),
    Route("/chat/completions", chat_completions, methods=["POST"]),
    Route("/v1/completions", completions, methods=["POST"]),
    *[Route(prefix + "/chat/completions/input_tokens", _input_tokens("chat", {}), methods=["POST"])
      for prefix in ("/v1", "")],
    # the Responses API, also without /v1, as llama-server has it
    *[Route(prefix + "/responses", responses, methods=["POST"]) for prefix in ("/v1", "")],
    *[Route(prefix + "/responses/input_tokens", _input_tokens("responses", {"object": "response.input_tokens"}),
            methods=["POST"]) for prefix in ("/v1", "")],
    *[Route(prefix + "/models", models, methods=["GET"]) for prefix in ("/v1", "")],
    *[Route(path, not_supported, methods=["POST"]) for path in ("/v1/embeddings", "/embeddings", "/embedding",
                                                                "/v1/rerank", "/rerank", "/reranking")],
    Route("/v1/messages", messages, methods=["POST"]),
    Route("/v1/messages/count_tokens", count_tokens, methods=["POST"]),
    # llama-server's own
    Route("/completion", completion_native, methods=["POST"]),
    Route("/completions", completion_native, methods=["POST"]),
    Route("/infill", infill, methods=["POST"]),
    Route("/apply-template", apply_template, methods=["POST"]),
    Route("/tokenize", _tokenizer_route("tokenize", TokenizeRequest), methods=["POST"]),
    Route("/detokenize", _tokenizer_route("detokenize", DetokenizeRequest), methods=["POST"]),
    Route("/props", props, methods=["GET"]),
    Route("/slots", slots, methods=["GET"]),
    Route("/health", health, methods=["GET"]),
    Route("/v1/health", health, methods=["GET"]),
    Route("/metrics", metrics, methods=["GET"]),
]


def create_app(server, cors: dict = None) -> Starlette:
    """The Starlette application serving `server` (a server.Server); cors: Cors's
    settings (default: pages from localhost only)."""
    # CORS outermost, so that preflights and refusals carry its headers too
    middleware = [Middleware(Cors, **(cors or {}))]
    if server.api_keys:
        middleware.append(Middleware(RequireApiKey, keys=server.api_keys))
    routes = ROUTES + (webui.routes() if server.webui else [])  # the chat page at / (--no-webui: none)
    app = Starlette(routes=routes, lifespan=_lifespan, middleware=middleware,
                    exception_handlers={HTTPException: _http_error, Exception: _internal_error})
    app.state.server = server
    return app
