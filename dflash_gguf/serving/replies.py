"""dflash-server's replies: how a job's events become an OpenAI or Anthropic response,
whole or streamed as server-sent events. A Reply holds what every one of them needs (the
request, its job and event queue, the prepared prompt, the response id); serving/routes.py makes
it and picks the function."""
from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Callable, Iterator, List, Optional

from starlette.requests import Request
from starlette.responses import JSONResponse

from . import anthropic_api, openai_api, responses_api
from .probs import JobProbs
from .scheduler import Job, timings_of

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def error(status: int, message: str, kind: str = "invalid_request_error", param: Optional[str] = None,
          headers: Optional[dict] = None, anthropic: bool = False, extra: Optional[dict] = None) -> JSONResponse:
    """An error in the API's own shape (OpenAI's and llama-server's, or Anthropic's for
    /v1/messages); extra: more fields of the error object."""
    if anthropic:
        return JSONResponse(anthropic_api.error_json(status, message), status_code=status, headers=headers)
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": status, **(extra or {})}},
                        status_code=status, headers=headers)


def refused(e, anthropic: bool = False, headers: Optional[dict] = None) -> JSONResponse:
    """A BadRequest's response."""
    return error(e.status, str(e), e.kind, param=e.param, anthropic=anthropic, extra=e.extra, headers=headers)


def engine_error(e: BaseException, anthropic: bool = False) -> JSONResponse:
    """A job that failed: a ValueError is the request's fault (400), anything else ours (500)."""
    if isinstance(e, ValueError):
        return error(400, str(e), anthropic=anthropic)
    return error(500, f"generation failed: {e}", "server_error", anthropic=anthropic)


def _stream_error(e: BaseException) -> dict:
    status = 400 if isinstance(e, ValueError) else 500
    return {"message": str(e), "code": status, "type": "invalid_request_error" if status == 400 else "server_error"}


def chunk(payload: dict) -> str:
    """One server-sent event of JSON data."""
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


@dataclass
class Reply:
    """One request's reply in the making. server: the Server (its model id, usage and
    extension fields); events: the job's ("text", piece) ... ("done", job) or ("error", e)
    events, put there from the engine's thread; prepared: server.Prepared; rid: the
    response id; created: its Unix time."""

    server: object
    request: Request
    job: Job
    events: asyncio.Queue
    prepared: object
    rid: str
    created: int = 0
    # llama-server's `__verbose`: the native result of the job (llama_api.result_json), set
    # where the request or the server (--verbose) asks for it
    verbose: Optional[Callable[["Reply"], dict]] = None

    def debug_fields(self) -> dict:
        return {"__verbose": self.verbose(self)} if self.verbose else {}

    async def _cancel_on_disconnect(self) -> None:
        """The body has been read: what the connection says next is that the client left."""
        while (await self.request.receive())["type"] != "http.disconnect":
            pass
        self.job.cancel()  # it stops at the end of the prompt chunk or step in progress

    async def events_of_job(self, ping: bool):
        """The job's events; with `ping`, ("ping", None) whenever it has been silent for
        --sse-ping-interval seconds (waiting in the queue, a long prefill)."""
        watch = asyncio.ensure_future(self._cancel_on_disconnect())
        seconds = self.server.sse_ping_seconds
        interval = seconds if ping and seconds > 0 else None
        try:
            while True:
                try:
                    kind, value = await asyncio.wait_for(self.events.get(), interval)
                except asyncio.TimeoutError:
                    yield "ping", None
                    continue
                yield kind, value
                if kind not in ("text", "progress"):
                    return
        finally:
            watch.cancel()
            self.job.cancel()  # the client went away (or the job is over, where this changes nothing)

    def probs(self) -> Optional[JobProbs]:
        """The job's token log-probabilities as they come, when the request asked for them."""
        if self.prepared.request.probs_asked is None:
            return None
        return JobProbs(self.server.pieces, self.job)

    async def outcome(self) -> tuple:
        """How the job ended: ("done", job) or ("error", e)."""
        stream = self.events_of_job(ping=False)
        try:
            async for kind, value in stream:
                if kind not in ("text", "progress"):
                    return kind, value
        finally:
            await stream.aclose()


# -- OpenAI ------------------------------------------------------------------------------------------

def _response(r: Reply, obj: str, choice: dict) -> JSONResponse:
    return JSONResponse({"id": r.rid, "object": obj, "created": r.created, "model": r.server.model_id,
                         "choices": [choice], "usage": r.server.usage(r.job), "timings": r.server.timings(r.job),
                         "dflash": r.server.extension(r.job), **r.debug_fields()})


def _whole_logprobs(r: Reply) -> Optional[dict]:
    """A finished job's logprobs, when asked (else None, as the API's)."""
    probs = r.probs()
    return None if probs is None else {"content": probs.all(r.job.text)}


def completion_choice(r: Reply, index: int = 0) -> dict:
    return {"index": index, "text": r.job.text, "finish_reason": r.job.finish_reason, "logprobs": _whole_logprobs(r)}


async def completion_reply(r: Reply):
    kind, value = await r.outcome()
    if kind == "error":
        return engine_error(value)
    return _response(r, "text_completion", completion_choice(r))


def _parsed(r: Reply, make_id=None):
    """A finished job's text read into its parts (chat.assistant.Reply); make_id: its calls' ids."""
    parser = r.prepared.turn.parser(make_id)
    parser.feed(r.job.text)
    parser.finish()
    return parser.reply


def chat_choice(r: Reply, index: int = 0) -> dict:
    reply = _parsed(r)
    return {"index": index, "message": openai_api.message_json(reply), "logprobs": _whole_logprobs(r),
            "finish_reason": openai_api.finish_reason(reply, r.job.finish_reason)}


async def chat_reply(r: Reply):
    kind, value = await r.outcome()
    if kind == "error":
        return engine_error(value)
    return _response(r, "chat.completion", chat_choice(r))


async def choices_reply(rs: List[Reply], obj: str, choice: Callable[[Reply, int], dict]):
    """A request's n choices (n > 1), each a job of its own: one response with them all,
    its usage the prompt once and every choice's tokens (OpenAI's, as llama-server's)."""
    for r in rs:
        kind, value = await r.outcome()
        if kind == "error":
            for other in rs:
                other.job.cancel()
            return engine_error(value)
    first = rs[0]
    usage = first.server.usage(first.job)
    usage["completion_tokens"] = sum(r.job.stats.generated_tokens for r in rs)
    usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
    return JSONResponse({"id": first.rid, "object": obj, "created": first.created, "model": first.server.model_id,
                         "choices": [choice(r, i) for i, r in enumerate(rs)], "usage": usage,
                         "timings": first.server.timings(first.job), "dflash": first.server.extension(first.job)})


def _stream_end(r: Reply, obj: str, last_choice: dict, include_usage: bool):
    """The last choice (with the usage unless it gets a chunk of its own), then [DONE]; the
    last chunk before [DONE] carries llama-server's `timings`."""
    usage, timings = r.server.usage(r.job), r.server.timings(r.job)
    head = {"id": r.rid, "object": obj, "created": r.created, "model": r.server.model_id}
    yield chunk({**head, "choices": [last_choice], "dflash": r.server.extension(r.job), **r.debug_fields(),
                 **({} if include_usage else {"usage": usage, "timings": timings})})
    if include_usage:
        yield chunk({**head, "choices": [], "usage": usage, "timings": timings})
    yield "data: [DONE]\n\n"


def _chunk_logprobs(entries) -> Optional[dict]:
    """A streamed chunk's logprobs: its tokens' entries, None when it has none."""
    return {"content": list(entries)} if entries else None


async def completion_stream(r: Reply, include_usage: bool):
    head = {"id": r.rid, "object": "text_completion", "created": r.created, "model": r.server.model_id}
    probs = r.probs()
    async for kind, value in r.events_of_job(ping=True):
        if kind == "ping":
            yield ": keep-alive\n\n"
        elif kind == "progress":
            yield chunk({**head, "choices": [{"index": 0, "text": "", "finish_reason": None, "logprobs": None}],
                         "prompt_progress": value.as_dict()})
        elif kind == "text":
            entries = probs.take(value) if probs else []
            yield chunk({**head, "choices": [{"index": 0, "text": value, "finish_reason": None,
                                              "logprobs": _chunk_logprobs(entries)}]})
        elif kind == "done":
            last = {"index": 0, "text": "", "finish_reason": r.job.finish_reason,
                    "logprobs": _chunk_logprobs(probs.rest() if probs else [])}
            for line in _stream_end(r, "text_completion", last, include_usage):
                yield line
        else:
            yield chunk({"error": _stream_error(value)})


async def chat_stream(r: Reply, include_usage: bool):
    head = {"id": r.rid, "object": "chat.completion.chunk", "created": r.created, "model": r.server.model_id}

    def delta_chunk(delta: dict, entries: list = ()) -> str:
        return chunk({**head, "choices": [{"index": 0, "delta": delta, "finish_reason": None,
                                           "logprobs": _chunk_logprobs(entries)}]})

    parser = r.prepared.turn.parser()
    probs = r.probs()
    pending: list = []  # entries whose text has made no delta yet: they go with the next one
    yield delta_chunk({"role": "assistant", "content": None})  # as llama-server: no empty text delta
    async for kind, value in r.events_of_job(ping=True):
        if kind == "ping":
            yield ": keep-alive\n\n"
        elif kind == "progress":  # as llama-server: the opening delta again, with the prompt's progress
            yield chunk({**head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": None},
                                              "finish_reason": None}], "prompt_progress": value.as_dict()})
        elif kind in ("text", "done"):
            if probs is not None:
                pending += probs.take(value) if kind == "text" else probs.rest()
            deltas = [delta for d in (parser.feed(value) if kind == "text" else parser.finish())
                      for delta in openai_api.deltas_json(d)]
            for i, delta in enumerate(deltas):  # the last delta of the piece carries its tokens' entries
                last_one = i == len(deltas) - 1
                yield delta_chunk(delta, pending if last_one else ())
                if last_one:
                    pending = []
            if kind == "done":
                finish = openai_api.finish_reason(parser.reply, r.job.finish_reason)
                last = {"index": 0, "delta": {}, "finish_reason": finish, "logprobs": _chunk_logprobs(pending)}
                for line in _stream_end(r, "chat.completion.chunk", last, include_usage):
                    yield line
        else:
            yield chunk({"error": _stream_error(value)})


# -- Anthropic ---------------------------------------------------------------------------------------

def _anthropic_end(r: Reply, reply) -> tuple:
    """(stop_reason, stop_sequence, usage) of a finished message."""
    s = r.job.stats
    stop_sequence = s.stop_string if s.stop_string in r.prepared.request.stops else None
    return (anthropic_api.stop_reason(reply, r.job.finish_reason, stop_sequence), stop_sequence,
            anthropic_api.usage_json(s.prompt_tokens, s.reused_tokens, s.generated_tokens))


async def messages_reply(r: Reply):
    kind, value = await r.outcome()
    if kind == "error":
        return engine_error(value, anthropic=True)
    reply = _parsed(r, anthropic_api.tool_use_id)
    return JSONResponse(anthropic_api.message_json(r.rid, r.server.model_id, reply, *_anthropic_end(r, reply)))


async def _events(r: Reply, make_id, out, ping: str, end, error_event, progress=None):
    """A reply streamed as an API's events (out: an EventStream of anthropic_api or
    responses_api): its start, its deltas as the parser reads them, end(reply)'s events;
    `ping` while the job is silent, error_event(e) if it fails, progress(p)'s events for
    the prompt's progress (return_progress) where the API has a place for it."""
    parser = r.prepared.turn.parser(make_id)
    for line in out.start():
        yield line
    async for kind, value in r.events_of_job(ping=True):
        if kind == "ping":
            yield ping
        elif kind == "progress":
            for line in progress(value) if progress else ():
                yield line
        elif kind in ("text", "done"):
            for d in parser.feed(value) if kind == "text" else parser.finish():
                for line in out.deltas(d):
                    yield line
            if kind == "done":
                for line in end(parser.reply):
                    yield line
        else:
            yield error_event(value)


def messages_stream(r: Reply):
    out = anthropic_api.EventStream(r.rid, r.server.model_id, len(r.prepared.tokens))

    def error_event(e: BaseException) -> str:
        return anthropic_api.sse("error", anthropic_api.error_json(400 if isinstance(e, ValueError) else 500, str(e)))

    return _events(r, anthropic_api.tool_use_id, out, anthropic_api.sse("ping", {"type": "ping"}),
                   lambda reply: out.stop(*_anthropic_end(r, reply)), error_event)


# -- OpenAI's Responses ------------------------------------------------------------------------------

def _responses_usage(r: Reply) -> dict:
    s = r.job.stats
    return responses_api.usage_json(s.prompt_tokens, s.reused_tokens, s.generated_tokens)


async def responses_reply(r: Reply):
    kind, value = await r.outcome()
    if kind == "error":
        return engine_error(value)
    output = responses_api.output_items(_parsed(r, responses_api.call_id))
    return JSONResponse({**responses_api.response_json(r.rid, r.server.model_id, r.created, output,
                                                       _responses_usage(r)),
                         "timings": r.server.timings(r.job), "dflash": r.server.extension(r.job)})


def responses_stream(r: Reply):
    """As llama-server streams a response: no [DONE] after response.completed, an error as
    a data-only event with the error object."""
    out = responses_api.EventStream(r.rid, r.server.model_id, r.created)

    def end(reply) -> Iterator[str]:
        return out.stop(_responses_usage(r), {"timings": r.server.timings(r.job)})

    if r.prepared.request.timings_per_token:  # llama-server's: each text delta with the timings so far
        out.timings = lambda: r.server.timings(r.job)
    return _events(r, responses_api.call_id, out, ": keep-alive\n\n", end,
                   lambda e: chunk({"error": _stream_error(e)}),
                   lambda p: out.progress(p.as_dict(), timings_of(p.stats, r.server.speculates)
                                          if r.prepared.request.timings_per_token else None))
