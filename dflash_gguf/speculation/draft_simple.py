"""draft-simple (llama.cpp's `--spec-type draft-simple`): a smaller model of the target's
vocabulary (Qwen2.5-Coder-0.5B for the 1.5B, Qwen3-0.6B for the 32B) drafts
autoregressively, each draft its greedy choice given the ones before it.

The drafter is a second target-kind model (target.Target: any architecture the runtime
loads as a target) with its own memory, one slot per target slot. It reads nothing from
the target: its context is the sequence's committed tokens, which it takes by itself
before each draft (SimpleDraft.draft), so the target's memory is never touched here.

A step drafts up to n_max tokens (llama.cpp's defaults: n_max 3, n_min 0, p_min 0), each
the drafter's top choice; drafting stops before a draft whose probability is below
p_min, where the probability is llama.cpp's: its draft sampler keeps the top 10 and
takes the top choice's share of their softmax (common/speculative.cpp). A chain shorter
than n_min is dropped (the step decodes the bonus alone).

How the drafter's memory keeps in step: the committed tokens it lacks (the last step's
accepted drafts it has not kept, the bonus) go in as a decode, and the first draft comes
from its last row. A model of attention layers only then decodes each draft in turn and,
at the next step, forgets the positions of those the target rejected
(dfl_target_seq_truncate), as llama.cpp's loop removes them. A model with recurrent layers
cannot go back (neither can llama.cpp's, which keeps a checkpoint instead): there every
later draft i comes from a chain verify of drafts 1..i-1 (DFL_STEP_CHAIN), which commits
nothing; each verify but the last is dropped (commit of 0), the last waits for the next
step, which commits as many of its drafts as the target accepted -- the chain commit is
the runtime's exact rollback of the recurrent state. Those verifies cost 1 + 2 + ... +
(n_max - 1) rows where decodes cost n_max - 1 (nothing at llama.cpp's default n_max 3).
Either way a step runs one drafter graph per draft.

Tree form (SimpleProposer with tree=True): the chain and, at each depth, the drafter's
second choice as a leaf beside the chain's node; every node's token is the drafter's
choice given exactly its own path, so no drafter call is spent off the chain."""
from __future__ import annotations

import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from ..decoding.proposal import Plan, Proposal
from ..decoding.tree import DraftTree
from ..runtime.native import ffi, lib
from ..runtime.target import CHAIN, DECODE, LOGITS_LAST, Rows, Target, TargetConfig
from .auto import CHAIN as CHAIN_ARM, PLAIN, AutoBudget
from .kinds import SIMPLE
from .proposers import Proposer
from .weightless import Offer, Offers, Weightless, WeightlessKinds

# llama.cpp's draft sampler keeps the top 10 before its softmax: p-min compares the top
# choice's share of those
P_MIN_TOP_K = 10
# llama.cpp's common_speculative_are_compatible: the vocabularies' sizes may differ by
# this much, and token texts are compared from this id on
VOCAB_MAX_SIZE_DIFFERENCE = 128
VOCAB_CHECK_START_TOKEN_ID = 5


# ---- the vocabulary check ------------------------------------------------------------------

def _vocab(path: str) -> dict:
    from ..runtime.gguf_meta import GGUFMeta

    meta = GGUFMeta(path)
    return {"model": meta.get("tokenizer.ggml.model"), "tokens": meta.get("tokenizer.ggml.tokens"),
            "add_bos": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
            "add_eos": bool(meta.get("tokenizer.ggml.add_eos_token", False)),
            "bos": meta.get("tokenizer.ggml.bos_token_id"), "eos": meta.get("tokenizer.ggml.eos_token_id"),
            "arch": meta.get("general.architecture")}


def vocab_difference(target_path: str, draft_path: str) -> Optional[str]:
    """Why the drafter's vocabulary cannot draft for the target's (the first difference,
    in llama.cpp's order of checks: tokenizer kind, BOS and EOS where added, sizes more
    than VOCAB_MAX_SIZE_DIFFERENCE apart, a token's text from VOCAB_CHECK_START_TOKEN_ID
    on), or None when it can."""
    from ..runtime.drafter import tokenizer_fingerprint

    if tokenizer_fingerprint(target_path) == tokenizer_fingerprint(draft_path):
        return None  # the same tokens, merges and special ids: no need to read them
    t, d = _vocab(target_path), _vocab(draft_path)
    if t["tokens"] is None or d["tokens"] is None:
        return f"{target_path if t['tokens'] is None else draft_path} has no vocabulary (tokenizer.ggml.tokens)"
    if t["model"] != d["model"]:
        return f"the tokenizer kinds differ: the target's is {t['model']!r}, the drafter's {d['model']!r}"
    for which in ("bos", "eos"):
        add = f"add_{which}"
        if t[add] != d[add] or (t[add] and t[which] != d[which]):
            return (f"the {which.upper()} tokens differ: the target adds {t[which] if t[add] else 'none'}, "
                    f"the drafter {d[which] if d[add] else 'none'}")
    nt, nd = len(t["tokens"]), len(d["tokens"])
    if abs(nt - nd) > VOCAB_MAX_SIZE_DIFFERENCE:
        return f"the vocabulary sizes differ by more than {VOCAB_MAX_SIZE_DIFFERENCE}: the target has {nt} " \
               f"tokens, the drafter {nd}"
    for i in range(VOCAB_CHECK_START_TOKEN_ID, min(nt, nd)):
        if t["tokens"][i] != d["tokens"][i]:
            return f"token {i} differs: the target's is {t['tokens'][i]!r}, the drafter's {d['tokens'][i]!r}"
    return None


def check_vocab(target_path: str, draft_path: str) -> None:
    """ValueError naming the first difference when the drafter cannot draft for the target."""
    why = vocab_difference(target_path, draft_path)
    if why is not None:
        raise ValueError(f"draft-simple: the drafter {draft_path} does not share the vocabulary of the target "
                         f"{target_path}: {why}")


# ---- the drafter's cut head (FR-Spec, arXiv 2502.14856) ----------------------------------

# llama.cpp's token types (gguf's TokenType) that are not text: CONTROL, USER_DEFINED
SPECIAL_TOKEN_TYPES = (3, 4)


def corpus_files(paths: Sequence[str]) -> List[Path]:
    """--spec-draft-vocab-from's files: each path named, or every file under a directory
    (sorted, so that the kept set does not depend on the file system's order)."""
    out = []
    for path in map(Path, paths):
        if path.is_dir():
            out.extend(sorted(f for f in path.rglob("*") if f.is_file()))
        elif path.is_file():
            out.append(path)
        else:
            raise ValueError(f"--spec-draft-vocab-from {path}: no such file or directory")
    if not out:
        raise ValueError(f"--spec-draft-vocab-from {', '.join(map(str, paths))}: no files to count tokens in")
    return out


def corpus_counts(tokenizer, paths: Sequence[str], n_vocab: int) -> np.ndarray:
    """How often each token id occurs in the files' text (read as UTF-8, undecodable bytes
    replaced), tokenized as the target tokenizes text: the frequencies that choose the
    tokens a cut head keeps, as FR-Spec chooses them from a corpus."""
    counts = np.zeros(n_vocab, dtype=np.int64)
    for f in corpus_files(paths):
        ids = tokenizer.encode(f.read_text(encoding="utf-8", errors="replace"), add_bos=False, special=False)
        counts += np.bincount(np.asarray(ids, dtype=np.int64), minlength=n_vocab)[:n_vocab]
    return counts


def kept_tokens(path: str, n: int, counts: Optional[np.ndarray] = None) -> Tuple[int, ...]:
    """The n token ids a drafter's head keeps (--spec-draft-vocab), ascending: every special
    token (control and user-defined: a chat's end-of-turn must stay draftable), then the
    commonest: by `counts` (corpus_counts, --spec-draft-vocab-from) where given, ties and
    tokens the corpus lacks by lowest id; else the lowest ids. A byte-level BPE (Qwen's,
    Llama 3's) numbers its merges in the order it learned them, which follows their
    frequency in its training text, so without a corpus low ids are the common tokens.
    Drafts are only ever kept tokens; the target verifies each one."""
    from ..runtime.gguf_meta import GGUFMeta

    meta = GGUFMeta(path)
    tokens = meta.get("tokenizer.ggml.tokens")
    n_vocab = len(tokens) if tokens is not None else None
    if n_vocab is None:
        raise ValueError(f"{path} has no vocabulary (tokenizer.ggml.tokens): cannot pick the tokens to keep")
    if not 1 <= n <= n_vocab:
        raise ValueError(f"--spec-draft-vocab {n}: the vocabulary of {path} has {n_vocab} tokens; keep "
                         f"1..{n_vocab} (0: the whole head)")
    types = meta.get("tokenizer.ggml.token_type")
    kinds = np.asarray(types, dtype=np.int64) if types is not None else np.ones(n_vocab, np.int64)
    special = np.flatnonzero(np.isin(kinds, SPECIAL_TOKEN_TYPES))
    if len(special) > n:
        raise ValueError(f"--spec-draft-vocab {n} is fewer than the vocabulary's {len(special)} special tokens, "
                         "which a cut head always keeps")
    rest = np.setdiff1d(np.arange(n_vocab), special, assume_unique=True)
    if counts is not None:
        rest = rest[np.argsort(-np.asarray(counts)[rest], kind="stable")]  # stable: ties keep the lower id
    rest = rest[:n - len(special)]
    return tuple(int(t) for t in np.sort(np.concatenate([special, rest])))


def replayed_lengths(logits, kept, prompt_len: int, full, n_max: int) -> List[int]:
    """The tokens per target pass a greedy chain of n_max drafts makes, each draft the
    drafter's argmax over the kept tokens: from the drafter's logits over prompt and output
    (row r predicts full[r + 1]; a draft is read at its row only after the ones before it
    were accepted, i.e. equal to the output there) and the output it must reproduce.
    The first output token comes from the prompt's pass; as the engine's loop, a step
    drafts no more than the request still wants after its bonus."""
    return chain_lengths(np.asarray(kept)[np.argmax(logits[:, kept], axis=1)], prompt_len, full, n_max)


def chain_lengths(choice, prompt_len: int, full, n_max: int) -> List[int]:
    """replayed_lengths from the drafter's choice at each row (its argmax: row r's choice
    drafts full[r + 1])."""
    n_out = len(full) - prompt_len
    lengths, emitted = [], 1
    while emitted < n_out:
        bonus = prompt_len + emitted - 1
        room = max(0, min(n_max, n_out - emitted - 1))
        accepted = 0
        while accepted < room and choice[bonus + accepted] == full[bonus + accepted + 1]:
            accepted += 1
        lengths.append(accepted + 1)
        emitted += accepted + 1
    return lengths


# ---- the drafter -------------------------------------------------------------------------

@dataclass(slots=True)
class Held:
    """What a drafter slot holds: history[offset:offset + n], `history` the list of the
    sequence that drafted in it last (decoding.Tokens.text, read, never copied; offset > 0:
    a window of it, where draft() was told to catch up on fewer than it lacked)."""

    history: List[int]
    offset: int = 0
    n: int = 0

    @property
    def end(self) -> int:
        return self.offset + self.n


class SimpleDraft:
    """The drafter model and what each of its slots holds: `held[slot]` the tokens it keeps
    (a Held window of the history of the sequence that drafted in it last; None: unknown,
    the slot is started afresh at its next use), `pending[slot]` the drafts it took after
    them, of which the next draft keeps as many as the target accepted:
    decoded, then truncated away where the model's memory can go back (`truncates`:
    attention layers only), else verified as a chain, whose commit keeps them."""

    def __init__(self, path: str, config: TargetConfig, target: Target, draft_vocab: int = 0,
                 counts: Optional[np.ndarray] = None):
        """draft_vocab > 0: the drafter's output head cut to that many tokens (kept_tokens,
        the commonest by `counts` where given)."""
        check_vocab(target.path, path)
        if draft_vocab:
            config = replace(config, head_tokens=kept_tokens(path, draft_vocab, counts))
        self.model = Target(path, config)
        if self.model.n_vocab < target.n_vocab:
            n = self.model.n_vocab
            self.model.close()
            raise ValueError(f"draft-simple: the drafter {path} has {n} token embeddings, fewer than the "
                             f"target's {target.n_vocab}: it cannot read every token the target commits")
        self.path = str(path)
        self.n_vocab = target.n_vocab  # drafts past the target's vocabulary are never proposed
        n = self.model.n_seq
        self.held: List[Optional[Held]] = [Held([]) for _ in range(n)]
        self.fed = (0, 0.0)  # the last draft()'s catching up: tokens taken, seconds
        self.pending: List[Optional[List[int]]] = [None] * n
        self.ranked = [False] * n  # the slot's sampling ranks P_MIN_TOP_K candidates (else: the argmax)
        self.truncates = self.model.can_truncate()

    def close(self) -> None:
        self.model.close()

    def reset(self) -> None:
        self.model.reset()
        self.held = [Held([]) for _ in self.held]
        self.pending = [None] * len(self.pending)

    CATCH_UP_PROBE = 16  # tokens prices() feeds: a cold probe's catching up is about as long
    # its feeds: the first does the drafter's first-time work (its buffers, its weights
    # read in), as llama.cpp's warm-up run does at load; the third is the thread
    # governor's one look at fewer threads at the start (csrc/dfl_threads.c), which would
    # otherwise slow a request's first drafted step
    CATCH_UP_FEEDS = 3
    DRAFT_STEPS = 3  # drafted steps prices() times after the feeds, the best kept

    def prices(self, n_max: int) -> Dict[str, float]:
        """What the drafter's work costs, in seconds, as `auto`'s step parts
        (speculation/auto.py StepCosts): "catch_up", a token of catching up, fed
        CATCH_UP_PROBE at once in slot 0 as draft() feeds what it lacks (the best of
        CATCH_UP_FEEDS feeds); "drafter", a drafted step's drafter work, the bonus taken
        and n_max drafts made as draft() makes them (the best of DRAFT_STEPS): the least a
        chain step adds to its verify. Leaves every slot empty."""
        self._rank(0, False)
        history = list(range(self.CATCH_UP_PROBE))  # any tokens cost the same
        feed = float("inf")
        for _ in range(self.CATCH_UP_FEEDS):
            self.model.seq_reset(0)
            t0 = time.perf_counter()
            self.model.step([Rows(0, DECODE, history, logits=LOGITS_LAST)])
            feed = min(feed, time.perf_counter() - t0)
        self.reset()
        self.draft(0, history, n_max)  # takes the history, drafts after it
        step = float("inf")
        for _ in range(self.DRAFT_STEPS):
            history.append(len(history))  # a bonus after drafts the target did not take
            t0 = time.perf_counter()
            self.draft(0, history, n_max)
            step = min(step, time.perf_counter() - t0)
        self.reset()
        return {"catch_up": feed / self.CATCH_UP_PROBE, "drafter": step}

    # -- one slot -----------------------------------------------------------------------
    def _settle(self, slot: int, history: List[int], n_committed: int) -> Held:
        """Commit the slot's pending verify as far as the history's committed tokens (its
        first n_committed) agree with it; a slot that does not hold a window of them
        starts afresh. Returns what it holds. The history of the sequence that drafted
        last is trusted without a look (it only grows); another's is compared once."""
        model, held, pending = self.model, self.held[slot], self.pending[slot]
        self.pending[slot] = None
        if held is not None and held.history is not history:
            end = held.end
            if end > n_committed or history[held.offset:end] != held.history[held.offset:end]:
                held = None
            else:
                held.history = history
        if held is None or held.end > n_committed:
            model.seq_reset(slot)
            held = Held(history)
        elif pending is not None:
            k = 0
            while k < len(pending) and held.end + k < n_committed and pending[k] == history[held.end + k]:
                k += 1
            if self.truncates:
                model.seq_truncate(slot, held.n + k)
            else:
                model.commit(k, seq=slot)
            held.n += k
        self.held[slot] = held
        return held

    def _rank(self, slot: int, ranked: bool) -> None:
        if self.ranked[slot] == ranked:
            return
        s = ffi.new("dfl_sampling *")
        lib.dfl_sampling_default(s)
        if ranked:  # llama.cpp's draft sampler: top-k 10, softmax at temperature 1
            s.temperature, s.top_k = 1.0, P_MIN_TOP_K
        self.model.set_sampling(s, seq=slot)
        self.ranked[slot] = ranked

    def _top(self, slot: int, row: int, ranked: bool) -> Tuple[List[int], List[float]]:
        """The last call's row: its top choices (the best first; two when ranked) and
        their shares of the top P_MIN_TOP_K's softmax (ranked), else the argmax alone
        (share 1)."""
        if not ranked:
            return [int(self.model.choices(row, 1)[0])], [1.0]
        toks, probs = self.model.candidates(row, 1, P_MIN_TOP_K)
        return [int(t) for t in toks[0, :2]], [float(p) for p in probs[0, :2]]

    def _uniforms(self, slot: int, ranked: bool, n: int) -> None:
        if ranked:  # the draw is not used (the top choice is): any uniforms do
            self.model.set_uniforms(np.zeros(n, dtype=np.float32), seq=slot)

    def draft(self, slot: int, history: List[int], n_max: int, p_min: float = 0.0,
              siblings: bool = False, shares: bool = False,
              window: int = 0) -> Tuple[List[int], List[Optional[int]], List[float]]:
        """Up to n_max drafts after the bonus for the sequence in `slot` whose history is
        `history` (its committed tokens, then the bonus: decoding.Tokens.text): each the
        drafter's top choice given the ones before, stopping before one whose share is
        below p_min. Returns
        the drafts, each position's second choice (with siblings; None where there is
        none) and each draft's share of the drafter's top P_MIN_TOP_K (ranked: with
        siblings, p_min > 0 or shares; else 1). n_max 0: nothing (no drafter graph).
        window > 0: a drafter lacking more than `window` of the committed tokens starts
        afresh from the context's last `window` (drafts from less context, for less than
        catching up on all of them costs; the target verifies them as any)."""
        # its context holds the committed tokens, the bonus and the drafts but the last (-cd
        # may make it shorter than the target's: it stops drafting where it is full)
        self.fed = (0, 0.0)
        n_committed = len(history) - 1
        n_max = min(n_max, self.model.n_ctx - n_committed)
        if n_max < 1:
            return [], [], []  # nothing to draft: the drafter takes the tokens it lacks at its next draft
        ranked = siblings or p_min > 0 or shares
        try:
            self._rank(slot, ranked)
            held = self._settle(slot, history, n_committed)
            model = self.model
            if window and n_committed - held.end > window:
                model.seq_reset(slot)
                held = self.held[slot] = Held(history, n_committed - window)
            feed = history[held.end:]  # the committed tokens it lacks and the bonus
            t0 = time.perf_counter()
            ub = model.n_ubatch
            for start in range(0, len(feed), ub):
                chunk = feed[start:start + ub]
                last = start + len(chunk) == len(feed)
                if last:
                    self._uniforms(slot, ranked, 1)
                model.step([Rows(slot, DECODE, chunk, logits=LOGITS_LAST if last else 0)])
            self.fed = (len(feed), time.perf_counter() - t0)
            held.n += len(feed)
            drafts: List[int] = []
            seconds: List[Optional[int]] = []
            kept_shares: List[float] = []
            top, share = self._top(slot, 0, ranked)
            while True:
                if share[0] < p_min or top[0] >= self.n_vocab:
                    break
                drafts.append(top[0])
                kept_shares.append(share[0])
                second = top[1] if len(top) > 1 and top[1] < self.n_vocab else None
                seconds.append(second)
                if len(drafts) >= n_max:
                    break
                if self.truncates:  # the draft decoded: dropped again by the next _settle
                    self._uniforms(slot, ranked, 1)
                    model.step([Rows(slot, DECODE, drafts[-1:], logits=LOGITS_LAST)])
                    row = 0
                else:  # the drafts so far verified as a chain: the previous one's dropped
                    if self.pending[slot] is not None:
                        model.commit(0, seq=slot)
                    self._uniforms(slot, ranked, len(drafts))
                    model.step([Rows(slot, CHAIN, list(drafts))])
                    row = len(drafts) - 1
                self.pending[slot] = list(drafts)
                top, share = self._top(slot, row, ranked)
            return drafts, seconds, kept_shares
        except BaseException:
            self.held[slot], self.pending[slot] = None, None  # started afresh at its next use
            raise


# ---- the proposer --------------------------------------------------------------------------

def sibling_tree(bonus: int, drafts: Sequence[int], seconds: Sequence[Optional[int]]) -> DraftTree:
    """The chain of drafts below the bonus and, at each depth, the second choice as a
    leaf beside the chain's node (the same parent); nodes by depth, the chain's first."""
    tokens, parents, depths = [int(bonus)], [-1], [0]
    chain_node = 0
    for depth, (d, s) in enumerate(zip(drafts, seconds), start=1):
        parent = chain_node
        chain_node = len(tokens)
        tokens.append(int(d))
        parents.append(parent)
        depths.append(depth)
        if s is not None and s != d:
            tokens.append(int(s))
            parents.append(parent)
            depths.append(depth)
    n = len(tokens)
    return DraftTree(tokens, parents, depths, [0.0] * n, list(range(1, n)))


@dataclass(slots=True)
class SimpleHeld:
    """What draft-simple beside the weightless kinds keeps of a sequence from step to
    step (Sequence.proposing): its weightless sources and the small model's kept drafts
    per step, a running mean."""

    weightless: Weightless
    kept: float = 1.0


@dataclass(frozen=True, slots=True)
class OfferStep(Plan):
    """A step of draft-simple beside the weightless kinds that verifies the offer found
    before the drafter's graph (no small-model graph runs)."""

    offer: Optional[Offer] = None


class SimpleProposer(Proposer):
    """Each step verifies the bonus and the small model's drafts (SimpleDraft.draft): a
    chain, or with `tree` the chain and the second choices beside it, padded to one size
    so that the target's verify graph is reused. Sampled, every verified row's token is
    the target's draw and the walk goes on while it is a child: exact for drafts fixed in
    advance (the drafter's own choices here).

    With `auto` (this sequence's budget.AutoBudget, with plain decoding and the chain as
    its arms) each step runs the arm it chooses: plain decoding (the drafter runs nothing
    and stays behind, to take the tokens it lacks at its next draft) or the chain, cut
    where the drafts' shares, calibrated, say it pays at the verify's cost by rows
    (AutoBudget.chain_cut); the step carries auto's Decision (Plan.auto), what it drafted
    added in propose (the drafter's catching up, the cut), and every step's outcome goes
    back to it with that decision (AutoBudget.learn)."""

    def __init__(self, draft: SimpleDraft, n_max: int, n_min: int = 0, p_min: float = 0.0, tree: bool = False,
                 auto: Optional[AutoBudget] = None):
        self.draft = draft
        self.n_max, self.n_min, self.p_min, self.tree, self.auto = n_max, n_min, p_min, tree, auto
        self.lookahead = 1 + n_max * (2 if tree else 1)

    def plan(self, seq) -> Plan:
        room = seq.draft_room(self.n_max)
        decision = None
        if self.auto is not None and room > 0:
            self.auto.at_depth(seq.tokens.n_past)
            decision = self.auto.choose()
        return Plan(decodes=decision is not None and decision.arm == PLAIN, auto=decision)

    def propose(self, seq, plan: Plan) -> Proposal:
        if plan.decodes:  # auto's plain arm, beside sequences that draft: the bonus alone
            return Proposal([seq.tokens.bonus])
        n = seq.draft_room(self.n_max)
        grammar = seq.sampler.guide
        decision = plan.auto
        auto = self.auto if decision is not None else None
        drafts, seconds, shares = self.draft.draft(seq.slot, seq.tokens.text, n, self.p_min,
                                                   siblings=self.tree and grammar is None, shares=auto is not None,
                                                   window=decision.window if auto is not None else 0)
        cut = None
        if auto is not None and drafts:
            cut = auto.chain_cut(np.log(np.maximum(shares, 1e-30)))
            drafts = drafts[:cut.n]
        if len(drafts) < self.n_min:
            drafts, seconds = [], []
        if grammar is not None and drafts:
            drafts = grammar.draft_path(drafts)  # cut before the first draft the grammar rejects
        if self.tree and drafts and grammar is None:
            tree = sibling_tree(seq.tokens.bonus, drafts, seconds)
            if len(tree) > len(drafts) + 1:
                return Proposal(tree=tree.padded_to(self.lookahead), kind=SIMPLE, nodes=len(tree) - 1,
                                plan=self._decided(plan, cut))
        if cut is not None and decision.arm == CHAIN_ARM:  # auto hears of the drafts verified, after every cut
            cut = cut.verifying(len(drafts))
        settled = self._decided(plan, cut)
        if self.tree:  # a tree step that verifies a chain (no second choices, a grammar)
            return Proposal([seq.tokens.bonus] + list(drafts), kind=SIMPLE, nodes=len(drafts), as_chain=True,
                            plan=settled)
        return Proposal([seq.tokens.bonus] + list(drafts), kind=SIMPLE, plan=settled)

    def _decided(self, plan: Plan, cut) -> Optional[Plan]:
        """The step's plan with what its propose added to auto's decision: the drafter's
        catching up and the chain's cut (None: no decision, the plan as planned)."""
        if plan.auto is None:
            return None
        return replace(plan, auto=replace(plan.auto, cut=cut, caught_up=self.draft.fed))

    def verified(self, seq, plan, proposal, path, out, seconds) -> None:
        if plan.auto is not None:
            self.auto.learn(plan.auto, len(path) - 1, seconds)

    def finish(self, seq) -> Optional[dict]:
        """The sequence ended: its statistics get auto's report, and what auto learnt goes
        to the next sequence."""
        if self.auto is None:
            return None
        report = self.auto.report()
        self.auto.finish()
        return report


class SimpleWeightlessProposer(SimpleProposer):
    """`--spec-type draft-simple,suffix` (or beside an n-gram kind, or both): each step a
    weightless offer (weightless.Offers: from the request's own text, suffix's also from
    its corpus key's earlier requests) where it pays more than the small model (chosen),
    else the small model's drafts, as SimpleProposer drafts them. An offer's step runs no
    small-model graph: the small model stays behind and takes the tokens it lacks at its
    next draft, as after auto's plain steps. Both choices are fixed before the target's
    draws, so greedy output is the target's own and sampled output is distributed as its
    sampling."""

    # the weight of the last step in the small model's running mean of kept drafts
    KEPT_WEIGHT = 0.2

    def __init__(self, draft: SimpleDraft, n_max: int, n_min: int, p_min: float, tree: bool,
                 auto: Optional[AutoBudget], kinds: WeightlessKinds, cost=None):
        super().__init__(draft, n_max, n_min, p_min, tree, auto)
        self.kinds = kinds
        self.cost = cost  # verify_cost.VerifyCost, which prices offers against auto's arms
        self.lookahead = max(self.lookahead, kinds.n_max + 1)

    def start(self, seq) -> SimpleHeld:
        return SimpleHeld(self.kinds.start())

    def chosen(self, step: Offers, kept: float, depth: int = 0) -> Optional[Offer]:
        """The offer the step verifies instead of the small model's drafts (None: the
        small model's turn). With auto and the verify cost: the offer with the most
        expected tokens per second (Offers.cheapest), where it beats the rate auto
        expects of the arm it runs (plain decoding's or the small model's chain, both
        from measured costs; an arm not yet measured, nothing). Otherwise the likeliest
        offer, where it expects to keep at least one draft and more than the small model
        has kept per step lately (`kept`). depth: the tokens of context the step verifies
        after, which price its rows."""
        if self.auto is not None and self.cost is not None:
            self.auto.at_depth(depth)
            offer, rate = step.cheapest(self.cost, depth)
            return offer if offer is not None and rate > self.auto.rate(self.auto.current) else None
        offer = step.likeliest()
        return offer if offer is not None and offer.expected >= max(1.0, kept) else None

    def plan(self, seq) -> Plan:
        held, n_max = seq.proposing, self.kinds.n_max
        step = held.weightless.offers(seq.tokens.text, n_max, seq.draft_room(n_max))
        offer = self.chosen(step, held.kept, seq.tokens.n_past)
        if offer is not None:
            return OfferStep(judged=step.judged(offer), offer=offer)
        return replace(super().plan(seq), judged=step.judged(None))

    def propose(self, seq, plan: Plan) -> Proposal:
        if isinstance(plan, OfferStep):
            return plan.offer.proposal(seq.tokens.bonus, seq.room, seq.sampler.guide)
        return super().propose(seq, plan)

    def verified(self, seq, plan, proposal, path, out, seconds) -> None:
        held = seq.proposing
        held.weightless.observe(out, plan.judged)
        if isinstance(plan, OfferStep):
            return
        super().verified(seq, plan, proposal, path, out, seconds)
        if proposal.tree is not None or len(proposal.tokens) > 1:  # the small model drafted
            w = self.KEPT_WEIGHT
            held.kept = (1 - w) * held.kept + w * (len(path) - 1)

    def finish(self, seq) -> Optional[dict]:
        report = super().finish(seq)
        seq.proposing.weightless.finish(seq)
        return report
