"""Decoding as one step loop over a set of sequences.

A Sequence is one request in its slot of the target's (and drafter's) memory: its prompt
goes in chunk by chunk (prefill_chunks), its first token comes from the prompt's last
row (first), then every step (step, over any number of sequences)

  propose  the drafter drafts a block for each sequence that drafts, each first taking
           the positions its target committed in the last step: one drafter graph
  verify   the target runs every sequence's rows: one target graph (plain decodes,
           chains and trees mixed), each sequence's rows choosing their tokens on the
           device by its own sampling
  accept   each sequence keeps what its target choices agree with (accepted: one rule
           for every kind of proposal)
  commit   and commits it (the drafter takes it in its next graph)

One body for every step: each sequence's proposer hears of its last step and plans this
one (a Plan), the drafter drafts, the proposers propose, one library call verifies (the
lightest that can: decoding/verify.py's decode_call, the fused chain_call, else verify_call)
and returns what it did alike (a Ran), and what follows is the same for every sequence
(verify.record: its counts, what its proposer will hear, its tokens).

A single request is a set of one (sequence_steps). Greedy, each sequence's tokens are
the target's argmax given their prefix, whatever else runs in the step; sampling, each
sequence draws with its own seeded generator, so its output is distributed exactly as
the target's own sampling."""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Iterator, List, Optional, Sequence as Seq, Set, Tuple

from ..runtime.errors import ConfigError
from .logprobs import TokenLogprob, token_logprobs, token_probs
from .proposal import VerifiedStep
from .requests import GenerationStats, Placement, Prefill, Request, check_bias, check_request, start_context
from .sampling import Sampler
from .verify import chain_call, decode_call, fused, record, verify_call


@dataclass
class Tokens:
    """A sequence's tokens, the one history that every part of a step reads (the
    proposers' n-gram and suffix indexes, the drafter's context, the sampler's penalty
    window) and none copies: `text` is its prompt, then every token its steps chose, the
    bonus (the next token, which the target has not seen) last; n_past the context
    positions filled (the prompt, then what its steps committed: all of text but the
    bonus). `prompt` is the request's."""

    prompt: List[int]
    text: List[int]
    n_past: int
    bonus: Optional[int] = None

    def chose(self, first: int) -> None:
        """The prompt's last row chose the first token: the first bonus."""
        self.text.append(first)
        self.bonus = first

    def advance(self, new: List[int]) -> None:
        """A step committed the old bonus and the accepted drafts, and chose the next
        bonus: `new` is the drafts, then that bonus."""
        self.text += new
        self.n_past += len(new)
        self.bonus = new[-1]


@dataclass(frozen=True)
class Ending:
    """Where a request's tokens end: after max_tokens, or at a stop token (kept)."""

    max_tokens: int
    stops: Set[int]

    def cut(self, new: List[int], wanted: int) -> Tuple[int, bool]:
        """How many of a step's tokens the request keeps when it still wants `wanted`,
        and whether a stop token ended them."""
        produced = min(len(new), wanted)
        for i in range(produced):
            if new[i] in self.stops:
                return i + 1, True
        return produced, False


@dataclass
class Clock:
    """When a sequence's prompt began going in and its decoding began (perf_counter; 0:
    not yet), for its statistics' prefill and decode seconds."""

    prefill: float = 0.0
    decode: float = 0.0


class Sequence:
    """One request (generate.Request) in its place (generate.Placement: its slot, the
    prompt tokens the slot holds, who watches its stages, its prefill's checkpoints):
    its sampler, proposer, its tokens (Tokens), where they end (Ending), what its
    proposer keeps of it from step to step (proposing: Proposer.start's) and its
    statistics. grammar (a constraints.GrammarState): the constraint its tokens follow;
    generation ends where the grammar does."""

    def __init__(self, target, draft, proposer, request: Request, stats: GenerationStats,
                 where: Placement = Placement(), grammar=None):
        prompt = request.prompt
        check_request(target, prompt, request.max_tokens, proposer.lookahead, request.context_full)
        check_bias(target, request.sampling)
        self.target, self.draft, self.proposer = target, draft, proposer
        self.stats, self.where = stats, where
        self.speculative = draft is not None or proposer.lookahead > 0  # drafts of some kind (a drafter, n-grams)
        self.tokens = Tokens(prompt, list(prompt), len(prompt))
        self.sampler = Sampler(request.sampling, self.tokens.text, grammar)
        self.ending = Ending(request.max_tokens, set(request.stop_tokens or ()))
        self.clock = Clock()
        self.row0 = 0                     # its first row in the current step's results
        self.prefill: Optional[Prefill] = None  # its prompt going in (start_prefill)
        self.done = False
        self.error: Optional[BaseException] = None  # why it ended early, in a Batch
        self.proposing = proposer.start(self)
        self.verified_step: Optional[VerifiedStep] = None  # its last step, for its proposer to hear (tell_proposer)
        # logprobs: the alternatives asked per token (None: none); the step's tokens' until emitted keeps them
        self.logprobs_top: Optional[int] = request.logprobs
        self.post_sampling = request.post_sampling
        if self.post_sampling and self.sampler.constrained:
            raise ConfigError("post_sampling", "post_sampling_probs cannot be given with a grammar, a JSON schema or "
                                               "a required tool call: the probabilities after the sampler leave out "
                                               "the grammar's mask")
        self.step_logprobs: Optional[List[TokenLogprob]] = None

    def read_logprobs(self, rows: List[int], tokens: List[int]) -> None:
        """The step's tokens' log-probabilities (the request asked for them), read from the
        rows that chose them in the target's last call."""
        if self.post_sampling:
            self.step_logprobs = token_probs(self.target, rows, tokens, self.logprobs_top, self.sampler.params)
        else:
            self.step_logprobs = token_logprobs(self.target, rows, tokens, self.logprobs_top)

    @property
    def slot(self) -> int:
        """Its slot of the target's (and drafter's) memory."""
        return self.where.slot

    def stage(self, name: str) -> None:
        """Tell whoever watches the sequence (Placement.on_stage) the stage it reached."""
        if self.where.on_stage is not None:
            self.where.on_stage(name)

    # -- the request's budget -----------------------------------------------------------
    @property
    def remaining(self) -> int:
        return self.ending.max_tokens - self.stats.generated_tokens

    @property
    def room(self) -> int:
        return self.target.n_ctx - self.tokens.n_past

    def draft_room(self, n_max: int) -> int:
        """Drafts a chain may have this step: n_max, what the request still wants after the
        target's own next token (so that every committed row is a kept token, and the slot
        holds exactly the request's context for the next one) and the context's room after
        the bonus."""
        return max(0, min(n_max, self.remaining - 1, self.room - 1))

    def tell_proposer(self) -> None:
        """Its proposer hears of its last step (Proposer.verified), once: at its next step,
        before it plans, or at its finish."""
        step, self.verified_step = self.verified_step, None
        if step is not None:
            self.proposer.verified(self, step.plan, step.proposal, step.path, step.out, step.seconds)

    def catch_up_due(self) -> bool:
        """Whether a step that drafts nothing must still let the drafter take the
        positions it lacks: the drafter decides, from its own record, whether the slot's
        feature rows keep them past the step's call (at most the proposer's lookahead rows)."""
        return self.draft.catch_up_due(self.slot, self.proposer.lookahead)

    def catch_up_tokens(self) -> List[int]:
        """The tokens of the positions the drafter has yet to take: from its n_past on
        (the drafter's record, the one there is) to the context's end."""
        tokens = self.tokens
        return tokens.text[self.draft.n_past(self.slot):tokens.n_past]

    # -- the prompt -------------------------------------------------------------------------
    def start_prefill(self) -> Prefill:
        """Begin putting the prompt into the sequence's slot (after the `reused` tokens it
        holds already): its chunks (generate.Prefill) run in steps of their own
        (prefill_chunks) or beside other sequences' rows (Batch), chunk_ran after each."""
        stats, prompt, where = self.stats, self.tokens.prompt, self.where
        stats.prompt_tokens = len(prompt)
        self.clock.prefill = time.perf_counter()
        stats.reused_tokens = start_context(self.target, prompt, where.reused, self.draft, self.slot)
        self.sampler.apply(self.target, self.draft, self.proposer.drafted_samples, seq=self.slot,
                           raw_logits=self.logprobs_top is not None and not self.post_sampling)
        self.sampler.prepare(self.target, 1, seq=self.slot)  # the prompt's last row chooses the first token
        self.prefill = Prefill(self.target, prompt, stats.reused_tokens, self.draft, where.saver, where.on_stage,
                               self.slot, stats)
        stats.prompt_in_slot = stats.reused_tokens
        self.stage("prefill start")
        return self.prefill

    def chunk_ran(self) -> None:
        """The prefill's chunk has run (in a step whose results have the chunk's choice,
        when it is the prompt's last, at row `row0`)."""
        self.prefill.ran()
        stats = self.stats
        stats.prefill_seconds = time.perf_counter() - self.clock.prefill
        if self.prefill.done:
            stats.stop_reason = "length"
            self.clock.decode = time.perf_counter()
            self.stage("prefilled")

    def chunk_alone(self) -> None:
        """The prefill's next chunk (of up to n_ubatch tokens) in a step of its own, then
        chunk_ran."""
        self.prefill.step_alone()
        self.row0 = 0
        self.chunk_ran()

    def prefill_chunks(self) -> Iterator[None]:
        """The whole prompt, each chunk in a step of its own, yielding after each."""
        prefill = self.start_prefill()
        while not prefill.done:
            self.chunk_alone()
            yield

    def first(self) -> List[int]:
        """The first token, chosen by the prompt's last row (none when max_tokens is 0)."""
        if self.ending.max_tokens == 0:
            self.done = True
            return []
        self.tokens.chose(int(self.sampler.choices(self.target, self.row0, 1, self.slot)[0]))
        if self.logprobs_top is not None:
            self.read_logprobs([self.row0], [self.tokens.bonus])
        return self.emitted([self.tokens.bonus], record=False)

    def emitted(self, new: List[int], record: bool = True) -> List[int]:
        """The tokens of a step as the request keeps them: at most what it still wants,
        ending at a stop token; recorded, and generation ends when it should."""
        stats = self.stats
        produced, stopped = self.ending.cut(new, self.remaining)
        if stopped:
            stats.stop_reason = "stop"
        if record:
            stats.accepted_lengths.append(produced)
        stats.generated_tokens += produced
        kept = new[:produced]
        if self.step_logprobs is not None:
            stats.logprobs += self.step_logprobs[:produced]
            self.step_logprobs = None
        self.sampler.accept(kept)
        grammar = self.sampler.grammar
        if stats.stop_reason != "stop" and grammar is not None and grammar.ended:
            stats.stop_reason = "stop"  # the output is complete: the grammar allows only its end
        if stats.stop_reason == "stop" or stats.generated_tokens >= self.ending.max_tokens:
            self.done = True
        elif self.room < 1:
            stats.stop_reason = "context"
            self.done = True
        return kept

    def finish(self, clean: bool) -> None:
        """After its last step (or an exception: not clean, and the engine starts the
        slot afresh). The drafter may stay behind by its last steps' tokens (the last
        one's, or a stretch that drafted nothing): their features stay in the slot's
        feature rows, and a request continuing the context lets the drafter take them
        first (generate.prefill_chunks)."""
        if self.clock.decode:
            self.stats.decode_seconds = time.perf_counter() - self.clock.decode
        self.tell_proposer()
        report = self.proposer.finish(self)
        if report is not None:
            self.stats.trees.auto = report


def step(target, draft, seqs: Seq[Sequence], joining: Optional[Sequence] = None) -> List[List[int]]:
    """One step of every sequence in `seqs` (each past its first token, not done): the
    tokens each keeps, in order. The step only orchestrates, its calls going one way:
    each sequence's proposer hears of its last step and plans this one (decoding/proposal.py), the
    drafter's graph runs every block planned, the proposers propose, and one call of the
    library verifies (decoding/verify.py: the lightest call that can), after which every
    sequence's step is recorded alike (verify.record). joining: a sequence whose next
    prompt chunk (its Prefill's) the target's graph takes after the others' rows, as
    many tokens as they leave of n_ubatch (at least one), the step held to
    INVARIANT_STEP_ROWS so that the others' rows round as they would alone; the chunk's
    choice, if any, is then at the sequence's row0 (it has yet to be told:
    Sequence.chunk_ran)."""
    if joining is None and not any(s.speculative for s in seqs):
        return record(seqs, decode_call(target, seqs))  # plain decoding: nothing planned, nothing timed
    t0 = time.perf_counter()
    for s in seqs:
        s.tell_proposer()
    plans = [s.proposer.plan(s) for s in seqs]
    blocks = []
    for s, plan in zip(seqs, plans):
        # a sequence that drafts nothing (block 0) leaves its drafter behind while its
        # feature rows can keep what it lacks past this step's target call (its rows: at
        # most the proposer's lookahead), so that plain decoding (`auto`'s plain arm) runs
        # no drafter graph; its next drafted block takes them all first
        if s.draft is not None and (plan.block or s.catch_up_due()):
            blocks.append((s.slot, s.tokens.bonus, plan.block, s.catch_up_tokens()))
    if joining is None and not blocks and all(plan.decodes for plan in plans):
        # every sequence verifies its last token alone this step (auto's plain arm, a
        # block with no room to draft) and no drafter has to catch up: plain decoding's
        # call, its drafters left behind
        return record(seqs, decode_call(target, seqs, draft, told=True), plans, t0)
    # the fused chain reads no logits back: a request that asks for logprobs takes the phased call
    if joining is None and fused(plans, blocks) and all(s.logprobs_top is None for s in seqs):
        return record(seqs, chain_call(target, draft, blocks, plans[0].p_min), plans, t0)
    if blocks:
        draft.propose_many(blocks)  # one drafter graph: every sequence's block
    proposals = [s.proposer.propose(s, plan) for s, plan in zip(seqs, plans)]
    return record(seqs, verify_call(target, draft, seqs, proposals, joining, t0), plans, t0)


def sequence_steps(seq: Sequence) -> Iterator[List[int]]:
    """One sequence decoded on its own, yielding the tokens of each pass (the first token,
    from the prompt, then each step's). When the loop is left by an exception, target and
    drafter must be reset before their next use, as a new run (reused=0) does."""
    clean = False
    try:
        for _ in seq.prefill_chunks():
            pass
        new = seq.first()
        clean = True
        if new:
            yield new
        clean = False
        while not seq.done:
            new = step(seq.target, seq.draft, [seq])[0]
            clean = True
            yield new
            clean = False
        clean = True
    except GeneratorExit:  # the consumer stopped at a yield: nothing is half done
        clean = True
        raise
    finally:
        seq.finish(clean)


class Batch:
    """Sequences decoded together, as a server runs them (continuous batching): a
    sequence joins at a step boundary (add) and its prompt goes in over the following
    rounds, a chunk riding in the running sequences' step; every round steps all the
    sequences past their prompt together; a sequence leaves when it is done, or when it
    is dropped (cancelled). Its slot must be its own while it is in the batch.

    n_batch (llama.cpp's -b, the logical batch): the tokens a round takes. A joining
    prompt's first chunk of the round rides in the running sequences' step, in the same
    graph, taking what their rows leave of n_ubatch (-ub, the physical batch), so that
    the running streams wait for one pass a round however long the prompt; the round's
    further prompt tokens go in whole chunks of n_ubatch while n_batch holds them, each
    a pass of its own. None: n_ubatch, one pass a round."""

    def __init__(self, target, draft, n_batch: Optional[int] = None):
        if n_batch is not None and n_batch < 1:
            raise ValueError(f"the batch size (tokens a round) must be >= 1, got {n_batch}")
        self.target, self.draft = target, draft
        self.n_batch = max(n_batch or target.n_ubatch, target.n_ubatch)
        self.joining: List[Sequence] = []  # in arrival order, the first one's prompt going in
        self.active: List[Sequence] = []

    def __len__(self) -> int:
        return len(self.joining) + len(self.active)

    def add(self, seq: Sequence) -> None:
        self.joining.append(seq)

    def drop(self, seq: Sequence, clean: bool = True) -> None:
        """Take a sequence out between rounds (cancelled, or no more tokens wanted); clean:
        as Sequence.finish (between rounds it is: nothing has run since its last step)."""
        if seq in self.joining:
            self.joining.remove(seq)
        if seq in self.active:
            self.active.remove(seq)
        seq.finish(clean)

    def advance(self) -> List[tuple]:
        """One round: one step of every sequence past its prompt, the first joining
        sequence's prompt chunk in its graph (its first token once the prompt is in: the
        chunk's row chose it), then as many more of its chunks as the round's n_batch
        holds. Returns (sequence, tokens it emitted) of the round; a sequence that is
        done has left the batch. A sequence whose chunk or step failed has left it too,
        with the exception in its `error` (a failed step fails every sequence in it,
        the joining one whose chunk it carried too)."""
        out: List[tuple] = []
        joining = self._start_joining(out)
        budget = self.n_batch
        if self.active:
            running = list(self.active)
            try:
                out += list(zip(running, step(self.target, self.draft, running, joining)))
            except Exception as e:  # noqa: BLE001
                self.active = []
                self._fail(running + ([joining] if joining is not None else []), e, out)
                if joining is not None:
                    self.joining.remove(joining)
                return out
            budget -= self.target.n_ubatch  # the step's rows and the chunk beside them: a ubatch
            if joining is not None:
                joining = self._chunk(joining, joining.chunk_ran, out)
        while joining is not None and budget >= self.target.n_ubatch:
            # the round's further chunks, whole ones, each a pass of its own (with no
            # running sequence, the first is one: n_batch is at least n_ubatch)
            budget -= self.target.n_ubatch
            joining = self._chunk(joining, joining.chunk_alone, out)
        for seq in [s for s in self.active if s.done]:
            self.active.remove(seq)
            seq.finish(clean=True)
        return out

    def _start_joining(self, out: list) -> Optional[Sequence]:
        """The first joining sequence, its prefill started (None: none joins, or its
        start failed)."""
        while self.joining:
            seq = self.joining[0]
            if seq.prefill is not None:
                return seq
            try:
                seq.start_prefill()
                return seq
            except Exception as e:  # noqa: BLE001 - the request fails, the batch goes on
                self.joining.pop(0)
                self._fail([seq], e, out)
        return None

    def _chunk(self, seq: Sequence, run: Callable[[], object], out: list) -> Optional[Sequence]:
        """The joining sequence's chunk, by `run`: a step of its own (chunk_alone), or
        what follows the running step that carried it (chunk_ran). Returns the sequence
        still joining, or None once its prompt is in (its first token chosen, it runs
        from the next round) or it failed."""
        try:
            run()
            if not seq.prefill.done:
                return seq
            self.joining.remove(seq)
            out.append((seq, seq.first()))
        except Exception as e:  # noqa: BLE001 - the request fails, the batch goes on
            if seq in self.joining:
                self.joining.remove(seq)
            self._fail([seq], e, out)
            return None
        if seq.done:
            seq.finish(clean=True)
        else:
            self.active.append(seq)
        return None

    @staticmethod
    def _fail(seqs, error: BaseException, out: list) -> None:
        for seq in seqs:
            seq.error = error
            seq.done = True
            seq.finish(clean=False)
            out.append((seq, []))

