"""What a request is and what its decoding records (Request, Placement, GenerationStats
with its TreeSteps, GraphCounts and DraftCounts), and what every decoding mode does before
its step loop (decoding/step.py): the request's checks, keeping or emptying its slot's context,
its prompt's prefill in chunks."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Dict, Iterable, Iterator, List, Optional

from ..runtime.target import DECODE, LOGITS_LAST, LOGITS_NONE, Rows, Target
from .sampling import SamplingParams


@dataclass
class DraftCounts:
    """The drafts by kind (Proposal.kind: the weightless kinds, draft-simple; else the
    drafter model's kind: dflash, eagle3, mtp, dspark): per kind the tokens drafted (a tree's nodes below the root, padding left
    out) and accepted; of suffix's, those drafted from the corpus of earlier requests (not
    the sequence's own text). A request's, or the server's over its requests."""

    drafted: Dict[str, int] = field(default_factory=dict)
    accepted: Dict[str, int] = field(default_factory=dict)
    corpus_drafted: int = 0
    corpus_accepted: int = 0

    def count(self, kind: str, drafted: int, accepted: int, corpus: bool = False) -> None:
        self.drafted[kind] = self.drafted.get(kind, 0) + drafted
        self.accepted[kind] = self.accepted.get(kind, 0) + accepted
        if corpus:
            self.corpus_drafted += drafted
            self.corpus_accepted += accepted

    def add(self, other: DraftCounts) -> None:
        for kind, n in other.drafted.items():
            self.count(kind, n, other.accepted.get(kind, 0))
        self.corpus_drafted += other.corpus_drafted
        self.corpus_accepted += other.corpus_accepted

    def per_kind(self) -> Dict[str, Dict[str, int]]:
        """{kind: {"drafted": n, "accepted": n}}, as the reports write it."""
        return {k: {"drafted": n, "accepted": self.accepted.get(k, 0)} for k, n in self.drafted.items()}


@dataclass
class GraphCounts:
    """The target's step graphs after the prompt (a batch's shared graph counts for each
    of its sequences): how many, the splits of the last (its runs on one backend), and the
    bytes they copied between devices (activations; weights too where a device takes an op
    whose weight is in host memory)."""

    steps: int = 0
    splits: int = 0
    copy_bytes: int = 0

    def record(self, splits: int, copy_bytes: int) -> None:
        self.steps += 1
        self.splits = splits
        self.copy_bytes += copy_bytes

    @property
    def copy_bytes_per_step(self) -> float:
        return self.copy_bytes / self.steps if self.steps else 0.0


@dataclass
class TreeSteps:
    """What tree mode's steps were: the nodes below the root per tree step, the steps where
    `auto` verified the plain chain instead, and `--tree-budget auto`'s report (per arm the
    steps it ran, the tokens a step they made and the cost model's figures; the measured
    parts of a step: budget.AutoBudget.report)."""

    sizes: List[int] = field(default_factory=list)
    chain_steps: int = 0
    auto: Optional[dict] = None

    @property
    def mean_nodes(self) -> float:
        return sum(self.sizes) / len(self.sizes) if self.sizes else 0.0


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    reused_tokens: int = 0  # prompt tokens already in context from the previous call
    prompt_in_slot: int = 0  # the prompt's tokens in the slot so far, the reused ones too (prefill's progress)
    generated_tokens: int = 0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    stop_reason: str = ""
    stop_string: Optional[str] = None  # the stop string that ended generation (stop_reason "stop string")
    accepted_lengths: List[int] = field(default_factory=list)
    # per speculative step: drafting (the drafter's graph, its candidates, the tree),
    # verifying (the target's graph, which also carries out the previous step's commit,
    # and reading its choices back) and the host's other work in the step (the commit
    # calls only record what the next verify graph does)
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    other_seconds: float = 0.0
    trees: TreeSteps = field(default_factory=TreeSteps)
    # the prefix checkpoint the prompt resumed from: {"position", "device_bytes",
    # "host_bytes"} (what it and the checkpoints it reads from hold where), or None
    checkpoint: Optional[dict] = None
    graphs: GraphCounts = field(default_factory=GraphCounts)
    drafts: DraftCounts = field(default_factory=DraftCounts)
    # every kind's drafts together, the drafter's included (DraftCounts holds only the kinds
    # that name themselves): tokens put to the target (a tree's nodes below its root) and
    # of them accepted, as llama-server's timings draft_n and draft_n_accepted
    drafted_tokens: int = 0
    accepted_drafts: int = 0
    # each kept token's logprobs.TokenLogprob (TokenProb: Request.post_sampling), when the
    # request asked (Request.logprobs)
    logprobs: List = field(default_factory=list)

    @property
    def mean_accepted(self) -> float:
        """Mean tokens produced per target pass (AL)."""
        n = self.accepted_lengths
        return sum(n) / len(n) if n else 0.0

    @property
    def prefill_tps(self) -> float:
        computed = self.prompt_tokens - self.reused_tokens
        return computed / self.prefill_seconds if self.prefill_seconds > 0 else 0.0

    @property
    def decode_tps(self) -> float:
        return self.generated_tokens / self.decode_seconds if self.decode_seconds > 0 else 0.0


@dataclass(frozen=True)
class Request:
    """What a sequence is asked for: `max_tokens` after `prompt` (token ids), ending at a
    stop token (None: none, or to an Engine the model's end-of-generation tokens);
    greedy unless `sampling` says otherwise; context_full "error" refuses upfront a
    request that could overflow the context, "stop" ends generation (stop_reason
    "context") when it is full; reuse_prefix False computes the whole prompt, reading
    neither the context a slot holds nor a prefix checkpoint (llama-server's
    cache_prompt false: a cold answer to compare with); corpus: the key of the suffix
    corpus it drafts from and adds to (`--spec-type suffix`; None: the corpus of
    requests without one; dflash-server's is a digest of the request's API key);
    logprobs: the target's log-probability of each emitted token and its `logprobs` most
    likely alternatives (0: the token's alone) in the stats (GenerationStats.logprobs;
    None: not asked: nothing read back); post_sampling: those as probabilities after the
    sampler's rules instead (logprobs.TokenProb; llama-server's post_sampling_probs)."""

    prompt: List[int]
    max_tokens: int
    stop_tokens: Optional[Iterable[int]] = None
    sampling: Optional[SamplingParams] = None
    context_full: str = "error"
    reuse_prefix: bool = True
    corpus: Optional[str] = None
    logprobs: Optional[int] = None
    post_sampling: bool = False


@dataclass(frozen=True)
class Placement:
    """Where a sequence runs and who watches it: its slot of the target's (and drafter's)
    memory, the prompt tokens the slot already holds (`reused`; 0: it is emptied first),
    on_stage (see Engine.stage_hook: "prefilled", then each step's stages) and saver (a
    checkpoints.PrefillSaver: the prefill stops at its positions for it to take
    checkpoints of target and drafter)."""

    slot: int = 0
    reused: int = 0
    on_stage: Optional[Callable[[str], None]] = None
    saver: object = None


def start_context(target: Target, prompt: List[int], reused: int, draft=None, seq: int = 0) -> int:
    """Empty the sequence's slot of the target (and drafter) unless it holds
    prompt[:reused] (a target of one slot is reset whole); returns how many prompt tokens
    are already in context."""
    if reused and (not 0 < reused < len(prompt) or target.seq_n_past(seq) != reused):
        raise ValueError(f"cannot continue a context of {target.seq_n_past(seq)} tokens with {reused} reused "
                         "prompt tokens")
    if not reused:
        if target.n_seq == 1:
            target.reset()
            if draft is not None:
                draft.reset()
        else:
            target.seq_reset(seq)
            if draft is not None:
                draft.seq_reset(seq)
    return reused


class Prefill:
    """A prompt going into its sequence's slot a chunk at a time, after prompt[:start]:
    rows(limit) gives the next chunk (a decode of at most `limit` tokens, ending at the
    saver's positions; the prompt's last row chooses the first token), whoever runs it
    (a step of its own, or a step beside other sequences' rows), then ran() lets the
    drafter (when given) take the chunk's features, tells on_stage ("prefill chunk"; an
    exception it raises stops the prefill there) and has a checkpoints.PrefillSaver take
    its checkpoint where the chunk ends at one of its positions. A drafter behind the
    context it continues (its last step's committed tokens, taken only by its next
    graph) takes them first, before a chunk replaces their features."""

    def __init__(self, target: Target, prompt: List[int], start: int, draft=None, saver=None,
                 on_stage: Optional[Callable[[str], None]] = None, seq: int = 0,
                 stats: Optional[GenerationStats] = None):
        self.target, self.prompt, self.draft, self.saver, self.seq = target, prompt, draft, saver, seq
        self.on_stage, self.stats = on_stage, stats
        self.marks = sorted(p for p in (saver.positions if saver else ()) if start < p <= len(prompt))
        self.pos = start  # prompt tokens in the slot
        self._end = start
        if draft is not None and draft.n_past(seq) < start:
            draft.append(prompt[draft.n_past(seq):start], seq=seq)

    @property
    def done(self) -> bool:
        return self.pos >= len(self.prompt)

    def span(self, limit: int) -> int:
        """The tokens of the next chunk at `limit`: at most that many, up to the next
        checkpoint position."""
        return min([m for m in self.marks if m > self.pos] + [len(self.prompt), self.pos + limit]) - self.pos

    def rows(self, limit: int) -> Rows:
        """The next chunk: at most `limit` tokens, up to the next checkpoint position."""
        end = self.pos + self.span(limit)
        self._end = end
        return Rows(self.seq, DECODE, self.prompt[self.pos:end],
                    logits=LOGITS_LAST if end == len(self.prompt) else LOGITS_NONE)

    def step_alone(self) -> None:
        """Run the next chunk, at most n_ubatch tokens, in a target step of its own (its
        choice, if any, at row 0); ran() follows."""
        self.target.step([self.rows(self.target.n_ubatch)])

    def ran(self) -> None:
        """The chunk rows() gave has run."""
        chunk = self.prompt[self.pos:self._end]
        self.pos = self._end
        if self.stats is not None:
            self.stats.prompt_in_slot = self.pos
        if self.draft is not None:
            self.draft.append(chunk, seq=self.seq)
        if self.on_stage is not None:
            self.on_stage("prefill chunk")
        if self.pos in self.marks:
            self.saver.save(self.pos)


def prefill_chunks(target: Target, prompt: List[int], start: int, draft=None, saver=None,
                   on_stage: Optional[Callable[[str], None]] = None, seq: int = 0) -> Iterator[None]:
    """Put prompt[start:] into the sequence's context (Prefill), each chunk of up to
    n_ubatch tokens in a step of its own, yielding after each."""
    prefill = Prefill(target, prompt, start, draft, saver, on_stage, seq)
    while not prefill.done:
        prefill.step_alone()
        prefill.ran()
        yield


CONTEXT_FULL = ("error", "stop")


def check_request(target: Target, prompt: List[int], max_tokens: int, lookahead: int,
                  context_full: str = "error") -> None:
    """Refuse what cannot run: with context_full="error", a request whose prompt, tokens
    and verify lookahead could overflow the context; with "stop" (generation ends when
    the context is full), only a prompt that does not fit."""
    if context_full not in CONTEXT_FULL:
        raise ValueError(f"context_full must be one of {', '.join(CONTEXT_FULL)}, got {context_full!r}")
    if not prompt:
        raise ValueError("the prompt is empty")
    if max_tokens < 0:
        raise ValueError("max_tokens must be >= 0")
    if context_full == "stop":
        if len(prompt) > target.n_ctx:
            raise ValueError(f"the prompt ({len(prompt)} tokens) exceeds the context size ({target.n_ctx})")
        return
    if len(prompt) + max_tokens + lookahead > target.n_ctx:
        raise ValueError(f"prompt ({len(prompt)} tokens) + max tokens ({max_tokens})"
                         + (f" + block ({lookahead})" if lookahead else "")
                         + f" exceed the context size ({target.n_ctx}); raise n_ctx, generate fewer tokens, "
                         "or let generation stop when the context is full (context_full='stop', "
                         "dflash-run --context-full stop)")


def check_bias(target: Target, sampling) -> None:
    """Refuse a logit bias of a token outside the target's vocabulary."""
    bias = sampling.logit_bias if sampling is not None else None
    out = [t for t, _ in bias or () if t >= target.n_vocab]
    if out:
        raise ValueError(f"logit_bias: token {out[0]} is outside the vocabulary (0..{target.n_vocab - 1})")


def collect(steps: Iterator[List[int]], on_tokens: Optional[Callable[[List[int]], None]] = None) -> List[int]:
    out: List[int] = []
    for new in steps:
        out.extend(new)
        if on_tokens is not None:
            on_tokens(new)
    return out
