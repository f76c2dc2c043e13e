"""What the decoding tests share: seeded prompts, z-lab's reference drafter logits,
scripted drafters, llama-speculative-simple's loop with our drafters, runs alone and
in a batch."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import torch

from dflash_gguf.speculation.auto import AutoMemory
from dflash_gguf.decoding.step import Batch, Sequence, sequence_steps
from dflash_gguf.speculation.draft_simple import SimpleDraft
from dflash_gguf.decoding.requests import GenerationStats, Placement, Request, collect
from dflash_gguf.speculation.proposers import PlainProposer
from dflash_gguf.speculation.drafting import chain_proposer, tree_proposer
from dflash_gguf.runtime.target import LOGITS_LAST, LOGITS_NONE, Target, TargetConfig

from helpers.loops import tree_generate


BLOCK = 8


def prompts(n, seed=0, vocab=1000):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, size=int(rng.integers(5, 40))).tolist() for _ in range(n)]


def reference_models(pair):
    from dflash.model import DFlashDraftModel
    from transformers import Qwen3_5ForCausalLM

    target = Qwen3_5ForCausalLM.from_pretrained(str(pair["target_dir"]), dtype=torch.float32).eval()
    draft = DFlashDraftModel.from_pretrained(str(pair["draft_dir"]), dtype=torch.float32).eval()
    return target, draft


def reference_draft_logits(target, draft, context, bonus):
    from dflash.model import extract_context_feature

    with torch.no_grad():
        out = target(torch.tensor([context]), output_hidden_states=True)
        feats = extract_context_feature(out.hidden_states, draft.target_layer_ids)
        noise = target.get_input_embeddings()(torch.tensor([[bonus] + [draft.mask_token_id] * (BLOCK - 1)]))
        pos = torch.arange(len(context) + BLOCK)[None]
        hidden = draft(target_hidden=feats, noise_embedding=noise, position_ids=pos, use_cache=False)
        return draft.compute_logits(hidden[:, 1:], target.lm_head)[0].numpy()


class ScriptedDraft:
    """A stand-in drafter that proposes the known greedy continuation with mistakes at
    about one in `wrong_every` positions (seeded), so many acceptance lengths and commit
    paths get exercised."""

    def __init__(self, prompt_len, continuation, block_size, wrong_every):
        self.prompt_len = prompt_len
        self.truth = continuation
        self.block_size = block_size
        rng = np.random.default_rng(wrong_every)
        self.wrong = {k for k in range(len(continuation)) if rng.integers(wrong_every) == 0}
        self.ctx = 0

    def reset(self):
        self.ctx = 0

    def n_past(self, seq=0):
        return self.ctx

    def append(self, tokens=(), seq=0):
        self.ctx += len(tokens)

    def propose_many(self, blocks):
        for seq, bonus, n_block, tokens in blocks:
            self.append(tokens, seq)
            if n_block:
                self.propose(bonus, n_block, read=False, seq=seq)

    def set_sampling(self, native, seq=0):
        assert native.temperature <= 0, "the scripted drafter drafts its known continuation only"

    def propose(self, bonus, n_block=None, read=True, seq=0):
        b = self.block_size if n_block is None else n_block
        i = self.ctx - self.prompt_len  # the bonus is continuation token i
        assert self.truth[i] == bonus
        drafts = []
        for k in range(i + 1, i + b):
            tok = self.truth[k] if k < len(self.truth) else 0
            drafts.append((tok + 1) % 1000 if k in self.wrong else tok)
        self._block = [bonus] + drafts
        return drafts if read else []

    def block(self, n, seq=0):
        return self._block[:n]


class HostBlocks:
    """A target as a scripted drafter's steps see it: a chain row that would read the
    drafter's block on the device reads the scripted block from the host instead."""

    def __init__(self, target):
        self.target = target

    def step(self, rows, draft=None):
        self.target.step([replace(r, tokens=draft.block(r.n, seq=r.seq)) if r.tokens is None else r for r in rows])

    def __getattr__(self, name):
        return getattr(self.target, name)


def rel_err(a, b):
    return float(np.abs(np.asarray(a) - np.asarray(b)).max() / (np.abs(np.asarray(b)).max() + 1e-12))


def prefill(target, draft, tokens, seq=0):
    """The tokens into the sequence's slot a chunk at a time, the drafter taking each."""
    target.prefill(tokens, LOGITS_LAST, on_chunk=lambda s, n: draft.append(tokens[s:s + n], seq=seq), seq=seq)


def our_draft_mtp(target, draft, tokens, n_predict, n_max, n_ctx, eog):
    """llama-speculative-simple's loop (speculative_simple_loop) with our target and an
    autoregressive drafter (MTP, EAGLE3): every step drafts n_max after the last token.
    Its counts."""
    from helpers.speculative_simple import speculative_simple_loop

    target.reset()
    draft.reset()
    prefill(target, draft, tokens[:-1])
    return speculative_simple_loop(target, lambda last, pending, room: draft.propose(last, n_max + 1, tokens=pending),
                                   tokens, n_predict, n_ctx, eog)


def check_plain_steps(target, draft, prompt, want, budget):
    """`auto` scripted to decode 15 steps plainly between drafted ones (another drafter
    kind's check): the plain greedy text `want`, no drafter graph over the stretch, and
    the catch-up riding in the propose of the step that drafts again."""
    from dflash_gguf.speculation.auto import PLAIN

    auto = CountingAuto([0] + [PLAIN] * 15 + [0, budget, 0] + [PLAIN] * 30, budget, draft)
    out, _ = tree_generate(target, draft, prompt, len(want), budget=budget, auto=auto)
    assert out == want
    runs = np.diff(auto.graphs)
    assert list(runs[1:16]) == [0] * 15 and runs[16] == 1


SMALL = dict(hidden=64, layers=2, heads=2, kv_heads=1, head_dim=32, ffn=128)


def our_draft_simple(files, drafter, text, n_predict, n_max, p_min, truncates=True, n_ctx=512):
    """llama-speculative-simple's loop with our target and SimpleDraft (truncates False:
    dropping rejected drafts by chain commits, as for a recurrent drafter): its counts."""
    from dflash_gguf.runtime.tokenizer import Tokenizer
    from helpers.speculative_simple import speculative_simple_loop

    tok = Tokenizer(files["target"])
    tokens = tok.encode(text)
    target = Target(files["target"], TargetConfig(n_ctx=n_ctx, n_verify=n_max + 1, n_threads=1))
    small = SimpleDraft(files[drafter], TargetConfig(n_ctx=n_ctx, n_verify=max(n_max, 2), n_threads=1), target)
    assert small.truncates
    small.truncates = truncates
    target.prefill(tokens[:-1], LOGITS_NONE)
    context = list(tokens[:-1])

    def draft_step(last, pending, room):
        context.extend(pending)
        return small.draft(0, context + [last], n_max if room == 0 else min(n_max, room), p_min)[0]

    try:
        return speculative_simple_loop(target, draft_step, tokens, n_predict, n_ctx, tok.eog_ids)
    finally:
        small.close()
        target.close()


# text the demo target goes on repeating: the n-gram kinds find their drafts in it
REPEATS = ("The cat sat on the mat. The dog sat on the log. The cat sat on the mat. "
           "The dog sat on the log. The cat sat on the mat. The dog sat")


def solo_and_batched(engine, texts, n):
    """Each text's n greedy tokens generated alone, then in one batch (a slot each, one
    joining per round): (alone, batched, the batch's sequences)."""
    alone = [engine.generate(t, n, stop_tokens=()).tokens for t in texts]
    batch = engine.batch()
    seqs = [engine.sequence(Request(engine.encode(t), n, stop_tokens=()), slot=i) for i, t in enumerate(texts)]
    outs = [[] for _ in texts]
    rounds = 0
    while rounds == 0 or len(batch):
        if rounds < len(seqs):
            batch.add(seqs[rounds])  # one joins per round
        for seq, new in batch.advance():
            assert seq.error is None, seq.error
            outs[seq.slot] += new
        rounds += 1
    return alone, outs, seqs


def decode_alone(target, draft, kind, prompt, n, sampling=None):
    stats = GenerationStats()
    seq = Sequence(target, None if kind == "plain" else draft, proposer(kind, target, draft, sampling),
                   Request(prompt, n, sampling=sampling), stats)
    return collect(sequence_steps(seq)), stats


def batch_outputs(target, draft, seqs, join_every=0, n_batch=None, on_round=None):
    """Run sequences in one Batch (of n_batch tokens a round), sequence i joining after
    i * join_every rounds; on_round(batch) after each round. Returns each one's tokens."""
    batch = Batch(target, draft, n_batch)
    index = {id(s): i for i, s in enumerate(seqs)}
    outs, pending, rounds = [[] for _ in seqs], list(range(len(seqs))), 0
    while pending or len(batch):
        while pending and rounds >= pending[0] * join_every:
            batch.add(seqs[pending.pop(0)])
        for seq, new in batch.advance():
            assert seq.error is None, seq.error
            outs[index[id(seq)]] += new
        if on_round is not None:
            on_round(batch)
        rounds += 1
        assert rounds < 10_000, "the batch does not finish"
    return outs


def decode_batch(target, draft, requests, join_every=0, n_batch=None, on_round=None):
    """Run requests (kind, prompt, n, sampling) in one Batch, slot i for request i
    (batch_outputs). Returns each one's tokens and stats."""
    seqs = []
    for i, (kind, prompt, n, sampling) in enumerate(requests):
        seqs.append(Sequence(target, None if kind == "plain" else draft, proposer(kind, target, draft, sampling),
                             Request(prompt, n, sampling=sampling), GenerationStats(), Placement(slot=i)))
    outs = batch_outputs(target, draft, seqs, join_every, n_batch, on_round)
    return outs, [s.stats for s in seqs]


class _Cost:
    """A verify cost table: time linear in the rows, a tree's and a chain's lines."""

    def __init__(self, fixed, per_node, chain_fixed=None, chain_per_node=None):
        self.fixed, self.per_node = fixed, per_node
        self.chain_fixed = fixed if chain_fixed is None else chain_fixed
        self.chain_per_node = per_node if chain_per_node is None else chain_per_node

    def __call__(self, n, depth=0):
        return self.fixed + self.per_node * np.asarray(n, dtype=float)

    def chain(self, n, depth=0):
        return self.chain_fixed + self.chain_per_node * np.asarray(n, dtype=float)


class _FlatCost:
    """A verify cost table where rows are nearly free (as on a GPU): `auto` then has trees,
    the chain and plain decoding within reach."""

    def __call__(self, n, depth=0):
        return 1e-3 + 1e-6 * np.asarray(n, dtype=float)

    chain = __call__


class _ScriptedAuto:
    """An AutoBudget that runs a fixed sequence of arms (plain, the chain, tree sizes),
    surveys every third step, and checks what the proposer hands back to learn: every
    decision it made, once (learnt)."""

    def __init__(self, arms, largest):
        from dflash_gguf.speculation.auto import AutoBudget

        self.real = AutoBudget(_Cost(1e-3, 1e-4), largest, BLOCK)
        self.largest, self.script, self.seen, self.n_trees, self.surveys = largest, list(arms), [], 0, []
        self.chosen, self.learnt = [], []

    def choose(self):
        from dflash_gguf.speculation.auto import CHAIN, PLAIN, Decision

        self.real.choose()
        arm = self.script[len(self.seen) % len(self.script)]
        self.seen.append(arm)
        decision = Decision(arm, probe=arm == CHAIN and self.real.current == PLAIN,
                            survey=arm >= 0 and len(self.seen) % 3 == 1)  # its script chooses every step
        self.chosen.append(decision)
        return decision

    def __getattr__(self, name):  # chain_cut, report, finish: the real chooser's
        return getattr(self.real, name)

    def learn(self, decision, n_acc, seconds, accepted=None):
        arm = decision.arm
        assert arm == self.seen[-1] and not decision.unasked
        assert seconds > 0 and n_acc >= 0 and (decision.surveyed is not None) == decision.survey
        if decision.surveyed is not None:
            host, n_nodes = decision.surveyed
            assert host > 0 and n_nodes == self.largest
            self.surveys.append(len(self.seen))
        if arm > 0:
            probs, spine = decision.nodes
            assert 0 < len(probs) == len(spine) == len(accepted) <= arm and spine[0] and all(0 < p <= 1 for p in probs)
            assert n_acc == sum(accepted)
            self.n_trees += 1
        else:
            assert decision.nodes is None and (arm == 0 or n_acc == 0)
        self.learnt.append(decision)
        self.real.learn(decision, n_acc, seconds, accepted)


class CountingAuto(_ScriptedAuto):
    """A scripted chooser that also notes the drafter's graph runs before each step."""

    def __init__(self, arms, largest, draft):
        super().__init__(arms, largest)
        self.draft, self.graphs = draft, []

    def choose(self):
        self.graphs.append(self.draft.info()["n_graphs"])
        return super().choose()


def proposer(kind, target, draft, sampling=None):
    if kind == "plain":
        return PlainProposer()
    if kind.startswith("auto"):
        return tree_proposer(target, draft, 8, None, (PLAIN_FIRST if kind == "auto, plain first" else AUTO).chooser())
    if kind == "chain":
        return chain_proposer(target, draft, None, sampling, p_min=0.3)
    if kind == "reject":
        return chain_proposer(target, draft, None, sampling, chain_rule="reject")
    return tree_proposer(target, draft, 6, None)


AUTO = AutoMemory(_FlatCost(), 8, 8)  # what `auto` sequences start from, as an engine keeps it


PLAIN_FIRST = AutoMemory(_FlatCost(), 8, 8)  # ... and one whose last sequence decoded plainly


class FlatCost:
    """A verify cost table (verify_cost.VerifyCost's interface) whose rows cost `per_row` of
    a one-row step each: 0, free rows, pricing verifies every likely draft; 1, rows as dear
    as a decode step, no unsure draft pays (speculation/pricing.py). Installed in place of the measured
    table by use_cost, so that what a test sees does not depend on this machine's timings."""

    key = "test"

    def __init__(self, per_row: float = 0.0):
        self.per_row = per_row

    def __call__(self, rows, depth=0):
        return 1.0 + self.per_row * (np.asarray(rows, dtype=float) - 1)

    chain = __call__


def use_cost(monkeypatch, per_row: float) -> None:
    """Engines made after this price their weightless drafts by FlatCost(per_row)."""
    import dflash_gguf.speculation.choice as choice_module

    monkeypatch.setattr(choice_module, "VerifyCost", lambda target, n_threads: FlatCost(per_row))

