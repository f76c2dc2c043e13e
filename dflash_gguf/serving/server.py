"""dflash-server: an OpenAI- and Anthropic-compatible HTTP server over one Engine
(Starlette + uvicorn), with the endpoints and habits of llama-server.

POST /v1/chat/completions and /v1/completions (OpenAI; streamed as server-sent events
or not), POST /v1/messages and /v1/messages/count_tokens (Anthropic), GET /v1/models,
/props, /health and /metrics (Prometheus text), POST /tokenize and /detokenize. Chats
take tools and return tool calls and reasoning in the template's own formats
(chat/assistant.py). Requests wait in a bounded FIFO queue (serving.Scheduler), streamed
ones with SSE keep-alive comments; prompts sharing a prefix with earlier ones resume
from a prefix checkpoint (checkpoints.PrefixCheckpoints). Bad input gets a 400 in the
API's own error shape, a full queue a 503 with Retry-After; a client that goes away
stops its generation at the end of the prompt chunk or step in progress. Templating
and tokenizing run off the event loop.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import time
from dataclasses import dataclass, field, replace
from typing import Any, List, Optional, Sequence, Tuple

from ..chat import tool_grammar
from ..chat.assistant import Turn, prepare_turn
from ..decoding.requests import Request
from ..decoding.sampling import RULES, SamplingParams
from ..engine.args import (add_engine_args, demo_models, engine_mode, open_chat_engine, print_memory, resolve_context,
                           setup_devices, validate_engine_args)
from ..engine.engine import Engine
from . import openai_api
from .api_errors import BadRequest
from .llama_models import InfillRequest, NativeCompletionRequest
from .openai_models import ChatRequest, CompletionRequest, DetokenizeRequest, Generation, TokenizeRequest
from .probs import TokenPieces
from .scheduler import Job, Scheduler


@dataclass
class Defaults:
    """What a request that leaves a field out gets: the server's command-line flags."""

    sampling: SamplingParams
    max_tokens: Optional[int] = None  # None: until an end-of-generation token or the full context
    speculative: bool = True
    template_kwargs: dict = field(default_factory=dict)  # --chat-template-kwargs (and --reasoning-budget 0)
    reasoning_format: str = "auto"
    system_prompt: Optional[str] = None  # -sys: for chats that have no system message


# -- the application -------------------------------------------------------------------------

@dataclass
class Prepared:
    """A request made ready for the engine: its prompt tokens and, for a chat, the
    assistant's turn (how to read the reply) and the options it asked for."""

    request: Generation
    tokens: List[int]
    turn: Optional[Turn] = None
    options: Optional[openai_api.ChatOptions] = None


class Server:
    """Request handling over a Scheduler and its Engine."""

    def __init__(self, scheduler: Scheduler, model_id: str, defaults: Defaults, api_keys: Sequence[str] = (),
                 sse_ping_seconds: float = 30.0, model_path: str = "", aliases: Sequence[str] = (),
                 tags: Sequence[str] = (), metrics: bool = True, slots: bool = True, webui: bool = True,
                 verbose: bool = False):
        self.scheduler = scheduler
        self.engine: Engine = scheduler.engine
        self.model_id = model_id
        self.aliases = list(aliases)
        self.tags = list(tags)
        self.metrics_enabled = metrics  # /metrics (dflash-server --metrics)
        self.slots_enabled = slots  # /slots (--no-slots: off)
        self.verbose = verbose  # every reply carries `__verbose` (--verbose), else those that ask
        self.model_path = model_path
        self.defaults = defaults
        self.api_keys = list(api_keys)
        self.sse_ping_seconds = sse_ping_seconds
        self.started = int(time.time())
        self.shutting_down = False
        self.webui = webui  # the chat page at / (serving/webui; --no-webui: none)
        self.pieces = TokenPieces(self.engine.tokenizer)  # tokens' text for log-probabilities

    # -- prompts (run off the event loop: templates and tokenizers take time on big prompts) ---
    def completion_prompt(self, request: CompletionRequest) -> Prepared:
        if isinstance(request.prompt, str):
            return Prepared(request, self.engine.encode(request.prompt))
        self.check_token_ids(request.prompt, "prompt")
        return Prepared(request, list(request.prompt))

    def check_token_ids(self, tokens: list, param: str) -> None:
        n_vocab = self.engine.target.n_vocab
        bad = [t for t in tokens if not 0 <= t < n_vocab]
        if bad:
            raise BadRequest(f"token id {bad[0]} is outside the vocabulary (0..{n_vocab - 1})", param)

    def chat_prompt(self, request: ChatRequest) -> Prepared:
        """An OpenAI chat request (or an Anthropic one read as such) made ready."""
        options = openai_api.chat_options(request, self.defaults.template_kwargs, self.defaults.reasoning_format)
        opens_with_system = bool(options.messages) and options.messages[0]["role"] == "system"
        if self.defaults.system_prompt is not None and not opens_with_system:
            options.messages.insert(0, {"role": "system", "content": self.defaults.system_prompt})
        try:
            template = self.engine.chat_template(bool(options.tools))
            turn = prepare_turn(template, options.messages, tools=options.tools, tool_choice=options.tool_choice,
                                template_kwargs=options.template_kwargs, reasoning_format=options.reasoning_format)
        except ValueError as e:
            raise BadRequest(str(e), "messages") from None
        except RecursionError:  # a structure nested deeper than any template walks
            raise BadRequest("the messages or tools are nested too deeply", "messages") from None
        return Prepared(request, self.engine.encode(turn.prompt), turn, options)

    def make_job(self, prepared: Prepared, sink, corpus: Optional[str] = None, choice: int = 0) -> Job:
        """corpus: the request's suffix corpus key (a digest of its API key; None: none);
        choice: which of the request's n choices (a seeded one draws from seed + choice)."""
        request, tokens = prepared.request, prepared.tokens
        sampling = request.sampling.params(self.defaults.sampling)
        if choice and sampling.seed is not None:
            sampling = replace(sampling, seed=sampling.seed + choice)
        bias = self._logit_bias(request.logit_bias) if request.logit_bias else []
        if request.ignore_eos:
            # as llama-server: the end-of-generation tokens are never picked (a bias of -inf,
            # in the target's pick only: speculation stays lossless)
            bias += [(t, float("-inf")) for t in sorted(self.engine.tokenizer.eog_ids)]
        if bias:
            sampling = replace(sampling, logit_bias=bias)
        constraint = request.constraint.compiled
        turn, options = prepared.turn, prepared.options
        if turn is not None and turn.tool_format:
            calls = self._call_constraint(turn, options)
            if calls is not None and constraint is not None:
                raise BadRequest("a response format or grammar cannot be combined with strict tools or a required "
                                 "tool call", "response_format")
            constraint = constraint or calls
        if constraint is not None and turn is not None and turn.starts_thinking and constraint.lazy_from is None \
                and not constraint.prefix:
            # the reply thinks first: the grammar holds the answer after the thinking block
            constraint = replace(constraint, after=turn.thinking.close)
        if constraint is not None:
            sampling = replace(sampling, constraint=constraint)
        stops = request.stops
        if turn is not None and turn.tool_format and not options.parallel_tool_calls:
            stops.append(turn.call_close())  # one call: generation ends where it closes
        n_ctx = self.engine.target.n_ctx
        field_ = "max_completion_tokens" if request.max_completion_tokens is not None else "max_tokens"
        asked = getattr(request, field_)
        if asked is None:
            asked = self.defaults.max_tokens
        room = n_ctx - len(tokens)
        if room <= 0:  # llama-server's words and error type
            raise BadRequest(f"request ({len(tokens)} tokens) exceeds the available context size ({n_ctx} tokens), "
                             "try increasing it", "messages" if isinstance(request, ChatRequest) else "prompt",
                             kind="exceed_context_size_error", extra={"n_prompt_tokens": len(tokens), "n_ctx": n_ctx})
        # as llama-server does: a limit past the context's end is clamped to the room left,
        # and a reply that reaches the end stops there with finish_reason "length"
        max_tokens = room if asked is None else min(asked, room)
        try:
            self.engine.check_request(tokens, max_tokens, speculative=self.defaults.speculative, context_full="stop")
        except ValueError as e:
            raise BadRequest(str(e), field_) from None
        job = Job(Request(tokens, max_tokens, stop_tokens=() if request.ignore_eos else None, sampling=sampling,
                          context_full="stop", reuse_prefix=request.cache_prompt, corpus=corpus,
                          logprobs=request.probs_asked,
                          post_sampling=request.post_sampling),
                  sink, stop=stops, speculative=self.defaults.speculative, want_slot=getattr(request, "id_slot", None))
        job.context_bound = asked is None or asked > room  # it may run until the context is full
        job.progress = request.stream and request.return_progress
        return job

    def _logit_bias(self, pairs) -> List[Tuple[int, float]]:
        """A request's logit_bias pairs as (token id, bias): a text's tokens each (as
        llama-server tokenizes it: no BOS, no special tokens); an id outside the vocabulary
        is refused."""
        n_vocab = self.engine.target.n_vocab
        out = []
        for key, bias in pairs:
            ids = self.engine.tokenizer.encode(key, add_bos=False, special=False) if isinstance(key, str) else [key]
            for t in ids:
                if not 0 <= t < n_vocab:
                    raise BadRequest(f"logit_bias: token {t} is outside the vocabulary (0..{n_vocab - 1})",
                                     "logit_bias")
                out.append((t, bias))
        return out

    def _call_constraint(self, turn, options):
        """The grammar of the turn's tool calls (strict tools, a required call), or None."""
        vocab = self.engine.grammar_vocab() if tool_grammar.wanted(turn.tools, options.tool_choice) else None

        def special(text: str):
            ids = self.engine.tokenizer.encode(text, add_bos=False)
            return ids[0] if len(ids) == 1 and vocab.lltokenizer.is_special_token(ids[0]) else None

        try:
            return tool_grammar.call_constraint(turn.tool_format, turn.tools, options.tool_choice,
                                                options.parallel_tool_calls, turn.primed, special)
        except ValueError as e:
            raise BadRequest(f"the tools' parameters make no grammar: {e}", "tools") from None

    # -- llama-server's native API ----------------------------------------------------------------
    @property
    def speculates(self) -> bool:
        """Whether requests are decoded speculatively (a drafter or a drafting kind)."""
        e = self.engine
        return self.defaults.speculative and (e.draft is not None or e.simple_draft is not None
                                              or e.suffix_corpora is not None)

    def n_predict_of(self, request: Generation) -> int:
        """The token limit a request runs under, as llama-server reports it (-1: none)."""
        field_ = "max_completion_tokens" if request.max_completion_tokens is not None else "max_tokens"
        asked = getattr(request, field_)
        if asked is None:  # -n is the default of a request that gives none, as llama-server's
            asked = self.defaults.max_tokens
        return -1 if asked is None else asked

    def parts_tokens(self, parts: list) -> List[int]:
        """A native prompt's parts (texts and token ids) as tokens: a text is tokenized
        where it stands, with the tokenizer's BOS only when it opens the prompt."""
        tokens: List[int] = []
        for i, part in enumerate(parts):
            if isinstance(part, str):
                tokens += self.engine.tokenizer.encode(part, add_bos=None if i == 0 else False)
            else:
                tokens.append(part)
        self.check_token_ids([t for t in tokens], "prompt")
        if not tokens:
            raise BadRequest("'prompt' is empty", "prompt")
        return tokens

    def native_prompts(self, request: NativeCompletionRequest) -> List[Prepared]:
        """/completion's prompts (one, or a batch), each made ready."""
        return [Prepared(request, self.parts_tokens(parts)) for parts in request.prompts]

    def infill_prompt(self, request: InfillRequest) -> Prepared:
        """/infill's prompt in the repo-level fill-in-the-middle pattern llama-server
        writes: [FIM_REP]myproject, each extra file as [FIM_SEP]name and its text,
        [FIM_SEP]filename, then [FIM_PRE]prefix prompt [FIM_SUF]suffix [FIM_MID] (prefix and
        suffix cut to 3/4 and 1/4 of a -b batch, the extra files to what the context leaves)."""
        tok = self.engine.tokenizer
        fim = tok.fim_tokens()
        missing = "".join(f"{what} token is missing. " for what, key in
                          (("prefix", "pre"), ("suffix", "suf"), ("middle", "mid")) if fim[key] < 0)
        if missing:
            raise BadRequest(f"Infill is not supported by this model: {missing}", status=501,
                             kind="not_supported_error")

        def enc(text: str) -> List[int]:
            return tok.encode(text, add_bos=False, special=False)

        extra: List[int] = []
        if fim["rep"] >= 0:
            extra += [fim["rep"]] + enc("myproject\n")
        for chunk in request.input_extra:
            if fim["sep"] >= 0:
                extra += [fim["sep"]] + enc((chunk.filename or "tmp") + "\n")
            else:
                extra += enc("\n\n--- snippet ---\n\n")
            extra += enc(chunk.text)
        if fim["sep"] >= 0:
            extra += [fim["sep"]] + enc("filename\n")
        prompt = tok.encode(request.prompt, add_bos=False) if request.prompt else []
        prefix, suffix = enc(request.input_prefix), enc(request.input_suffix)
        n_batch = self.scheduler.n_batch or 2048
        n_ctx = self.engine.target.n_ctx
        n_predict = -1 if self.defaults.max_tokens is None else self.defaults.max_tokens
        prefix = prefix[len(prefix) - min(len(prefix), 3 * (n_batch // 4)):]
        suffix = suffix[:min(len(suffix), max(0, n_batch // 4 - (2 + len(prompt))))]
        n_extra = min(max(0, n_ctx - n_batch - 2 * n_predict), len(extra))
        head = [fim["pre"]] + prefix + prompt
        if tok.add_bos:
            head = [tok.bos_id] + head
        tokens = (extra[len(extra) - n_extra:] if n_extra else []) + head + [fim["suf"]] + suffix + [fim["mid"]]
        return Prepared(request, tokens)

    def apply_template(self, request) -> dict:
        """/apply-template: the chat's prompt, rendered and not run (an ApplyTemplateRequest)."""
        if request.add_generation_prompt:
            return {"prompt": self.chat_prompt(request).turn.prompt}
        options = openai_api.chat_options(request, self.defaults.template_kwargs, self.defaults.reasoning_format)
        try:
            template = self.engine.chat_template(bool(options.tools))
            return {"prompt": template.render(options.messages, tools=options.tools or None,
                                              add_generation_prompt=False, **options.template_kwargs)}
        except ValueError as e:
            raise BadRequest(str(e), "messages") from None
        except RecursionError:
            raise BadRequest("the messages or tools are nested too deeply", "messages") from None

    def slots(self) -> list:
        """/slots: each slot's state, as llama-server's lists them."""
        running = {slot: run.job for slot, run in self.scheduler.running_jobs().items()}
        n_ctx = self.engine.target.n_ctx
        out = []
        for slot in range(self.scheduler.n_slots):
            job = running.get(slot)
            out.append({"id": slot, "id_task": -1 if job is None else id(job) & 0x7fffffff, "n_ctx": n_ctx,
                        "speculative": self.defaults.speculative and (self.engine.draft is not None
                                                                      or self.engine.simple_draft is not None),
                        "is_processing": job is not None,
                        "next_token": [{"has_next_token": job is not None,
                                        "n_remain": -1 if job is None else job.request.max_tokens - len(job.tokens),
                                        "n_decoded": 0 if job is None else len(job.tokens)}]})
        return out

    def tokenize(self, request: TokenizeRequest) -> dict:
        tok = self.engine.tokenizer
        ids = tok.encode(request.content, add_bos=request.add_special, special=request.parse_special)
        if not request.with_pieces:
            return {"tokens": ids}
        pieces = []
        for t in ids:
            raw = tok.token_bytes([t])
            try:
                piece: Any = raw.decode("utf-8")
            except UnicodeDecodeError:  # part of a character: its bytes, as llama-server gives them
                piece = list(raw)
            pieces.append({"id": t, "piece": piece})
        return {"tokens": pieces}

    def detokenize(self, request: DetokenizeRequest) -> dict:
        self.check_token_ids(request.tokens, "tokens")
        return {"content": self.engine.tokenizer.decode(request.tokens)}

    def props(self) -> dict:
        """What the server runs, as llama-server's /props says it (with our own additions)."""
        from ..chat.templates import gguf_templates

        engine, d = self.engine, self.defaults
        tok = engine.tokenizer
        templates = gguf_templates(tok)
        try:
            template = engine.chat_template().source
        except ValueError:
            template = None
        s = d.sampling
        return {
            "model_alias": self.model_id, "model_path": self.model_path, "total_slots": self.scheduler.n_slots,
            "default_generation_settings": {
                "n_ctx": engine.target.n_ctx,
                "params": {**{rule.field: getattr(s, rule.field) for rule in RULES}, "seed": s.seed,
                           "n_predict": -1 if d.max_tokens is None else d.max_tokens}},
            "chat_template": template,
            "chat_template_tool_use": templates.get("tool_use"), "chat_template_kwargs": d.template_kwargs,
            "reasoning_format": d.reasoning_format,
            "bos_token": tok.bos_text, "eos_token": tok.eos_text,
            "modalities": {"vision": False, "audio": False},
            "speculative": {"drafter": (engine.draft is not None or engine.simple_draft is not None) and d.speculative,
                            "block_size": engine.block_size, "tree_budget": engine.tree_budget,
                            "auto_budget": engine.auto_budget,
                            "mode": engine_mode(engine, engine.tree_budget) if d.speculative else "autoregressive"},
            "ui": self.webui,
            # whether greedy speculation is bit-identical to plain decoding here (--exact)
            "exact": engine.exact.as_dict(),
        }

    # -- responses ---------------------------------------------------------------------------
    @staticmethod
    def usage(job: Job) -> dict:
        s = job.stats
        return {"prompt_tokens": s.prompt_tokens, "completion_tokens": s.generated_tokens,
                "total_tokens": s.prompt_tokens + s.generated_tokens,
                "prompt_tokens_details": {"cached_tokens": s.reused_tokens}}

    @staticmethod
    def timings(job: Job) -> dict:
        """llama-server's `timings` of a reply: the prompt tokens computed (prompt_n; cache_n
        read from the context or a checkpoint) and generated (predicted_n), their times and
        rates, and where anything was drafted, draft_n tokens drafted and draft_n_accepted
        of them accepted."""
        s = job.stats
        prompt_n, prompt_ms = s.prompt_tokens - s.reused_tokens, s.prefill_seconds * 1e3
        predicted_ms = s.decode_seconds * 1e3
        out = {"cache_n": s.reused_tokens,
               "prompt_n": prompt_n, "prompt_ms": round(prompt_ms, 3),
               "prompt_per_token_ms": round(prompt_ms / prompt_n, 3) if prompt_n else 0.0,
               "prompt_per_second": round(s.prefill_tps, 3),
               "predicted_n": s.generated_tokens, "predicted_ms": round(predicted_ms, 3),
               "predicted_per_token_ms": round(predicted_ms / s.generated_tokens, 3) if s.generated_tokens else 0.0,
               "predicted_per_second": round(s.decode_tps, 3)}
        if s.drafted_tokens > 0:
            out.update(draft_n=s.drafted_tokens, draft_n_accepted=s.accepted_drafts)
        return out

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
            "mean_tree_nodes": round(s.trees.mean_nodes, 3) if s.trees.sizes else None,
            "tree_sizes": list(s.trees.sizes),
            "auto": s.trees.auto,
            # the weightless kinds' drafts (suffix, the n-gram kinds), per kind
            "drafts": s.drafts.per_kind(),
            "suffix_corpus_drafts": {"drafted": s.drafts.corpus_drafted, "accepted": s.drafts.corpus_accepted},
            "prefill_seconds": round(s.prefill_seconds, 5),
            "decode_seconds": round(s.decode_seconds, 5),
            "decode_tokens_per_second": round(s.decode_tps, 2),
            # the speculative steps' time by phase: drafting, the target's verify (its graph
            # and choices), and the rest (proposing, accepting, committing, the Python
            # around them); a batched step's time counts for each of its sequences
            "step_seconds": {"draft": round(s.draft_seconds, 5), "verify": round(s.verify_seconds, 5),
                             "other": round(s.other_seconds, 5)},
            "queue_seconds": round(job.times.queue_seconds, 5),
            # on the server's monotonic clock: when the scheduler took the request in and
            # when it started running it (FIFO: in the order taken in)
            "queued_at": round(job.times.queued_at, 6),
            "started_at": None if job.times.started_at is None else round(job.times.started_at, 6),
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
        metric("exact", "gauge", "1 when greedy speculation is bit-identical to plain decoding on this engine's "
                                 "devices (exact: yes), else 0; /props says why", int(self.engine.exact.exact == "yes"))
        metric("requests_failed_total", "counter", "Requests that ended with an error.", t.failed)
        metric("requests_cancelled_total", "counter", "Requests whose client went away.", t.cancelled)
        metric("requests_refused_total", "counter", "Requests refused because the queue was full.", t.refused)
        metric("queue_depth", "gauge", "Requests waiting for the engine.", self.scheduler.queue_depth)
        metric("requests_running", "gauge", "Requests on the engine.", self.scheduler.running)
        metric("slots", "gauge", "Requests the engine runs at once (-np).", self.scheduler.n_slots)
        metric("prompt_tokens_total", "counter", "Prompt tokens received.", t.prompt_tokens)
        metric("prompt_tokens_reused_total", "counter", "Prompt tokens not computed (a checkpoint or the context).",
               t.reused_tokens)
        metric("generated_tokens_total", "counter", "Tokens generated.", t.generated_tokens)
        metric("prefill_seconds_total", "counter", "Time spent computing prompts.", round(t.prefill_seconds, 6))
        metric("prefill_chunks_total", "counter", "Prompt chunks computed (of up to -ub tokens each).",
               t.prefill_chunks)
        metric("decode_seconds_total", "counter", "Time spent generating.", round(t.decode_seconds, 6))
        metric("decode_tokens_per_second", "gauge", "Generated tokens per second of generation, over all requests.",
               round(t.generated_tokens / t.decode_seconds, 3) if t.decode_seconds > 0 else 0)
        metric("target_passes_total", "counter", "Target verify passes of speculative decoding.", t.target_passes)
        metric("mean_accepted_length", "gauge", "Tokens per target pass (AL), over all requests.",
               round(t.accepted_tokens / t.target_passes, 4) if t.target_passes else 0)
        for name, counts, help_ in (("drafted_tokens_total", t.drafts.drafted, "Tokens drafted, by kind (a drafter "
                                                                               "model's, weightless, draft-simple; a "
                                                                               "tree's nodes below its root)."),
                                    ("accepted_drafts_total", t.drafts.accepted,
                                     "Drafted tokens accepted, by kind.")):
            lines.extend([f"# HELP dflash_{name} {help_}", f"# TYPE dflash_{name} counter"]
                         + [f'dflash_{name}{{kind="{k}"}} {n}' for k, n in sorted(counts.items())])
        metric("suffix_corpus_drafted_tokens_total", "counter",
               "Of suffix's drafted tokens, those from the corpus of earlier requests under the same key.",
               t.drafts.corpus_drafted)
        metric("suffix_corpus_accepted_drafts_total", "counter",
               "Of suffix's accepted drafts, those from the corpus of earlier requests under the same key.",
               t.drafts.corpus_accepted)
        corpora = self.engine.suffix_corpora
        metric("suffix_corpus_bytes", "gauge", "Memory the suffix corpora hold (estimated per indexed token).",
               corpora.nbytes if corpora else 0)
        metric("suffix_corpus_evictions_total", "counter", "Suffix corpus documents dropped to stay in the bound.",
               corpora.evicted if corpora else 0)
        metric("checkpoint_hits_total", "counter", "Prompts resumed from a prefix checkpoint.", ck.hits if ck else 0)
        metric("checkpoint_misses_total", "counter", "Prompts with no usable prefix checkpoint.",
               ck.misses if ck else 0)
        metric("checkpoints", "gauge", "Prefix checkpoints kept.", len(ck) if ck else 0)
        lines.extend(["# HELP dflash_checkpoint_bytes Memory the prefix checkpoints hold, by where it is.",
                      "# TYPE dflash_checkpoint_bytes gauge",
                      f'dflash_checkpoint_bytes{{where="device"}} {ck.device_nbytes if ck else 0}',
                      f'dflash_checkpoint_bytes{{where="host"}} {ck.host_nbytes if ck else 0}',
                      # host memory kept for the checkpoints besides their state: records, keys, padding
                      f'dflash_checkpoint_bytes{{where="overhead"}} {ck.overhead_nbytes if ck else 0}'])
        metric("checkpoint_device_budget_bytes", "gauge", "Device memory the prefix checkpoints may take.",
               ck.device_budget_bytes if ck else 0)
        metric("checkpoint_evictions_total", "counter", "Checkpoints dropped to stay in the budget.",
               ck.evicted if ck else 0)
        lines += self.llamacpp_metrics()
        rss = resident_bytes()
        if rss is not None:  # Prometheus' standard process metric: leak checks read it beside the checkpoints' bytes
            lines.extend(["# HELP process_resident_memory_bytes Resident memory of the server process.",
                          "# TYPE process_resident_memory_bytes gauge", f"process_resident_memory_bytes {rss}"])
        return "\n".join(lines) + "\n"

    def llamacpp_metrics(self) -> List[str]:
        """llama-server's metrics, under its names (llamacpp:*), from the same totals."""
        t = self.scheduler.totals
        computed = t.prompt_tokens - t.reused_tokens
        speculative = self.speculates
        counters = [
            ("prompt_tokens_total", "Number of prompt tokens processed, excluding cached tokens", computed),
            ("prompt_tokens_cached_total", "Number of prompt tokens reused from the cache", t.reused_tokens),
            ("prompt_seconds_total", "Total time spent processing prompts", round(t.prefill_seconds, 6)),
            ("tokens_predicted_total", "Number of generation tokens processed", t.generated_tokens),
            ("tokens_predicted_seconds_total", "Total time spent generating tokens", round(t.decode_seconds, 6)),
            ("n_decode_total", "Total number of target graphs (prompt chunks and decoding steps)",
             t.prefill_chunks + t.rounds),
            ("n_tokens_max", "Largest observed sequence length (prompt + generation)", t.n_tokens_max),
            ("spec_decode_num_draft_tokens_total", "Speculative: Total draft tokens generated",
             sum(t.drafts.drafted.values())),
            ("spec_decode_num_accepted_tokens_total", "Speculative: Total draft tokens accepted by the target model",
             sum(t.drafts.accepted.values())),
            ("spec_decode_num_drafts_total", "Speculative: Total speculative decoding verification steps",
             t.target_passes if speculative else 0),
        ]
        gauges = [
            ("prompt_tokens_seconds", "Average prompt throughput in tokens/s",
             round(computed / t.prefill_seconds, 3) if t.prefill_seconds > 0 else 0),
            ("predicted_tokens_seconds", "Average generation throughput in tokens/s",
             round(t.generated_tokens / t.decode_seconds, 3) if t.decode_seconds > 0 else 0),
            ("requests_processing", "Number of requests processing", self.scheduler.running),
            ("requests_deferred", "Number of requests deferred", self.scheduler.queue_depth),
            ("n_busy_slots_per_decode", "Average number of busy slots per decoding round",
             round(t.busy_slots / max(t.rounds, 1), 4)),
        ]
        lines = []
        for kind, items in (("counter", counters), ("gauge", gauges)):
            for name, help_, value in items:
                lines += [f"# HELP llamacpp:{name} {help_}", f"# TYPE llamacpp:{name} {kind}",
                          f"llamacpp:{name} {value}"]
        return lines


def resident_bytes() -> Optional[int]:
    """This process's resident memory now (not its peak, which getrusage gives), or None
    where /proc does not say (not Linux)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


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


def slot_log(line: str) -> None:
    """A slot's event (--verbose), on stderr beside the server's other lines."""
    print(f"dflash-server: {line}", file=sys.stderr, flush=True)


def checkpoint_budget(args, plan) -> Tuple[int, int]:
    """(total, device) bytes for prefix checkpoints: --checkpoint-mib, and of it
    --checkpoint-device-mib, or with auto what the memory plan leaves on the devices."""
    from ..runtime.checkpoints import device_room

    total = args.checkpoint_mib << 20
    device = device_room(plan) if args.checkpoint_device_mib is None else args.checkpoint_device_mib << 20
    return total, min(device, total)


def build_parser() -> argparse.ArgumentParser:
    from ..chat.flags import add_chat_args

    p = argparse.ArgumentParser(
        prog="dflash-server",
        description="Serve a GGUF model, sped up by a DFlash drafter, over the OpenAI and Anthropic HTTP APIs "
                    "(/v1/chat/completions, /v1/completions, /v1/messages, /v1/models, /props, /tokenize, "
                    "/detokenize, /health, /metrics). With no -m, serves the bundled demo. See docs/serving.md.")
    add_engine_args(p)
    add_chat_args(p)
    p.add_argument("-sys", "--system-prompt", metavar="TEXT",
                   help="system message for chats that have none")
    p.add_argument("--host", default="127.0.0.1",
                   help="addresses to listen on, comma-separated (default 127.0.0.1; '::1' or '[::1]' for IPv6)")
    p.add_argument("--port", type=int, default=8080, help="port to listen on (default 8080)")
    p.add_argument("-n", "--n-predict", type=int,
                   help="max_tokens of a request that gives none (default, or -1: until the end of generation or "
                        "a full context)")
    p.add_argument("--api-key", metavar="KEY[,KEY...]",
                   help="require one of these keys ('Authorization: Bearer KEY' or 'x-api-key: KEY'); other "
                        "requests get 401 (/health stays open)")
    p.add_argument("--sse-ping-interval", type=float, default=30.0, metavar="SECONDS",
                   help="a streamed reply that has sent nothing for this long (waiting in the queue, a long "
                        "prefill) gets a keep-alive comment (default 30; 0 or less: none)")
    p.add_argument("-np", "--parallel", type=int, default=1, metavar="N",
                   help="requests decoded at once, in N sequence slots sharing the -c context (each -c / N "
                        "positions, as llama-server's -np), batched into one drafter and one target graph per "
                        "step; a new request joins at a step boundary (default 1)")
    p.add_argument("-kvu", "--kv-unified", action="store_true",
                   help="each of -np's slots may hold the whole -c context, as llama-server's unified cache lets a "
                        "request use it all; the slots' positions stay apart here, so the cache holds -np times -c "
                        "positions (--print-memory shows what that costs)")
    p.add_argument("--queue", type=int, default=16,
                   help="requests that may wait for a free slot; more get 503 with Retry-After (default 16)")
    p.add_argument("--checkpoint-mib", "-cram", "--cache-ram", type=int, default=1024, metavar="MIB",
                   help="memory for prefix checkpoints (the prompt cache), device and host together, in MiB "
                        "(default 1024; 0: none; -1: up to the host's memory)")
    p.add_argument("--cache-idle-slots", action=argparse.BooleanOptionalAction, default=True,
                   help="when a request starts, checkpoint the whole context of every other idle slot, so that its "
                        "conversation resumes wherever its next request lands (default: on, with checkpoints); a "
                        "slot's own context is checkpointed before a prompt that does not go on from it either way")
    p.add_argument("--checkpoint-device-mib", type=_mib_or_auto, default=None, metavar="MIB|auto",
                   help="how much of it may be device memory, in MiB, or auto (default): what the memory plan "
                        "leaves free on the device, less 512 MiB; beyond it checkpoints go to host memory")
    p.add_argument("--checkpoint-every", type=int, default=512,
                   help="checkpoint long prompts every N tokens, besides their end (default 512)")
    p.add_argument("-a", "--alias",
                   help="model names, comma-separated: the first (in sorted order, as llama-server) is the model's id "
                        "in /v1/models and responses, all are listed in its 'aliases' (default: the file name)")
    p.add_argument("--tags", help="model tags, comma-separated (informational: listed in /v1/models' 'tags')")
    p.add_argument("--metrics", action="store_true",
                   help="serve /metrics (Prometheus text: llama-server's llamacpp:* metrics and dflash_*); without, "
                        "/metrics answers 501, as llama-server's")
    p.add_argument("--slots", dest="slots", action="store_true", default=True,
                   help="serve /slots, each slot's state (default)")
    p.add_argument("--no-slots", dest="slots", action="store_false", help="/slots answers 501")
    p.add_argument("--cors-origins", default="localhost", metavar="ORIGINS",
                   help="origins whose web pages may read replies (CORS), comma-separated, or 'localhost' (default): "
                        "an Origin of http(s)://localhost, 127.0.0.1 or [::1] on any port; '*': any web page, as "
                        "llama-server's default (which lets every site its user visits read a local server)")
    p.add_argument("--cors-methods", default="GET, POST, DELETE, OPTIONS", metavar="METHODS",
                   help="Access-Control-Allow-Methods of a preflight (default 'GET, POST, DELETE, OPTIONS')")
    p.add_argument("--cors-headers", default="*", metavar="HEADERS",
                   help="Access-Control-Allow-Headers of a preflight (default '*')")
    p.add_argument("--cors-credentials", dest="cors_credentials", action="store_true", default=True,
                   help="Access-Control-Allow-Credentials: true on a preflight (default)")
    p.add_argument("--no-cors-credentials", dest="cors_credentials", action="store_false")
    p.add_argument("--shutdown-timeout", type=float, default=60.0,
                   help="on Ctrl-C / SIGTERM, seconds to let running and queued requests finish (default 60)")
    p.add_argument("--print-memory", action="store_true",
                   help="print the memory plan of this configuration per device and the prefix checkpoints' "
                        "share (nothing is loaded) and exit; with --json as JSON on stdout")
    p.add_argument("--json", action="store_true", help="--print-memory as JSON")
    p.add_argument("--webui", "--ui", dest="webui", action="store_true", default=True,
                   help="serve the chat page at / (default)")
    p.add_argument("--no-webui", "--no-ui", dest="webui", action="store_false",
                   help="no chat page: / answers 404 (llama-server's --no-webui)")
    p.add_argument("-v", "--verbose", action="store_true",
                   help="every reply carries `__verbose`, its native result (the prompt as text, tokens, settings, "
                        "timings), as llama-server's --verbose; a request's \"verbose\": true asks for it alone; "
                        "the slots' prompt-cache events are logged to stderr")
    p.add_argument("--log-level", default="warning", choices=["critical", "error", "warning", "info", "debug"],
                   help="uvicorn's log level (default warning; info logs every request)")
    return p


def listening_sockets(hosts: Sequence[str], port: int) -> list:
    """A bound socket per --host address (IPv6 ones IPv6 only, as llama-server's), for
    uvicorn to serve on all of them."""
    import socket

    out = []
    for host in hosts:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        sock.bind((host, port))
        out.append(sock)
    return out


def fix_mmap_threshold(threshold: int = 128 << 10) -> bool:
    """Have glibc map every allocation above `threshold` bytes on its own. By default the
    threshold rises to the largest block freed so far, and a server's checkpoint store,
    freeing and allocating buffers of every size, then carves them from the heap, which
    fragments: the soak measured resident memory less checkpoints +3.4% over 1,000
    requests with the default and +1.2% with a fixed threshold. False where the C
    library has no mallopt (not glibc)."""
    import ctypes

    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    m_mmap_threshold = -3  # glibc's <malloc.h>
    return bool(mallopt(m_mmap_threshold, int(threshold)))


def main(argv: Optional[Sequence[str]] = None) -> int:
    from ..chat.flags import validate_chat_args
    from ..runtime.checkpoints import PrefixCheckpoints

    parser = build_parser()
    args = parser.parse_args(argv)
    fix_mmap_threshold()
    if not setup_devices(args, "dflash-server"):
        return args.exit_code
    validate_engine_args(args, parser)
    validate_chat_args(args, parser)
    api_keys = [k.strip() for k in (args.api_key or "").split(",") if k.strip()]
    if args.api_key is not None and not api_keys:
        parser.error("--api-key needs at least one key")
    if not 0 <= args.port <= 65535:
        parser.error("--port must be 0..65535")
    hosts = [h.strip().removeprefix("[").removesuffix("]") for h in args.host.split(",") if h.strip()]
    if not hosts:
        parser.error("--host needs an address")
    if args.queue < 0:
        parser.error("--queue must be >= 0")
    if args.checkpoint_mib == -1:  # llama-server's "no limit": the host's memory bounds it
        args.checkpoint_mib = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") >> 20
    if args.checkpoint_mib < 0:
        parser.error("--checkpoint-mib/--cache-ram must be >= 0, or -1 for the host's memory")
    if args.checkpoint_every < 1:
        parser.error("--checkpoint-every must be >= 1")
    if args.n_predict is not None and args.n_predict < -1:
        parser.error("-n/--n-predict must be >= 0, or -1 for no limit")
    if args.n_predict == -1:
        args.n_predict = None
    try:
        import starlette  # noqa: F401
        import uvicorn
    except ImportError:
        print("dflash-server: error: the server needs starlette and uvicorn: pip install 'dflash-gguf[server]'",
              file=sys.stderr)
        return 1

    model, draft = args.model, args.model_draft
    if model is None:
        paths = demo_models("dflash-server", draft, args.spec_type)
        if paths is None:
            return 1
        model, draft = paths
    if not resolve_context("dflash-server", model, args):
        return 1
    if args.print_memory:
        return print_memory("dflash-server", model, None if args.no_spec else draft, args,
                            lambda plan: checkpoint_budget(args, plan))
    engine = open_chat_engine("dflash-server", model, None if args.no_spec else draft, args)
    if isinstance(engine, int):
        return engine
    if args.checkpoint_mib:
        total, device = checkpoint_budget(args, engine.memory_plan)
        engine.checkpoints = PrefixCheckpoints(total, args.checkpoint_every, device)
    scheduler = Scheduler(engine, args.queue, args.batch_size, keep_idle=args.cache_idle_slots,
                          log=slot_log if args.verbose else lambda line: None)
    aliases = sorted({a.strip() for a in (args.alias or "").split(",") if a.strip()})
    model_id = aliases[0] if aliases else os.path.basename(model)
    tags = [t.strip() for t in (args.tags or "").split(",") if t.strip()]
    defaults = Defaults(args.sampling, args.n_predict, template_kwargs=args.template_kwargs,
                        reasoning_format=args.reasoning_format, system_prompt=args.system_prompt)
    server = Server(scheduler, model_id, defaults, api_keys, args.sse_ping_interval, model, aliases=aliases, tags=tags,
                    metrics=args.metrics, slots=args.slots, webui=args.webui, verbose=args.verbose)
    from .routes import create_app

    app = create_app(server, cors={"origins": args.cors_origins, "methods": args.cors_methods,
                                   "headers": args.cors_headers, "credentials": args.cors_credentials})
    config = uvicorn.Config(app, host=hosts[0], port=args.port, log_level=args.log_level,
                            timeout_graceful_shutdown=args.shutdown_timeout, access_log=args.log_level == "info")
    mode = engine_mode(engine, args.tree_budget)
    on_device = engine.checkpoints.device_budget_bytes >> 20 if engine.checkpoints else 0
    slots = f"{engine.target.n_seq} slots of context {engine.target.n_ctx}" if engine.target.n_seq > 1 \
        else f"context {engine.target.n_ctx}"
    print(f"dflash-server: serving {model_id} ({mode}, {slots}, queue {args.queue}, "
          f"checkpoints {args.checkpoint_mib} MiB, up to {on_device} MiB of it on the device"
          + (", API key required" if api_keys else "") + ") on "
          + ", ".join(f"http://{'[' + h + ']' if ':' in h else h}:{args.port}" for h in hosts)
          + ("" if args.webui else " (no chat page: --no-webui)"),
          file=sys.stderr, flush=True)
    try:
        _uvicorn_server_class()(config).run(sockets=listening_sockets(hosts, args.port) if len(hosts) > 1 else None)
    finally:
        scheduler.close()
        engine.close()
    print("dflash-server: stopped", file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
