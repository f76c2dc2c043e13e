"""Request scheduling for a server: one Engine, one worker thread, a bounded FIFO queue.

Requests are admitted (or refused when the queue is full) on the caller's thread and
run in arrival order on the worker thread, which owns the Engine. A job's text pieces
go to a sink the caller chooses (an asyncio queue for the HTTP server). A cancelled
job (its client went away) stops at the end of the step in progress, through the
Engine's stage hook, which leaves the Engine consistent.

The worker takes its work through `_next_batch`, which today returns one job: batched
decoding of several sequences in one verify graph plugs in there, the queue and the
job interface staying as they are.
"""
from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Deque, List, Optional, Sequence

from .engine import Engine
from .generate import GenerationStats
from .sampling import SamplingParams


class QueueFull(Exception):
    """The queue holds as many waiting requests as it may."""


class ShuttingDown(Exception):
    """The scheduler no longer takes requests."""


class Cancelled(Exception):
    """Raised inside the Engine's step to end a cancelled job."""


@dataclass
class Job:
    """One generation request, its progress and its outcome."""

    tokens: List[int]
    max_tokens: int
    sink: Callable[[str, object], None]  # sink(kind, value): ("text", str), ("done", Job), ("error", Exception)
    stop: Sequence[str] = ()
    sampling: Optional[SamplingParams] = None
    speculative: bool = True
    context_full: str = "error"
    stats: GenerationStats = field(default_factory=GenerationStats)
    text: str = ""
    queued_at: float = field(default_factory=time.perf_counter)
    started_at: Optional[float] = None
    finished_at: Optional[float] = None
    finish_reason: str = ""
    prefill_chunks: int = 0  # prompt chunks computed (of up to n_ubatch tokens)
    _cancel: threading.Event = field(default_factory=threading.Event)

    def cancel(self) -> None:
        """Stop generating (the client went away); harmless once the job has ended."""
        self._cancel.set()

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    @property
    def queue_seconds(self) -> float:
        return (self.started_at or time.perf_counter()) - self.queued_at


FINISH_REASONS = {"stop": "stop", "stop string": "stop", "length": "length", "context": "length"}


@dataclass
class Totals:
    """What /metrics reports, accumulated over finished jobs."""

    requests: int = 0
    failed: int = 0
    cancelled: int = 0
    refused: int = 0
    prompt_tokens: int = 0
    reused_tokens: int = 0
    generated_tokens: int = 0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    target_passes: int = 0
    accepted_tokens: int = 0
    prefill_chunks: int = 0


class Scheduler:
    """The single worker over an Engine, fed from a FIFO queue of at most `max_queue`
    waiting jobs (the running one is not counted)."""

    def __init__(self, engine: Engine, max_queue: int = 16):
        if max_queue < 0:
            raise ValueError(f"the queue size must be >= 0, got {max_queue}")
        self.engine = engine
        self.max_queue = max_queue
        self.totals = Totals()
        self._queue: Deque[Job] = deque()
        self._running: Optional[Job] = None
        self._closing = False
        self._lock = threading.Condition()
        self._thread = threading.Thread(target=self._work, name="dflash-engine", daemon=True)
        self._thread.start()

    # -- callers' side ----------------------------------------------------------------
    def submit(self, job: Job) -> None:
        """Queue a job, or raise QueueFull / ShuttingDown."""
        with self._lock:
            if self._closing:
                raise ShuttingDown("the server is shutting down")
            # a job whose client has left waits only to be accounted for: it holds no place, or
            # clients that leave and come back would be refused by a queue of ghosts
            waiting = sum(not j.cancelled for j in self._queue)
            if waiting >= self.max_queue and (self._running is not None or waiting):
                self.totals.refused += 1
                raise QueueFull(f"{waiting} requests are waiting (--queue {self.max_queue})")
            job.queued_at = time.perf_counter()
            self._queue.append(job)
            self._lock.notify()

    @property
    def queue_depth(self) -> int:
        return len(self._queue)

    @property
    def running(self) -> int:
        return 1 if self._running is not None else 0

    def close(self, timeout: Optional[float] = None) -> None:
        """Refuse new jobs, finish the queued ones, stop the worker."""
        with self._lock:
            self._closing = True
            self._lock.notify_all()
        self._thread.join(timeout)

    # -- worker side --------------------------------------------------------------------
    def _next_batch(self) -> List[Job]:
        with self._lock:
            while not self._queue and not self._closing:
                self._lock.wait()
            if not self._queue:
                return []
            job = self._queue.popleft()
            self._running = job
            return [job]

    def _work(self) -> None:
        while True:
            batch = self._next_batch()
            if not batch:
                return
            for job in batch:
                self._run(job)
            with self._lock:
                self._running = None

    def _run(self, job: Job) -> None:
        engine = self.engine
        job.started_at = time.perf_counter()

        def stage(name: str) -> None:
            job.prefill_chunks += name == "prefill chunk"
            if job.cancelled:  # a client gone during the prompt costs at most the chunk in progress
                raise Cancelled()

        pieces: List[str] = []
        error: Optional[BaseException] = None
        engine.stage_hook = stage
        stream = engine.stream(job.tokens, job.max_tokens, stop=job.stop, speculative=job.speculative,
                               sampling=job.sampling, stats=job.stats, context_full=job.context_full)
        try:
            if job.cancelled:
                raise Cancelled()
            for piece in stream:
                pieces.append(piece)
                job.sink("text", piece)
                if job.cancelled:
                    break
        except Cancelled:
            pass
        except Exception as e:  # a failed request is reported to its client; the engine resets itself
            error = e
        finally:
            stream.close()  # a generation left between steps: the engine keeps its context
            engine.stage_hook = None
        job.finished_at = time.perf_counter()
        job.text = "".join(pieces)
        job.finish_reason = FINISH_REASONS.get(job.stats.stop_reason, "stop")
        self._account(job, error)
        if error is not None:
            job.sink("error", error)
        else:
            job.sink("done", job)

    def _account(self, job: Job, error: Optional[BaseException]) -> None:
        t, s = self.totals, job.stats
        t.requests += 1
        t.failed += error is not None
        t.cancelled += job.cancelled
        t.prompt_tokens += s.prompt_tokens
        t.reused_tokens += s.reused_tokens
        t.generated_tokens += s.generated_tokens
        t.prefill_seconds += s.prefill_seconds
        t.decode_seconds += s.decode_seconds
        t.target_passes += len(s.accepted_lengths)
        t.accepted_tokens += sum(s.accepted_lengths)
        t.prefill_chunks += job.prefill_chunks
