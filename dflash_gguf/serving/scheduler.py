"""Request scheduling for a server: one Engine, one worker thread, a bounded FIFO queue,
and as many requests running at once as the Engine has sequence slots (continuous
batching: dflash-server -np N).

Requests are admitted (or refused when the queue is full) on the caller's thread; the
worker thread, which owns the Engine, moves a waiting request into a free slot at the
next step boundary and runs every running request in one decoding.Batch: each round,
one step of all the others together (one drafter graph, one target graph), a chunk of
a joining request's prompt in the same target graph, then as many more of its chunks
as the round's -b holds. A job's text pieces go to a sink the caller
chooses (an asyncio queue for the HTTP server). A cancelled job (its client went away)
leaves the batch at the next round boundary, within a prompt chunk or a step, the
others going on.
"""
from __future__ import annotations

import copy
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Deque, Dict, List, Optional, Sequence as Seq

from ..decoding.requests import DraftCounts, GenerationStats, Request
from ..decoding.step import Batch, Sequence
from ..decoding.streaming import TextStream
from ..engine.engine import Engine
from ..engine.slots import goes_on
from ..runtime import openmp


class QueueFull(Exception):
    """The queue holds as many waiting requests as it may."""


class ShuttingDown(Exception):
    """The scheduler no longer takes requests."""


@dataclass
class JobTimes:
    """When a job was taken in, started running and ended (time.perf_counter)."""

    queued_at: float = field(default_factory=time.perf_counter)
    started_at: Optional[float] = None
    finished_at: Optional[float] = None

    @property
    def queue_seconds(self) -> float:
        return (self.started_at or time.perf_counter()) - self.queued_at


def timings_of(s: GenerationStats, speculative: bool) -> dict:
    """llama-server's `timings` of a job's statistics at some moment (while its prompt goes
    in, as it generates, or at its end): the prompt's (prompt_n: the tokens computed, so
    far while it goes in; cache_n: those resumed) and the generation's, whose rate leaves
    out the first token (it comes from the prompt's last batch, as llama-server counts it);
    with `speculative`, draft_n and draft_n_accepted."""
    going_in = s.generated_tokens == 0 and s.prompt_in_slot < s.prompt_tokens
    prompt_n = (s.prompt_in_slot if going_in else s.prompt_tokens) - s.reused_tokens
    prompt_ms = s.prefill_seconds * 1e3
    n = s.generated_tokens
    predicted_ms = s.decode_seconds * 1e3
    steps = max(n - 1, 0)
    out = {"cache_n": s.reused_tokens, "prompt_n": prompt_n, "prompt_ms": prompt_ms,
           "prompt_per_token_ms": prompt_ms / prompt_n if prompt_n else 0.0,
           "prompt_per_second": 1e3 * prompt_n / prompt_ms if prompt_n and prompt_ms > 0 else 0.0,
           "predicted_n": n, "predicted_ms": predicted_ms,
           "predicted_per_token_ms": predicted_ms / steps if steps else 0.0,
           "predicted_per_second": 1e3 / predicted_ms * steps if steps and predicted_ms > 0 else 0.0}
    if speculative:
        out["draft_n"] = sum(s.drafts.drafted.values())
        out["draft_n_accepted"] = sum(s.drafts.accepted.values())
    return out


@dataclass(frozen=True)
class PromptProgress:
    """How far a job's prompt has gone in, as llama-server's prompt_progress says it: its
    tokens, those reused from the slot's cache, those in the slot now (the reused too) and
    the milliseconds since the job started; `stats`, the job's statistics then (a copy: the
    engine goes on while the event waits to be sent)."""

    total: int
    cache: int
    processed: int
    time_ms: int
    stats: GenerationStats

    def as_dict(self) -> dict:
        return {"total": self.total, "cache": self.cache, "processed": self.processed, "time_ms": self.time_ms}


@dataclass
class Job:
    """One generation request, its progress and its outcome."""

    request: Request  # what the Engine is asked: prompt, max_tokens, sampling, context_full, reuse_prefix, corpus
    # sink(kind, value): ("text", str), ("done", Job), ("error", Exception); ("progress", PromptProgress) too
    # when `progress`
    sink: Callable[[str, object], None]
    stop: Seq[str] = ()
    speculative: bool = True
    stats: GenerationStats = field(default_factory=GenerationStats)
    times: JobTimes = field(default_factory=JobTimes)
    text: str = ""
    finish_reason: str = ""
    prefill_chunks: int = 0  # prompt chunks computed (of up to n_ubatch tokens)
    slot: Optional[int] = None  # the Engine's sequence slot it ran in
    want_slot: Optional[int] = None  # the slot asked for (llama-server's id_slot; None or -1: any)
    tokens: List[int] = field(default_factory=list)  # the tokens generated so far
    context_bound: bool = False  # its max_tokens is the room the context leaves (no smaller limit was asked)
    progress: bool = False  # tell the sink ("progress", PromptProgress) as the prompt goes in (return_progress)
    _cancel: threading.Event = field(default_factory=threading.Event)

    def cancel(self) -> None:
        """Stop generating (the client went away); harmless once the job has ended."""
        self._cancel.set()

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()


FINISH_REASONS = {"stop": "stop", "stop string": "stop", "length": "length", "context": "length"}


class Piece(str):
    """A job's ("text", piece) event: its text, and `upto`: how many of the job's tokens
    it covers (job.tokens[:upto]), so that a reply can give each piece its tokens."""

    upto: int = 0


def piece_of(text: str, upto: int) -> Piece:
    p = Piece(text)
    p.upto = upto
    return p


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
    drafts: DraftCounts = field(default_factory=DraftCounts)
    n_tokens_max: int = 0  # the longest sequence seen (prompt and generated tokens)
    rounds: int = 0  # rounds of the batch (each one target graph, or a prompt's chunks)
    busy_slots: int = 0  # running sequences summed over the rounds


@dataclass
class _Running:
    """A job in the batch: its sequence, the tokens it emitted and their text."""

    job: Job
    seq: Sequence
    text: TextStream
    out: List[int] = field(default_factory=list)
    pieces: List[str] = field(default_factory=list)


class Scheduler:
    """The worker over an Engine, fed from a FIFO queue of at most `max_queue` waiting
    jobs (the running ones are not counted), running up to one job per sequence slot of
    the Engine at once."""

    def __init__(self, engine: Engine, max_queue: int = 16, n_batch: Optional[int] = None, keep_idle: bool = True,
                 log: Callable[[str], None] = lambda line: None):
        if max_queue < 0:
            raise ValueError(f"the queue size must be >= 0, got {max_queue}")
        self.engine = engine
        self.n_batch = n_batch  # tokens a round takes (decoding.Batch; -b)
        self.max_queue = max_queue
        self.n_slots = engine.target.n_seq
        # checkpoint idle slots' contexts when a job starts (llama-server's --cache-idle-slots)
        self.keep_idle = keep_idle and engine.checkpoints is not None
        self.log = log  # the slots' events, a line each (dflash-server --verbose)
        if self.keep_idle:  # the tag is llama-server's debug line, which llama.cpp's server tests look for
            log("idle slots are kept in the prompt cache when another request starts "
                "__TEST_TAG_CACHE_IDLE_SLOTS_ENABLED__")
        # what `auto` measures runs graphs on the target: before any request holds a slot
        engine.prepare_auto()
        # this thread is done computing graphs (loading, the self-check, the table): its
        # OpenMP team, kept beside the engine thread's, would make every barrier of the
        # decoding sleep instead of spin (runtime/openmp.py)
        openmp.release_team()
        self.totals = Totals()
        self._queue: Deque[Job] = deque()
        self._running: Dict[int, _Running] = {}  # by slot
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
            if waiting >= self.max_queue and (len(self._running) >= self.n_slots or waiting):
                self.totals.refused += 1
                raise QueueFull(f"{waiting} requests are waiting (--queue {self.max_queue})")
            job.times.queued_at = time.perf_counter()
            self._queue.append(job)
            self._lock.notify()

    @property
    def queue_depth(self) -> int:
        return len(self._queue)

    @property
    def running(self) -> int:
        return len(self._running)

    def running_jobs(self) -> Dict[int, "_Running"]:
        """The running jobs by slot (a copy: the worker changes it)."""
        return dict(self._running)

    def close(self, timeout: Optional[float] = None) -> None:
        """Refuse new jobs, finish the queued and running ones, stop the worker."""
        with self._lock:
            self._closing = True
            self._lock.notify_all()
        self._thread.join(timeout)

    # -- worker side --------------------------------------------------------------------
    def _work(self) -> None:
        batch = self.engine.batch(self.n_batch)
        while True:
            with self._lock:
                while not self._queue and not self._running and not self._closing:
                    self._lock.wait()
                if not self._queue and not self._running:
                    return
                admitted = self._admit()
            try:
                self._round(batch, admitted)
            except Exception as e:  # noqa: BLE001 - a fault of the round fails its requests, not the server
                for run in list(self._running.values()):
                    batch.drop(run.seq, clean=False)
                    self._end(run, e)

    def _round(self, batch: Batch, admitted: List[Job]) -> None:
        """Admitted jobs join the batch, cancelled ones leave it, then one round of it: a
        prompt chunk and a step; each job gets its text as it comes."""
        for job in admitted:
            self._start(job, batch)
        for run in [r for r in self._running.values() if r.job.cancelled]:
            batch.drop(run.seq)
            self._end(run, None)
        if not len(batch):
            return
        self.totals.rounds += 1
        self.totals.busy_slots += len(batch)
        results = batch.advance()
        # a round may list a joining sequence twice (its first token, then its step): it
        # ends at its last entry, or its step's tokens would be lost
        last = {id(seq): i for i, (seq, _) in enumerate(results)}
        for i, (seq, new) in enumerate(results):
            run = self._running.get(seq.slot)
            if run is None or run.seq is not seq:
                continue  # it ended earlier in this round
            if seq.error is not None:
                self._end(run, seq.error)
                continue
            final = last[id(seq)] == i
            self._emit(run, new, final)
            if run.text.stopped and not seq.done:  # a stop string: no more tokens wanted
                seq.done = True
                batch.drop(seq)
            if seq.done and (final or run.text.stopped):
                self._end(run, None)

    def _admit(self) -> List[Job]:
        """Waiting jobs moved into free slots (called with the lock held)."""
        admitted = []
        while self._queue and len(self._running) + len(admitted) < self.n_slots:
            job = self._queue.popleft()
            job.times.started_at = time.perf_counter()
            admitted.append(job)
        return admitted

    def _slot_for(self, job: Job) -> int:
        """A free slot, the one whose context the job's prompt extends the furthest first."""
        free = [s for s in range(self.n_slots) if s not in self._running]
        if job.want_slot in free:
            return job.want_slot

        def held(slot: int) -> int:
            tokens = self.engine.held(slot)
            return len(tokens) if goes_on(job.request.prompt, tokens) else 0

        return max(free, key=held)

    def _keep_contexts(self, job: Job) -> None:
        """Before the job's slot takes its prompt, checkpoint the contexts that would be lost
        for good: the slot's own where the prompt does not go on from it, and with keep_idle
        every other idle slot's (llama-server's --cache-idle-slots), so that a conversation
        resumes from the prompt cache wherever its next request lands."""
        engine, slot = self.engine, job.slot
        held = engine.held(slot)
        if held and not goes_on(job.request.prompt, held) and engine.keep_slot(slot):
            self.log(f"slot {slot}: updating prompt cache: its context of {len(held)} tokens kept before the "
                     f"new prompt takes the slot")
        for other in range(self.n_slots) if self.keep_idle else ():
            if other != slot and other not in self._running:
                n = engine.keep_slot(other)
                if n:  # the tag is llama-server's debug line, which llama.cpp's server tests look for
                    self.log(f"slot {other}: idle, its context of {n} tokens kept in the prompt cache "
                             "__TEST_TAG_CACHE_IDLE_SLOT__")

    def _start(self, job: Job, batch: Batch) -> None:
        engine = self.engine
        if job.cancelled:  # its client left while it waited: it ends untouched
            self._account(job, None)
            job.times.finished_at = time.perf_counter()
            job.finish_reason = "stop"
            job.sink("done", job)
            return
        job.slot = self._slot_for(job)
        self._keep_contexts(job)

        def stage(name: str) -> None:
            job.prefill_chunks += name == "prefill chunk"
            if job.progress and name in ("prefill start", "prefill chunk"):
                s = job.stats
                job.sink("progress", PromptProgress(s.prompt_tokens, s.reused_tokens, s.prompt_in_slot,
                                                    int((time.perf_counter() - job.times.started_at) * 1000),
                                                    copy.copy(s)))

        try:
            seq = engine.sequence(job.request, speculative=job.speculative, stats=job.stats, slot=job.slot,
                                  on_stage=stage)
        except Exception as e:  # noqa: BLE001 - a request the engine refuses is reported to its client
            self._account(job, e)
            job.times.finished_at = time.perf_counter()
            job.sink("error", e)
            return
        if job.stats.checkpoint:
            self.log(f"slot {job.slot}: updating prompt cache: the prompt resumes at token "
                     f"{job.stats.checkpoint['position']} of {len(job.request.prompt)} from a checkpoint")
        self._running[job.slot] = _Running(job, seq, engine.text_stream(job.stop, job.request.stop_tokens))
        batch.add(seq)

    def _emit(self, run: _Running, new: List[int], final: bool = True) -> None:
        run.out.extend(new)
        run.job.tokens.extend(new)
        piece = run.text.push(new)
        if run.seq.done and final:
            piece += run.text.end()
        if piece:
            run.pieces.append(piece)
            run.job.sink("text", piece_of(piece, len(run.out)))

    def _end(self, run: _Running, error: Optional[BaseException]) -> None:
        job, stats = run.job, run.job.stats
        if run.text.stop_string is not None:
            stats.stop_reason, stats.stop_string = "stop string", run.text.stop_string
        self.engine.end_sequence(run.seq, run.out, failed=error is not None or not run.seq.done)
        del self._running[job.slot]
        job.times.finished_at = time.perf_counter()
        job.text = "".join(run.pieces)
        job.finish_reason = FINISH_REASONS.get(stats.stop_reason, "stop")
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
        t.n_tokens_max = max(t.n_tokens_max, s.prompt_tokens + s.generated_tokens)
        t.drafts.add(s.drafts)
