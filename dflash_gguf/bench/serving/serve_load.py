"""What the serving benchmarks and the soak share: servers started and stopped on loopback
(dflash-server, llama-server), completions sent and their event streams read back as the
client saw them, workers draining a list of requests, /metrics read, percentiles, and
whether a server's --help offers a flag.

Replies are read with httpx line by line rather than through the openai client: the soak
counts what a server sends after its final chunk (an answer sent twice), and a client
that leaves mid-stream or before its first token has to close the connection itself.
"""
from __future__ import annotations

import json
import math
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, List, Optional, Sequence, Union
from urllib.parse import urlparse

import httpx

LOOPBACK = ("127.0.0.1", "localhost", "::1")


def loopback_url(url: str) -> str:
    """`url` without a trailing slash; ValueError unless it names a loopback host."""
    host = urlparse(url).hostname
    if host not in LOOPBACK:
        raise ValueError(f"only loopback servers are measured ({', '.join(LOOPBACK)}), got {url!r}")
    return url.rstrip("/")


def percentile(values: Sequence[float], q: float) -> float:
    """The q-quantile (0..1) of `values`, interpolated linearly between ranks; nan when empty."""
    if not 0 <= q <= 1:
        raise ValueError(f"a quantile is in [0, 1], got {q}")
    if not values:
        return float("nan")
    s = sorted(values)
    k = (len(s) - 1) * q
    lo, hi = math.floor(k), min(math.floor(k) + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def accepts_flag(help_text: str, flag: str) -> bool:
    """Whether a --help text lists `flag` as an option of its own (not as part of a
    longer one: -np is not found in -npx or --np-foo)."""
    return re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", help_text) is not None


def dflash_server_help() -> str:
    """The installed dflash-server's --help."""
    res = subprocess.run([sys.executable, "-m", "dflash_gguf.serving.server", "--help"], capture_output=True, text=True,
                         cwd=tempfile.gettempdir(), timeout=120)
    if res.returncode != 0:
        raise RuntimeError(f"dflash-server --help failed: {res.stderr.strip()[-300:]}")
    return res.stdout


def version_of(exe: Path) -> str:
    """What a llama.cpp tool's --version prints (its build and commit)."""
    res = subprocess.run([str(exe), "--version"], capture_output=True, text=True, timeout=60)
    return (res.stdout + res.stderr).strip()


def parse_metrics(text: str) -> dict:
    """Prometheus text as {name (with its labels): value}."""
    out = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        name, _, value = line.rpartition(" ")
        try:
            out[name] = float(value)
        except ValueError:
            raise ValueError(f"not a Prometheus sample line: {line!r}") from None
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


class ServerProcess:
    """A server started as a subprocess on a loopback port, ready once /health says 200."""

    def __init__(self, cmd: List[str], port: int, log_path: Path, ready_seconds: float = 300):
        self.cmd, self.port, self.log_path = cmd, port, log_path
        self.url = f"http://127.0.0.1:{port}"
        self._log = open(log_path, "w")
        # outside any source tree, so that `python -m dflash_gguf...` runs the installed package;
        # Ctrl-C stops the server (stop()) even where this bench was started with SIGINT
        # ignored (`nohup ... &` from a script: a child inherits the ignoring, and Python
        # keeps it)
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, cwd=tempfile.gettempdir(),
                                     preexec_fn=_default_sigint)
        deadline = time.monotonic() + ready_seconds
        with httpx.Client(trust_env=False, timeout=5) as http:
            while True:
                if self.proc.poll() is not None:
                    self._log.close()
                    raise RuntimeError(f"{Path(cmd[0]).name} exited with status {self.proc.returncode} while "
                                       f"starting: {self.log_tail()}")
                try:
                    if http.get(self.url + "/health").status_code == 200:
                        return
                except httpx.TransportError:
                    pass
                if time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"{Path(cmd[0]).name} was not ready within {ready_seconds:.0f} s: "
                                       f"{self.log_tail()}")
                time.sleep(0.2)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def log_tail(self, lines: int = 5) -> str:
        return " | ".join(ln for ln in self.log_text().strip().splitlines()[-lines:])

    def stop(self, seconds: float = 60) -> int:
        """Ctrl-C (both servers drain and exit 0 on it), a kill after `seconds`; the exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(seconds)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if not self._log.closed:
            self._log.close()
        return self.proc.returncode


# -- one request as the client saw it -----------------------------------------------------------

@dataclass
class Reply:
    """A completion request's outcome. `finals` counts the chunks (or JSON bodies) that carry
    a finish_reason and `dones` the [DONE] markers: 1 and 1 for a whole streamed answer;
    `after_done` counts events past the first [DONE] (none should come)."""

    status: Optional[int] = None  # None: no response (a transport error)
    sent: float = 0.0             # time.perf_counter() when it was sent
    ttft: Optional[float] = None  # seconds from sending to the first text
    seconds: float = 0.0          # from sending to the end of the reply (or leaving)
    text: str = ""
    tokens: Optional[int] = None  # usage.completion_tokens
    finish_reason: Optional[str] = None
    finals: int = 0
    dones: int = 0
    after_done: int = 0
    text_events: int = 0
    error: Optional[str] = None   # the error the server sent, or the transport's
    left: bool = False            # the client closed the connection before the end
    extension: dict = field(default_factory=dict)  # dflash-server's "dflash" figures
    timings: dict = field(default_factory=dict)    # llama-server's "timings"

    @property
    def complete(self) -> bool:
        """A whole answer: status 200, one final chunk, no error, not left."""
        return self.status == 200 and self.finals == 1 and self.error is None and not self.left

    def feed(self, line: str, elapsed: float) -> None:
        """One line of a server-sent event stream, `elapsed` seconds after sending."""
        if not line.startswith("data:"):
            return  # blank separators, ": keep-alive" comments, event: names
        data = line[5:].strip()
        if self.dones:
            self.after_done += 1
            return
        if data == "[DONE]":
            self.dones += 1
            return
        self.absorb(json.loads(data), elapsed)

    def absorb(self, obj: dict, elapsed: float) -> None:
        """One completion object: a streamed chunk or a whole (non-streamed) reply."""
        if "error" in obj:
            err = obj["error"]
            self.error = err.get("message", str(err)) if isinstance(err, dict) else str(err)
            return
        for choice in obj.get("choices") or ():
            piece = choice.get("text") or ""
            if piece:
                self.text += piece
                self.text_events += 1
                if self.ttft is None:
                    self.ttft = elapsed
            if choice.get("finish_reason") is not None:
                self.finals += 1
                self.finish_reason = choice["finish_reason"]
        if obj.get("usage"):
            self.tokens = obj["usage"].get("completion_tokens")
        self.extension = obj.get("dflash") or self.extension
        self.timings = obj.get("timings") or self.timings


def complete(http: httpx.Client, url: str, body: Union[dict, bytes], leave_after: Optional[int] = None,
             path: str = "/v1/completions") -> Reply:
    """POST a completion and read the reply; `body` bytes go as they are (malformed JSON).
    Streamed (body["stream"]) with `leave_after`: the client closes the connection once it
    has read that many text events (0: as soon as the response starts, before the first
    token: in the queue or the prefill)."""
    reply = Reply(sent=time.perf_counter())
    t0 = reply.sent
    try:
        if isinstance(body, bytes):
            r = http.post(url + path, content=body, headers={"content-type": "application/json"})
            reply.status = r.status_code
            reply.absorb(_json_or_error(r.text), time.perf_counter() - t0)
        elif body.get("stream"):
            with http.stream("POST", url + path, json=body) as r:
                reply.status = r.status_code
                if r.status_code != 200:
                    r.read()
                    reply.absorb(_json_or_error(r.text), time.perf_counter() - t0)
                elif leave_after == 0:
                    reply.left = True
                else:
                    for line in r.iter_lines():
                        reply.feed(line, time.perf_counter() - t0)
                        if leave_after is not None and reply.text_events >= leave_after and not reply.finals:
                            reply.left = True
                            break
        else:
            r = http.post(url + path, json=body)
            reply.status = r.status_code
            reply.absorb(_json_or_error(r.text), time.perf_counter() - t0)  # its "first token" is its end
    except httpx.HTTPError as e:
        reply.error = f"{type(e).__name__}: {e}"
    reply.seconds = time.perf_counter() - t0
    return reply


def _json_or_error(text: str) -> dict:
    try:
        obj = json.loads(text)
    except ValueError:
        return {"error": {"message": f"not JSON: {text[:200]!r}"}}
    return obj if isinstance(obj, dict) else {"error": {"message": f"not a JSON object: {text[:200]!r}"}}


def drain(items: Sequence, workers: int, run: Callable, deadline: Optional[float] = None) -> List:
    """run(item) for every item by `workers` threads, each taking the next item as soon as it
    is free (a client that sends its next request when its last one is answered). Items not
    started by `deadline` (time.monotonic()) are not run: their result is None. Results come
    in the items' order."""
    results: List = [None] * len(items)
    lock = threading.Lock()
    taken = iter(range(len(items)))

    def worker() -> None:
        while True:
            with lock:
                i = next(taken, None)
            if i is None or (deadline is not None and time.monotonic() > deadline):
                return
            results[i] = run(items[i])

    with ThreadPoolExecutor(workers) as pool:
        for f in [pool.submit(worker) for _ in range(workers)]:
            f.result()
    return results


def poll_until(check: Callable[[], bool], seconds: float, every: float = 0.05) -> bool:
    """Whether `check()` came true within `seconds`."""
    deadline = time.monotonic() + seconds
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(every)
    return True
