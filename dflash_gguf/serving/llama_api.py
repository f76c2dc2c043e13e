"""llama-server's native replies (/completion, /infill): a job's outcome as llama-server
words it: content, the tokens, stop_type (eos, word, limit), generation_settings and
timings (prompt and generation times, cache_n, draft_n and draft_n_accepted), whole or
streamed as server-sent events, one per piece of text with its tokens."""
from __future__ import annotations

import math
from typing import List, Optional

from .replies import Reply, chunk
from .scheduler import Job, timings_of

STOP_TYPES = {"stop": "eos", "stop string": "word", "length": "limit", "context": "limit"}


def timings(job: Job, speculative: bool) -> dict:
    """llama-server's timings of a request: the prompt's (the tokens computed; cache_n:
    those resumed) and the generation's, whose rate leaves out the first token (it comes
    from the prompt's last batch, as llama-server counts it)."""
    return timings_of(job.stats, speculative)


def generation_settings(r: Reply) -> dict:
    server, job = r.server, r.job
    sampling = job.request.sampling
    request = r.prepared.request
    settings = {"n_predict": server.n_predict_of(request), "seed": sampling.seed if sampling else None,
                "stop": request.stops, "ignore_eos": request.ignore_eos, "stream": request.stream,
                "n_probs": request.probs_asked or 0,
                "post_sampling_probs": request.post_sampling,
                "cache_prompt": request.cache_prompt, "speculative": server.speculates}
    # as llama-server lists them: -inf (a token never picked; ignore_eos's end tokens) as null
    bias = (sampling.logit_bias or []) if sampling is not None else []
    settings["logit_bias"] = [{"bias": None if math.isinf(b) else b, "token": t} for t, b in bias]
    if sampling is not None:
        for name in ("temperature", "top_k", "top_p", "min_p", "repeat_penalty", "repeat_last_n", "presence_penalty",
                     "frequency_penalty"):
            settings[name] = getattr(sampling, name)
    return settings


def result_json(r: Reply, index: int = 0, content: Optional[str] = None) -> dict:
    """The whole result of a finished job (the last event of a stream, with content ""); an
    OpenAI route's `__verbose` too, whose request has no return_tokens or response_fields."""
    job, s = r.job, r.job.stats
    request = r.prepared.request
    text = job.text if content is None else content
    tokens = list(job.tokens) if getattr(request, "return_tokens", False) else []
    out = {"index": index, "content": text, "tokens": tokens,
           "id_slot": -1 if job.slot is None else job.slot, "stop": True, "model": r.server.model_id,
           "tokens_predicted": s.generated_tokens, "tokens_evaluated": s.prompt_tokens,
           "generation_settings": generation_settings(r),
           "prompt": r.server.engine.tokenizer.decode(r.prepared.tokens),
           # as llama-server's: the reply was cut by the end of the context
           "has_new_line": "\n" in job.text,
           "truncated": job.context_bound and s.stop_reason in ("length", "context")
           and s.generated_tokens >= job.request.max_tokens,
           "stop_type": STOP_TYPES.get(s.stop_reason, "none"),
           "stopping_word": s.stop_string or "", "tokens_cached": s.prompt_tokens + s.generated_tokens,
           "timings": timings(job, r.server.speculates)}
    probs = r.probs()
    if probs is not None and content is None:  # as llama-server's: not in a stream's last event
        out["completion_probabilities"] = probs.all(text)
    if getattr(request, "response_fields", None):
        return pick_fields(out, request.response_fields)
    return out


def pick_fields(result: dict, fields: List[str]) -> dict:
    """llama-server's response_fields: the fields named, "a/b" reaching into objects, each
    under its own name."""
    out = {}
    for name in fields:
        node = result
        for part in name.split("/"):
            if not isinstance(node, dict) or part not in node:
                node = None
                break
            node = node[part]
        if node is not None:
            out[name] = node
    return out


async def completion_stream(r: Reply):
    """Each piece of text as {"content", "tokens", "stop": false}, then the whole result
    with "stop": true."""
    sent = 0
    n_prompt = len(r.prepared.tokens)
    probs = r.probs()
    async for kind, value in r.events_of_job(ping=False):
        per_token = r.prepared.request.timings_per_token
        if kind == "progress":
            so_far = {"timings": timings_of(value.stats, r.server.speculates)} if per_token else {}
            yield chunk({"index": 0, "content": "", "tokens": [], "stop": False, "prompt_progress": value.as_dict(),
                         **so_far})
        elif kind == "text":
            upto = getattr(value, "upto", len(r.job.tokens))
            tokens, sent = list(r.job.tokens[sent:upto]), max(sent, upto)
            out = {"index": 0, "content": str(value), "tokens": tokens, "stop": False,
                   "id_slot": -1 if r.job.slot is None else r.job.slot, "tokens_predicted": upto,
                   "tokens_evaluated": n_prompt}
            entries = probs.take(value) if probs is not None else []
            if entries:
                out["completion_probabilities"] = entries
            if per_token:
                out["timings"] = timings(r.job, r.server.speculates)
            yield chunk(out)
        elif kind == "done":
            last = result_json(r, content="")
            entries = probs.rest() if probs is not None else []
            if entries:  # tokens whose text came last (an end-of-generation token): not lost
                last["completion_probabilities"] = entries
            yield chunk(last)
        else:
            status = 400 if isinstance(value, ValueError) else 500
            yield chunk({"error": {"code": status, "message": str(value),
                                   "type": "invalid_request_error" if status == 400 else "server_error"}})
