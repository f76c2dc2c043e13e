"""Servers under test: dflash-server as a process (its flags, a free port) and the
app in process over a scripted engine, with the chat helpers both use."""
from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import threading
import time

import anthropic
import httpx
from openai import OpenAI

from dflash_gguf.serving import openai_api
from dflash_gguf.serving.api_errors import validated
from dflash_gguf.engine.engine import Engine
from dflash_gguf.serving.openai_models import ChatRequest
from dflash_gguf.decoding.sampling import SamplingParams
from dflash_gguf.serving.routes import create_app
from dflash_gguf.serving.server import Defaults, Server
from dflash_gguf.serving.scheduler import Scheduler


N_CTX = 2048
UBATCH = 32
SERVER_FLAGS = ["-c", str(N_CTX), "-ub", str(UBATCH), "-t", "1", "--checkpoint-every", str(UBATCH),
                "--checkpoint-mib", "64"]


# llama-server habits, accepted (see docs/serving.md for what each means here)
HABITS = ["-fa", "on", "--jinja", "-n", "-1"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    def __init__(self, tmp_path, *flags: str):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(tmp_path / f"server-{self.port}.log", "w+")
        self.proc = subprocess.Popen([sys.executable, "-m", "dflash_gguf.serving.server", "--port", str(self.port),
                                      "--metrics", *flags],
                                     stdout=self.log, stderr=subprocess.STDOUT, cwd=tmp_path)  # not the source tree
        self.http = httpx.Client(base_url=self.url, trust_env=False, timeout=120)
        deadline = time.time() + 120
        while True:
            assert self.proc.poll() is None, f"the server exited: {self.output()}"
            try:
                if self.http.get("/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.time() < deadline, f"the server did not start: {self.output()}"
            time.sleep(0.2)
        self.client = OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0,
                             http_client=httpx.Client(trust_env=False, timeout=120))

    def output(self) -> str:
        self.log.flush()
        self.log.seek(0)
        return self.log.read()

    def metrics(self) -> dict:
        out = {}
        for line in self.http.get("/metrics").text.splitlines():
            if line and not line.startswith("#"):
                name, value = line.split()
                out[name] = float(value)
        return out

    def greedy_texts(self, prompts, max_tokens: int) -> list:
        """Every prompt's greedy completion (max_tokens, end of generation ignored) asked
        by concurrent clients, then the server stopped and checked to exit cleanly: the
        answers, in the prompts' order."""
        from concurrent.futures import ThreadPoolExecutor

        def ask(text):
            r = self.http.post("/v1/completions", json={"prompt": text, "max_tokens": max_tokens, "temperature": 0,
                                                        "ignore_eos": True})
            assert r.status_code == 200, r.text
            return r.json()

        try:
            with ThreadPoolExecutor(len(prompts)) as pool:
                answers = list(pool.map(ask, prompts))
        finally:
            self.stop()
        assert self.proc.returncode == 0 and "Traceback" not in self.text, self.text
        return answers

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.http.close()
        self.text = self.output()
        self.log.close()


WEATHER = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


class ScriptedEngine:
    """The demo engine (tokenizer, templates, text streams, context checks) whose replies
    come from `replies`, two tokens per step, instead of its decoding; `prompts` records
    each prompt's text. The scheduler drives it as it drives the engine: sequence() for
    each request, run in the batch() of the running ones."""

    def __init__(self, engine: Engine):
        self.__dict__["_engine"] = engine
        self.replies: list = []
        self.prompts: list = []
        self.stage_hook = None

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def sequence(self, request, *, stats, slot=0, **_):
        tokenizer = self._engine.tokenizer
        self.prompts.append(tokenizer.decode(request.prompt))
        stats.prompt_tokens = len(request.prompt)
        return ScriptedSequence(slot, tokenizer.encode(self.replies.pop(0), add_bos=False, special=False),
                                request.max_tokens, stats)

    def batch(self, n_batch=None):
        return ScriptedBatch()

    def end_sequence(self, seq, out, failed):
        pass


class AppServer:
    """A Server over a ScriptedEngine, served by uvicorn on a thread."""

    def __init__(self, scripted: ScriptedEngine, defaults: Defaults, api_keys=(), cors=None):
        import uvicorn

        self.scheduler = Scheduler(scripted, 4)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        app = create_app(Server(self.scheduler, "scripted", defaults, api_keys, sse_ping_seconds=0), cors=cors)
        self.uvicorn = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.uvicorn.run, daemon=True)
        self.thread.start()
        deadline = time.time() + 30
        while not self.uvicorn.started:
            assert time.time() < deadline and self.thread.is_alive()
            time.sleep(0.02)
        self.http = httpx.Client(base_url=self.url, trust_env=False, timeout=60)
        self.openai = OpenAI(base_url=self.url + "/v1", api_key="k", max_retries=0,
                             http_client=httpx.Client(trust_env=False, timeout=60))
        self.anthropic = anthropic_client(self.url, "k")

    def stop(self):
        self.uvicorn.should_exit = True
        self.thread.join(30)
        self.scheduler.close()


def defaults(**kwargs) -> Defaults:
    return Defaults(SamplingParams(0.0, 0, 1.0, 0.0, None), **kwargs)


def template_messages(messages):
    """A client's messages as the server gives them to the chat template (checked as a
    chat request's)."""
    return openai_api.template_messages(validated(ChatRequest, {"messages": messages}).messages)


def openai_messages(messages):
    """The conversation as an OpenAI client sends it: arguments as JSON strings."""
    out = []
    for m in messages:
        m = dict(m)
        if m.get("tool_calls"):
            m["tool_calls"] = [{**c, "function": {**c["function"], "arguments": json.dumps(c["function"]["arguments"])}}
                               for c in m["tool_calls"]]
        out.append(m)
    return out


def streamed_chat(client, **kwargs):
    """(content, reasoning, calls [(id, name, arguments)], finish) from a streamed chat."""
    content, reasoning, calls, finish = "", "", {}, None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        choice = chunk.choices[0]
        finish = choice.finish_reason or finish
        content += choice.delta.content or ""
        reasoning += (choice.delta.model_extra or {}).get("reasoning_content") or ""
        for tc in choice.delta.tool_calls or []:
            entry = calls.setdefault(tc.index, {"id": None, "name": "", "arguments": ""})
            entry["id"] = tc.id or entry["id"]
            entry["name"] += tc.function.name or ""
            entry["arguments"] += tc.function.arguments or ""
    return content, reasoning, [(c["id"], c["name"], json.loads(c["arguments"])) for _, c in sorted(calls.items())], \
        finish


class ScriptedBatch:
    """decoding.Batch's interface over ScriptedSequences: each round emits the next two
    tokens of every reply; a reply ends with its text (stop) or at max_tokens (length)."""

    def __init__(self):
        self.seqs: list = []

    def __len__(self):
        return len(self.seqs)

    def add(self, seq):
        self.seqs.append(seq)

    def drop(self, seq, clean=True):
        if seq in self.seqs:
            self.seqs.remove(seq)

    def advance(self):
        out = []
        for seq in list(self.seqs):
            stats = seq.stats
            n = min(2, seq.max_tokens - stats.generated_tokens)
            new, seq.reply = seq.reply[:n], seq.reply[n:]
            stats.generated_tokens += len(new)
            if not seq.reply or stats.generated_tokens >= seq.max_tokens:
                seq.done = True
                stats.stop_reason = "length" if seq.reply else "stop"
                self.seqs.remove(seq)
            out.append((seq, new))
        return out


class ScriptedSequence:
    """A request of the ScriptedEngine: the tokens of its scripted reply still to come."""

    def __init__(self, slot, reply, max_tokens, stats):
        self.slot, self.reply, self.max_tokens, self.stats = slot, reply, max_tokens, stats
        self.done, self.error = False, None


def anthropic_client(url: str, key: str) -> anthropic.Anthropic:
    # the SDK's own HTTP client class (its HTTP library differs across versions), no proxies
    return anthropic.Anthropic(base_url=url, api_key=key, max_retries=0,
                               http_client=anthropic.DefaultHttpxClient(trust_env=False, timeout=60))


