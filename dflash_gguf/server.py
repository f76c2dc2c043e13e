"""dflash-server: an OpenAI-compatible HTTP server over one Engine (Starlette + uvicorn).

POST /v1/chat/completions and /v1/completions (streamed as server-sent events or not),
GET /v1/models, /health and /metrics (Prometheus text). Requests wait in a bounded FIFO
queue (serving.Scheduler); prompts sharing a prefix with earlier ones resume from a
prefix checkpoint (checkpoints.PrefixCheckpoints). Bad input gets a 400 with the
reason, a full queue a 503 with Retry-After; a client that goes away stops its
generation at the end of the step in progress.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import signal
import sys
import time
import uuid
from dataclasses import dataclass
from typing import Any, List, Optional, Sequence, Tuple

from .engine import Engine
from .sampling import SamplingParams
from .serving import Job, QueueFull, Scheduler, ShuttingDown

RETRY_AFTER_SECONDS = 1
MAX_STOPS = 16
MAX_BODY_BYTES = 64 << 20  # far above any prompt a context holds


class BadRequest(Exception):
    def __init__(self, message: str, param: Optional[str] = None, status: int = 400):
        super().__init__(message)
        self.param = param
        self.status = status


@dataclass
class Defaults:
    """What a request that leaves a field out gets: the server's command-line flags."""

    sampling: SamplingParams
    max_tokens: Optional[int] = None  # None: until an end-of-generation token or the full context
    speculative: bool = True


# -- request fields ------------------------------------------------------------------------

def _number(body: dict, name: str, default, kind=float, lo=None, hi=None, lo_open=False):
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and not isinstance(value, int)):
        raise BadRequest(f"'{name}' must be {'an integer' if kind is int else 'a number'}, got {json.dumps(value)}",
                         name)
    if kind is float and not math.isfinite(value):
        raise BadRequest(f"'{name}' must be finite", name)
    if lo is not None and (value <= lo if lo_open else value < lo):
        raise BadRequest(f"'{name}' must be {'>' if lo_open else '>='} {lo}, got {value}", name)
    if hi is not None and value > hi:
        raise BadRequest(f"'{name}' must be <= {hi}, got {value}", name)
    return kind(value)


def _bool(body: dict, name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise BadRequest(f"'{name}' must be true or false, got {json.dumps(value)}", name)
    return value


def _stops(body: dict) -> List[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise BadRequest("'stop' must be a string or a list of strings", "stop")
    if len(stops) > MAX_STOPS:
        raise BadRequest(f"'stop' takes at most {MAX_STOPS} strings", "stop")
    return [s for s in stops if s]


def _sampling(body: dict, defaults: SamplingParams) -> SamplingParams:
    temperature = _number(body, "temperature", defaults.temperature, lo=0.0)
    top_p = _number(body, "top_p", defaults.top_p, lo=0.0, hi=1.0, lo_open=True)
    top_k = _number(body, "top_k", defaults.top_k, kind=int)
    min_p = _number(body, "min_p", defaults.min_p, lo=0.0)
    if min_p >= 1:
        raise BadRequest(f"'min_p' must be below 1, got {min_p}", "min_p")
    seed = _number(body, "seed", defaults.seed, kind=int)
    return SamplingParams(temperature, max(top_k, 0), top_p, min_p, seed)


def _check_n(body: dict) -> None:
    if _number(body, "n", 1, kind=int) != 1:
        raise BadRequest("only n=1 is supported", "n")


def _message_text(message: Any, i: int) -> dict:
    if not isinstance(message, dict):
        raise BadRequest(f"messages[{i}] must be an object with 'role' and 'content'", "messages")
    role, content = message.get("role"), message.get("content")
    if not isinstance(role, str) or not role:
        raise BadRequest(f"messages[{i}].role must be a non-empty string", "messages")
    if content is None:
        content = ""
    elif isinstance(content, list):  # content parts: only text ones can be read by a text model
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise BadRequest(f"messages[{i}].content parts must be {{'type': 'text', 'text': ...}}", "messages")
            texts.append(part["text"])
        content = "".join(texts)
    elif not isinstance(content, str):
        raise BadRequest(f"messages[{i}].content must be a string or a list of text parts", "messages")
    return {**message, "role": role, "content": content}


# -- the application -------------------------------------------------------------------------

class Server:
    """Request handling over a Scheduler and its Engine."""

    def __init__(self, scheduler: Scheduler, model_id: str, defaults: Defaults):
        self.scheduler = scheduler
        self.engine: Engine = scheduler.engine
        self.model_id = model_id
        self.defaults = defaults
        self.started = int(time.time())
        self.shutting_down = False
        tok = self.engine.tokenizer
        # end-of-generation tokens end a reply; their text is not part of it
        self.eog_texts = sorted({t for t in (tok.decode([i]) for i in tok.eog_ids) if t})

    # -- prompts -----------------------------------------------------------------------------
    def completion_prompt(self, body: dict) -> List[int]:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch of one
        if isinstance(prompt, str):
            if not prompt:
                raise BadRequest("'prompt' is empty", "prompt")
            return self.engine.encode(prompt)
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            n_vocab = self.engine.target.n_vocab
            bad = [t for t in prompt if not 0 <= t < n_vocab]
            if bad:
                raise BadRequest(f"token id {bad[0]} is outside the vocabulary (0..{n_vocab - 1})", "prompt")
            return list(prompt)
        raise BadRequest("'prompt' must be a non-empty string or a list of token ids (one prompt: n=1, no batches)",
                         "prompt")

    def chat_prompt(self, body: dict) -> List[int]:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise BadRequest("'messages' must be a non-empty list", "messages")
        messages = [_message_text(m, i) for i, m in enumerate(messages)]
        kwargs = body.get("chat_template_kwargs") or {}
        if not isinstance(kwargs, dict):
            raise BadRequest("'chat_template_kwargs' must be an object", "chat_template_kwargs")
        try:
            text = self.engine.render_messages(messages, **kwargs)
        except ValueError as e:
            raise BadRequest(str(e), "messages") from None
        except Exception as e:  # a template reading a field in a way the request did not allow for
            raise BadRequest(f"the model's chat template failed on these messages: {e}", "messages") from None
        return self.engine.encode(text)

    def make_job(self, body: dict, tokens: List[int], sink) -> Job:
        _check_n(body)
        unsupported = {"echo": body.get("echo") not in (None, False), "logprobs": body.get("logprobs") not in
                       (None, False, 0), "best_of": body.get("best_of") not in (None, 1),
                       "suffix": body.get("suffix") not in (None, ""), "tools": body.get("tools") not in (None, [])}
        for name, asked in unsupported.items():
            if asked:
                raise BadRequest(f"'{name}' is not supported by this server", name)
        sampling = _sampling(body, self.defaults.sampling)
        stops = _stops(body)
        n_ctx = self.engine.target.n_ctx
        field = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
        max_tokens = _number(body, field, self.defaults.max_tokens, kind=int, lo=0)
        speculative = self.defaults.speculative
        if max_tokens is None:
            # no limit given: until the end of generation or of the context
            if len(tokens) >= n_ctx:
                raise BadRequest(f"the prompt ({len(tokens)} tokens) does not fit the context ({n_ctx} tokens), "
                                 "which leaves no room to generate", "messages" if "messages" in body else "prompt")
            max_tokens, context_full = n_ctx - len(tokens), "stop"
        else:
            context_full = "error"
        try:
            self.engine.check_request(tokens, max_tokens, speculative=speculative, context_full=context_full)
        except ValueError as e:
            raise BadRequest(f"{e} (context size {n_ctx} tokens; this request: {len(tokens)} prompt tokens, "
                             f"max_tokens {max_tokens})", field) from None
        return Job(tokens=tokens, max_tokens=max_tokens, sink=sink, stop=stops + self.eog_texts, sampling=sampling,
                   speculative=speculative, context_full=context_full)

    # -- responses ---------------------------------------------------------------------------
    @staticmethod
    def usage(job: Job) -> dict:
        s = job.stats
        return {"prompt_tokens": s.prompt_tokens, "completion_tokens": s.generated_tokens,
                "total_tokens": s.prompt_tokens + s.generated_tokens,
                "prompt_tokens_details": {"cached_tokens": s.reused_tokens}}

    @staticmethod
    def extension(job: Job) -> dict:
        """Our own figures for the request, next to `usage`."""
        s = job.stats
        return {
            "prompt_tokens": s.prompt_tokens,
            "reused_prompt_tokens": s.reused_tokens,
            "prefilled_tokens": s.prompt_tokens - s.reused_tokens,
            "checkpoint": s.checkpoint,
            "generated_tokens": s.generated_tokens,
            "target_passes": len(s.accepted_lengths),
            "mean_accepted_length": round(s.mean_accepted, 4) if s.accepted_lengths else None,
            "accepted_lengths": list(s.accepted_lengths),
            "mean_tree_nodes": round(sum(s.tree_sizes) / len(s.tree_sizes), 3) if s.tree_sizes else None,
            "tree_sizes": list(s.tree_sizes),
            "prefill_seconds": round(s.prefill_seconds, 5),
            "decode_seconds": round(s.decode_seconds, 5),
            "decode_tokens_per_second": round(s.decode_tps, 2),
            "queue_seconds": round(job.queue_seconds, 5),
            "stop_reason": s.stop_reason,
        }

    def metrics(self) -> str:
        t = self.scheduler.totals
        ck = self.engine.checkpoints
        lines = []

        def metric(name: str, kind: str, help_: str, value) -> None:
            lines.extend([f"# HELP dflash_{name} {help_}", f"# TYPE dflash_{name} {kind}", f"dflash_{name} {value}"])

        metric("requests_total", "counter", "Requests run to an end (including failed and cancelled ones).",
               t.requests)
        metric("requests_failed_total", "counter", "Requests that ended with an error.", t.failed)
        metric("requests_cancelled_total", "counter", "Requests whose client went away.", t.cancelled)
        metric("requests_refused_total", "counter", "Requests refused because the queue was full.", t.refused)
        metric("queue_depth", "gauge", "Requests waiting for the engine.", self.scheduler.queue_depth)
        metric("requests_running", "gauge", "Requests on the engine.", self.scheduler.running)
        metric("prompt_tokens_total", "counter", "Prompt tokens received.", t.prompt_tokens)
        metric("prompt_tokens_reused_total", "counter", "Prompt tokens not computed (a checkpoint or the context).",
               t.reused_tokens)
        metric("generated_tokens_total", "counter", "Tokens generated.", t.generated_tokens)
        metric("prefill_seconds_total", "counter", "Time spent computing prompts.", round(t.prefill_seconds, 6))
        metric("decode_seconds_total", "counter", "Time spent generating.", round(t.decode_seconds, 6))
        metric("decode_tokens_per_second", "gauge", "Generated tokens per second of generation, over all requests.",
               round(t.generated_tokens / t.decode_seconds, 3) if t.decode_seconds > 0 else 0)
        metric("target_passes_total", "counter", "Target verify passes of speculative decoding.", t.target_passes)
        metric("mean_accepted_length", "gauge", "Tokens per target pass (AL), over all requests.",
               round(t.accepted_tokens / t.target_passes, 4) if t.target_passes else 0)
        metric("checkpoint_hits_total", "counter", "Prompts resumed from a prefix checkpoint.", ck.hits if ck else 0)
        metric("checkpoint_misses_total", "counter", "Prompts with no usable prefix checkpoint.",
               ck.misses if ck else 0)
        metric("checkpoints", "gauge", "Prefix checkpoints kept.", len(ck) if ck else 0)
        lines.extend(["# HELP dflash_checkpoint_bytes Memory the prefix checkpoints hold, by where it is.",
                      "# TYPE dflash_checkpoint_bytes gauge",
                      f'dflash_checkpoint_bytes{{where="device"}} {ck.device_nbytes if ck else 0}',
                      f'dflash_checkpoint_bytes{{where="host"}} {ck.host_nbytes if ck else 0}'])
        metric("checkpoint_device_budget_bytes", "gauge", "Device memory the prefix checkpoints may take.",
               ck.device_budget_bytes if ck else 0)
        metric("checkpoint_evictions_total", "counter", "Checkpoints dropped to stay in the budget.",
               ck.evicted if ck else 0)
        return "\n".join(lines) + "\n"


def create_app(server: Server):
    """The Starlette application serving `server`."""
    from starlette.applications import Starlette
    from starlette.exceptions import HTTPException
    from starlette.requests import Request
    from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
    from starlette.routing import Route

    def error(status: int, message: str, kind: str = "invalid_request_error", param: Optional[str] = None,
              headers: Optional[dict] = None) -> JSONResponse:
        return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": status}},
                            status_code=status, headers=headers)

    async def read_body(request: Request) -> dict:
        parts, size = [], 0
        async for part in request.stream():
            size += len(part)
            if size > MAX_BODY_BYTES:
                raise BadRequest(f"the request body exceeds {MAX_BODY_BYTES >> 20} MiB", status=413)
            parts.append(part)
        raw = b"".join(parts)
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as e:
            raise BadRequest(f"the request body is not valid JSON: {e}") from None
        if not isinstance(body, dict):
            raise BadRequest("the request body must be a JSON object")
        return body

    async def generate(request: Request, chat: bool) -> Response:
        try:
            body = await read_body(request)
            tokens = server.chat_prompt(body) if chat else server.completion_prompt(body)
            stream = _bool(body, "stream", False)
            options = body.get("stream_options") or {}
            if not isinstance(options, dict):
                raise BadRequest("'stream_options' must be an object", "stream_options")
            include_usage = _bool(options, "include_usage", False)
            loop = asyncio.get_running_loop()
            events: asyncio.Queue = asyncio.Queue()

            def sink(kind: str, value) -> None:  # called on the engine's thread
                try:
                    loop.call_soon_threadsafe(events.put_nowait, (kind, value))
                except RuntimeError:  # the event loop is gone: nobody is listening any more
                    job.cancel()

            job = server.make_job(body, tokens, sink)
        except BadRequest as e:
            return error(e.status, str(e), param=e.param)
        try:
            server.scheduler.submit(job)
        except QueueFull as e:
            return error(503, f"the server is busy: {e}; retry later", "server_busy",
                         headers={"Retry-After": str(RETRY_AFTER_SECONDS)})
        except ShuttingDown as e:
            return error(503, str(e), "server_shutting_down", headers={"Retry-After": str(RETRY_AFTER_SECONDS)})
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        created = int(time.time())
        if stream:
            return StreamingResponse(sse(request, job, events, rid, created, chat, include_usage),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        return await complete(request, job, events, rid, created, chat)

    async def cancel_on_disconnect(request: Request, job: Job) -> None:
        """The body has been read: what the connection says next is that the client left."""
        while (await request.receive())["type"] != "http.disconnect":
            pass
        job.cancel()  # it stops at the end of the step in progress

    async def complete(request: Request, job: Job, events: asyncio.Queue, rid: str, created: int, chat: bool):
        watch = asyncio.ensure_future(cancel_on_disconnect(request, job))
        try:
            while True:
                kind, value = await events.get()
                if kind != "text":
                    break
        finally:
            watch.cancel()
            job.cancel()  # harmless once the job has ended; stops it if this handler was cancelled
        if kind == "error":
            return engine_error(value)
        choice = {"index": 0, "finish_reason": job.finish_reason, "logprobs": None}
        if chat:
            choice["message"] = {"role": "assistant", "content": job.text}
        else:
            choice["text"] = job.text
        return JSONResponse({"id": rid, "object": "chat.completion" if chat else "text_completion",
                             "created": created, "model": server.model_id, "choices": [choice],
                             "usage": server.usage(job), "dflash": server.extension(job)})

    def engine_error(e: BaseException) -> JSONResponse:
        if isinstance(e, ValueError):
            return error(400, str(e))
        return error(500, f"generation failed: {e}", "server_error")

    async def sse(request: Request, job: Job, events: asyncio.Queue, rid: str, created: int, chat: bool,
                  include_usage: bool):
        obj = "chat.completion.chunk" if chat else "text_completion"

        def chunk(text: Optional[str], finish: Optional[str] = None, role: bool = False, **extra) -> str:
            if chat:
                delta = {"role": "assistant", "content": ""} if role else ({"content": text} if text else {})
                choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
            else:
                choice = {"index": 0, "text": text or "", "finish_reason": finish, "logprobs": None}
            payload = {"id": rid, "object": obj, "created": created, "model": server.model_id, "choices": [choice],
                       **extra}
            return f"data: {json.dumps(payload)}\n\n"

        watch = asyncio.ensure_future(cancel_on_disconnect(request, job))
        try:
            if chat:
                yield chunk(None, role=True)
            while True:
                kind, value = await events.get()
                if kind == "text":
                    yield chunk(value)
                elif kind == "done":
                    yield chunk(None, job.finish_reason, dflash=server.extension(job),
                                **({} if include_usage else {"usage": server.usage(job)}))
                    if include_usage:
                        yield "data: " + json.dumps({"id": rid, "object": obj, "created": created,
                                                     "model": server.model_id, "choices": [],
                                                     "usage": server.usage(job)}) + "\n\n"
                    yield "data: [DONE]\n\n"
                    return
                else:
                    status = 400 if isinstance(value, ValueError) else 500
                    yield "data: " + json.dumps({"error": {"message": str(value), "code": status,
                                                           "type": "invalid_request_error" if status == 400
                                                           else "server_error"}}) + "\n\n"
                    return
        finally:
            watch.cancel()
            job.cancel()  # the client went away (or the job is over, where this changes nothing)

    async def chat_completions(request: Request) -> Response:
        return await generate(request, chat=True)

    async def completions(request: Request) -> Response:
        return await generate(request, chat=False)

    async def models(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": server.model_id, "object": "model",
                                                          "created": server.started, "owned_by": "dflash-gguf"}]})

    async def health(request: Request) -> Response:
        if server.shutting_down:
            return JSONResponse({"status": "shutting down"}, status_code=503)
        return JSONResponse({"status": "ok", "queue_depth": server.scheduler.queue_depth,
                             "running": server.scheduler.running})

    async def metrics(request: Request) -> Response:
        return PlainTextResponse(server.metrics(), media_type="text/plain; version=0.0.4")

    async def http_error(request: Request, exc: HTTPException) -> Response:
        return error(exc.status_code, exc.detail or "error", "not_found" if exc.status_code == 404 else
                     "invalid_request_error", headers=getattr(exc, "headers", None))

    async def internal_error(request: Request, exc: Exception) -> Response:
        return error(500, f"internal error ({type(exc).__name__})", "server_error")

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        server.shutting_down = True
        await asyncio.get_running_loop().run_in_executor(None, server.scheduler.close)

    routes = [
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
    ]
    return Starlette(routes=routes, lifespan=lifespan,
                     exception_handlers={HTTPException: http_error, Exception: internal_error})


# -- command line ----------------------------------------------------------------------------------

def _uvicorn_server_class():
    import uvicorn

    class GracefulServer(uvicorn.Server):
        """uvicorn's server, except that after a graceful stop on Ctrl-C or SIGTERM it
        returns instead of raising the signal again, so that the engine is closed and
        the process exits with status 0. A second Ctrl-C still forces the stop."""

        @contextlib.contextmanager
        def capture_signals(self):
            previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for sig, handler in previous.items():
                    signal.signal(sig, handler)

    return GracefulServer


def _mib_or_auto(value: str) -> Optional[int]:
    """MiB >= 0, or None for auto."""
    if value == "auto":
        return None
    if not value.isdigit():
        raise argparse.ArgumentTypeError(f"takes MiB >= 0 or auto, got {value!r}")
    return int(value)


def checkpoint_budget(args, plan) -> Tuple[int, int]:
    """(total, device) bytes for prefix checkpoints: --checkpoint-mib, and of it
    --checkpoint-device-mib, or with auto what the memory plan leaves on the devices."""
    from .checkpoints import device_room

    total = args.checkpoint_mib << 20
    device = device_room(plan) if args.checkpoint_device_mib is None else args.checkpoint_device_mib << 20
    return total, min(device, total)


def build_parser() -> argparse.ArgumentParser:
    from .cli import add_engine_args

    p = argparse.ArgumentParser(
        prog="dflash-server",
        description="Serve a GGUF model, sped up by a DFlash drafter, over the OpenAI HTTP API "
                    "(/v1/chat/completions, /v1/completions, /v1/models, /health, /metrics). "
                    "With no -m, serves the bundled demo.")
    add_engine_args(p)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8080, help="port to listen on (default 8080)")
    p.add_argument("-n", "--n-predict", type=int,
                   help="max_tokens of a request that gives none (default: until the end of generation or a "
                        "full context)")
    p.add_argument("--queue", type=int, default=16,
                   help="requests that may wait for the engine; more get 503 with Retry-After (default 16)")
    p.add_argument("--checkpoint-mib", type=int, default=1024,
                   help="memory for prefix checkpoints, device and host together, in MiB (default 1024; 0: none)")
    p.add_argument("--checkpoint-device-mib", type=_mib_or_auto, default=None, metavar="MIB|auto",
                   help="how much of it may be device memory, in MiB, or auto (default): what the memory plan "
                        "leaves free on the device, less 512 MiB; beyond it checkpoints go to host memory")
    p.add_argument("--checkpoint-every", type=int, default=512,
                   help="checkpoint long prompts every N tokens, besides their end (default 512)")
    p.add_argument("--alias", help="model name reported by /v1/models and in responses (default: the file name)")
    p.add_argument("--shutdown-timeout", type=float, default=60.0,
                   help="on Ctrl-C / SIGTERM, seconds to let running and queued requests finish (default 60)")
    p.add_argument("--print-memory", action="store_true",
                   help="print the memory plan of this configuration per device and the prefix checkpoints' "
                        "share (nothing is loaded) and exit; with --json as JSON on stdout")
    p.add_argument("--json", action="store_true", help="--print-memory as JSON")
    p.add_argument("--log-level", default="warning", choices=["critical", "error", "warning", "info", "debug"],
                   help="uvicorn's log level (default warning; info logs every request)")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    from .checkpoints import PrefixCheckpoints
    from .cli import demo_models, open_engine, print_memory, setup_devices, validate_engine_args

    parser = build_parser()
    args = parser.parse_args(argv)
    if not setup_devices(args, "dflash-server"):
        return args.exit_code
    validate_engine_args(args, parser)
    if not 0 <= args.port <= 65535:
        parser.error("--port must be 0..65535")
    if args.queue < 0:
        parser.error("--queue must be >= 0")
    if args.checkpoint_mib < 0:
        parser.error("--checkpoint-mib must be >= 0")
    if args.checkpoint_every < 1:
        parser.error("--checkpoint-every must be >= 1")
    if args.n_predict is not None and args.n_predict < 0:
        parser.error("-n/--n-predict must be >= 0")
    try:
        import uvicorn
        import starlette  # noqa: F401
    except ImportError:
        print("dflash-server: error: the server needs starlette and uvicorn: pip install 'dflash-gguf[server]'",
              file=sys.stderr)
        return 1

    model, draft = args.model, args.model_draft
    if model is None:
        paths = demo_models("dflash-server", draft)
        if paths is None:
            return 1
        model, draft = paths
    if args.print_memory:
        return print_memory("dflash-server", model, None if args.no_spec else draft, args,
                            lambda plan: checkpoint_budget(args, plan))
    engine = open_engine("dflash-server", model, None if args.no_spec else draft, args)
    if isinstance(engine, int):
        return engine
    if args.checkpoint_mib:
        total, device = checkpoint_budget(args, engine.memory_plan)
        engine.checkpoints = PrefixCheckpoints(total, args.checkpoint_every, device)
    scheduler = Scheduler(engine, args.queue)
    model_id = args.alias or os.path.basename(model)
    server = Server(scheduler, model_id, Defaults(args.sampling, args.n_predict))
    config = uvicorn.Config(create_app(server), host=args.host, port=args.port, log_level=args.log_level,
                            timeout_graceful_shutdown=args.shutdown_timeout, access_log=args.log_level == "info")
    mode = "plain" if engine.draft is None else (f"tree budget {args.tree_budget}" if engine.tree_budget else "chain")
    on_device = engine.checkpoints.device_budget_bytes >> 20 if engine.checkpoints else 0
    print(f"dflash-server: serving {model_id} ({mode}, context {engine.target.n_ctx}, queue {args.queue}, "
          f"checkpoints {args.checkpoint_mib} MiB, up to {on_device} MiB of it on the device) "
          f"on http://{args.host}:{args.port}", file=sys.stderr, flush=True)
    try:
        _uvicorn_server_class()(config).run()
    finally:
        scheduler.close()
        engine.close()
    print("dflash-server: stopped", file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
