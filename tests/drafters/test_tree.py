"""DDTree: the best-first tree builder, tree verification of the hybrid target against
plain decoding along each node's path, and lossless tree speculative decoding."""
from __future__ import annotations

import itertools
from dataclasses import replace

import numpy as np
import pytest

from helpers.decoding_checks import BLOCK, HostBlocks, ScriptedDraft, prompts
from helpers.decoding_checks import CountingAuto, _Cost, _ScriptedAuto
from helpers.loops import greedy_generate, speculative_generate, tree_generate
from helpers.parity import Parity
from helpers.tree_paths import root_path

from dflash_gguf.decoding.tree import accept_path, chain_tree
from dflash_gguf.speculation.ddtree import build_tree
from dflash_gguf.runtime.drafter import Draft, DraftConfig, read_draft_metadata
from dflash_gguf.runtime.target import LOGITS_ALL, LOGITS_LAST, Target, TargetConfig


# ---- builder ----------------------------------------------------------------------

def brute_force_best(logprobs, budget):
    """All rank prefixes with their scores, best `budget` of them."""
    depth, k = logprobs.shape
    prefixes = []
    for d in range(1, depth + 1):
        for ranks in itertools.product(range(k), repeat=d):
            prefixes.append((sum(logprobs[i][r] for i, r in enumerate(ranks)), ranks))
    prefixes.sort(key=lambda p: -p[0])
    return prefixes[:budget]


def tree_prefixes(tree, cand):
    """The rank prefix of every non-root node."""
    rank_of = []
    for d in range(len(cand)):
        rank_of.append({int(t): r for r, t in enumerate(cand[d])})
    out = []
    for i in range(1, len(tree)):
        ranks, j = [], i
        while j > 0:
            ranks.append(rank_of[tree.depths[j] - 1][tree.tokens[j]])
            j = tree.parents[j]
        out.append(tuple(reversed(ranks)))
    return out


@pytest.mark.parametrize("seed", range(6))
def test_builder_picks_the_best_prefixes(seed):
    rng = np.random.default_rng(seed)
    depth, k = int(rng.integers(1, 5)), int(rng.integers(1, 4))
    logits = rng.normal(size=(depth, 50))
    lp = logits - np.log(np.exp(logits).sum(1, keepdims=True))
    order = np.argsort(-lp, axis=1, kind="stable")[:, :k]
    cand = np.take_along_axis(np.arange(50)[None].repeat(depth, 0), order, 1)
    cand_lp = np.take_along_axis(lp, order, 1)
    n_all = sum(k ** d for d in range(1, depth + 1))
    for budget in sorted({1, 2, 3, 5, 8, n_all, n_all + 3}):
        tree = build_tree(7, cand, cand_lp, budget)
        expect = brute_force_best(cand_lp, budget)
        got = tree_prefixes(tree, cand)
        assert len(got) == min(budget, n_all)
        # same set of scores (ties may swap equal-score prefixes)
        score = {ranks: sum(cand_lp[i][r] for i, r in enumerate(ranks)) for ranks in got}
        assert sorted(score.values(), reverse=True) == pytest.approx([s for s, _ in expect])
        # structure: root first, parents precede children, nodes ordered by depth
        assert tree.tokens[0] == 7 and tree.parents[0] == -1 and tree.depths[0] == 0
        for i in range(1, len(tree)):
            assert 0 <= tree.parents[i] < i
            assert tree.depths[i] == tree.depths[tree.parents[i]] + 1
            assert tree.depths[i] >= tree.depths[i - 1]


def test_ancestor_mask_and_accept_path():
    tree = build_tree(1, [[10, 11], [20, 21], [30, 31]], [[-0.1, -1.0], [-0.2, -0.3], [-0.5, -3.0]], budget=6)
    mask = tree.ancestor_mask()
    for i in range(len(tree)):
        expect, j = set(), i
        while j >= 0:
            expect.add(j)
            j = tree.parents[j]
        assert set(np.flatnonzero(mask[i])) == expect
    # the target agrees with 10 then 21 then disagrees
    choice = {0: 10}
    kids = tree.children()
    n10 = kids[0][10]
    choice[n10] = 21
    n21 = kids[n10][21]
    choice[n21] = 99
    full = [choice.get(i, -1) for i in range(len(tree))]
    assert accept_path(tree, full) == [0, n10, n21]
    assert chain_tree(5, [6, 7]).parents == [-1, 0, 1]


# ---- tree verification on the hybrid target ---------------------------------------

def test_padded_trees_keep_every_path_and_never_accept_a_dummy():
    rng = np.random.default_rng(3)
    for _ in range(20):
        depth, k = int(rng.integers(1, 5)), int(rng.integers(1, 4))
        lp = np.sort(np.log(rng.dirichlet(np.ones(9), size=depth)), axis=1)[:, ::-1][:, :k]
        cand = rng.integers(0, 50, size=(depth, k))
        tree = build_tree(7, cand, lp, int(rng.integers(1, 12)))
        n = len(tree) + int(rng.integers(0, 6))
        pad = tree.padded_to(n)
        assert len(pad) == n
        assert all(pad.parents[i] < i and pad.depths[i] == pad.depths[pad.parents[i]] + 1 for i in range(1, n))
        assert pad.tokens[:len(tree)] == tree.tokens and pad.parents[:len(tree)] == tree.parents
        assert pad.dummy == [False] * len(tree) + [True] * (n - len(tree))
        # a target that agrees with every dummy's token everywhere still walks real nodes only
        path = accept_path(pad, [7] * n)
        assert not any(pad.dummy[i] for i in path)
        assert path == accept_path(tree, [7] * len(tree))
    with pytest.raises(ValueError, match="cannot pad"):
        tree.padded_to(len(tree) - 1)


def random_tree(rng, n):
    """Parents before children, in no particular depth order."""
    return [-1] + [int(rng.integers(0, i)) for i in range(1, n)]


def test_tree_verify_equals_decoding_each_path(pair):
    rng = np.random.default_rng(0)
    target = Target(pair["target"], TargetConfig(n_ctx=256, n_ubatch=32, n_verify=16, kv_type="f32"))
    plain = Target(pair["target"], TargetConfig(n_ctx=256, n_ubatch=32, n_verify=16, kv_type="f32"))
    prompt = rng.integers(0, 1000, 21).tolist()
    for _ in range(4):
        n = int(rng.integers(2, 17))
        parents = random_tree(rng, n)
        tokens = rng.integers(0, 1000, n).tolist()
        target.reset()
        target.prefill(prompt, LOGITS_LAST)
        target.verify_tree(tokens, parents)
        tree_logits = target.logits(0, n)
        for i in range(n):
            plain.reset()
            plain.prefill(prompt + [tokens[j] for j in root_path(parents, i)], LOGITS_LAST)
            np.testing.assert_allclose(tree_logits[i], plain.logits()[0], rtol=0, atol=1e-5)
        # the state after committing any node's path is that of decoding the path
        leaf = int(rng.integers(0, n))
        path = root_path(parents, leaf)
        target.commit_path(path)
        target.decode([3, 4, 5], LOGITS_ALL)
        plain.reset()
        plain.prefill(prompt + [tokens[j] for j in path], LOGITS_LAST)
        plain.decode([3, 4, 5], LOGITS_ALL)
        np.testing.assert_allclose(target.logits(0, 3), plain.logits(0, 3), rtol=0, atol=1e-5)


def test_a_commit_reruns_only_the_steps_its_graph_needs(pair):
    """The commit reruns the recurrence over the kept path from the committed state, the
    steps after it being identity steps as dear as real ones. A tree's commit reruns no
    more than its longest root path (its spine), whatever its node count, and keeping
    the whole spine still leaves the state of decoding it. A chain's reruns every
    verified row while chain verifies keep one length (the next graph is the last one
    again), and only the kept rows for a while once the length changes (graphs change
    anyway while lengths vary)."""
    target = Target(pair["target"], TargetConfig(n_ctx=256, n_ubatch=32, n_verify=16, kv_type="f32"))
    plain = Target(pair["target"], TargetConfig(n_ctx=256, n_ubatch=32, n_verify=16, kv_type="f32"))
    prompt = list(range(7, 30))
    # a spine 0-1-2-3-4 and eleven leaves hanging off its first three nodes
    parents = [-1, 0, 1, 2, 3] + [i % 3 for i in range(11)]
    tokens = list(range(100, 116))
    target.prefill(prompt, LOGITS_LAST)
    target.verify_tree(tokens, parents)
    target.commit_path([0, 1, 2, 3, 4])
    target.decode([3, 4, 5], LOGITS_ALL)
    assert target.info()["n_last_replay"] == 5
    plain.prefill(prompt + tokens[:5], LOGITS_LAST)
    plain.decode([3, 4, 5], LOGITS_ALL)
    np.testing.assert_allclose(target.logits(0, 3), plain.logits(0, 3), rtol=0, atol=1e-5)
    replays = []
    for n, keep in ((8, 3), (8, 3), (5, 2), (5, 5), (5, 1)):
        target.verify(tokens[:n])
        target.commit(keep)
        target.decode([6], LOGITS_LAST)
        replays.append(target.info()["n_last_replay"])
    assert replays == [8, 8, 2, 5, 1]
    target.decode([7], LOGITS_LAST)
    assert target.info()["n_last_replay"] == 0


def test_consecutive_trees_of_one_size_reuse_the_graph_exactly(pair):
    """Trees of one node count but any shape, order, tokens and accepted path, step
    after step: the graph's recurrence is padded to the largest spine, branch count,
    branch length and last branch start seen for the node count, so once trees of those
    sizes have run (for 6 nodes: the chain, the star, a spine of 4 with a branch of 2
    and a spine of 5 with a leaf on its fourth node), one graph is built and reused (the
    commit rides along as an input), and every node's logits match decoding its text
    from scratch."""
    rng = np.random.default_rng(5)
    target = Target(pair["target"], TargetConfig(n_ctx=256, n_ubatch=32, n_verify=16, kv_type="f32"))
    plain = Target(pair["target"], TargetConfig(n_ctx=256, n_ubatch=32, n_verify=16, kv_type="f32"))
    text = rng.integers(0, 1000, 19).tolist()
    target.prefill(text, LOGITS_LAST)
    shapes = [[-1, 0, 0, 0, 0, 0], [-1, 0, 1, 2, 3, 4], [-1, 0, 0, 1, 2, 3], [-1, 0, 1, 0, 2, 3], [-1, 0, 1, 2, 3, 3]]
    builds = []
    for step in range(9):
        parents = shapes[step] if step < len(shapes) else random_tree(rng, 6)
        tokens = rng.integers(0, 1000, len(parents)).tolist()
        target.verify_tree(tokens, parents)
        builds.append(target.info()["n_graph_builds"])
        got = target.logits(0, len(parents))
        for i in range(len(parents)):
            plain.reset()
            plain.prefill(text + [tokens[j] for j in root_path(parents, i)], LOGITS_LAST)
            np.testing.assert_allclose(got[i], plain.logits()[0], rtol=0, atol=1e-5, err_msg=f"step {step} node {i}")
        path = root_path(parents, int(rng.integers(0, len(parents))))
        target.commit_path(path)
        text += [tokens[j] for j in path]
    # the second step carries the first one's commit, the third grows the branches'
    # length and the fifth the last branch start to the largest 6 nodes allow: new
    # graphs; from then on, one
    assert builds[-1] == builds[4]
    target.verify([1, 2, 3])
    target.commit(2)
    target.decode([4], LOGITS_ALL)
    plain.reset()
    plain.prefill(text + [1, 2, 4], LOGITS_LAST)
    np.testing.assert_allclose(target.logits(0, 1), plain.logits(0, 1), rtol=0, atol=1e-5)


def test_an_odd_tree_pads_later_trees_only_for_a_while(pair):
    """A star of 6 nodes pads the recurrence of the chain-shaped trees of 6 after it
    (four branches); after 64 trees of that size the padding restarts from the tree at
    hand: one more graph, then the chains reuse it, and their logits stay exact."""
    rng = np.random.default_rng(9)
    target = Target(pair["target"], TargetConfig(n_ctx=256, n_ubatch=32, n_verify=16, kv_type="f32"))
    text = rng.integers(0, 1000, 9).tolist()
    target.prefill(text, LOGITS_LAST)
    builds = []
    for step in range(80):
        parents = [-1, 0, 0, 0, 0, 0] if step == 0 else [-1, 0, 1, 2, 3, 4]
        tokens = rng.integers(0, 1000, 6).tolist()
        target.verify_tree(tokens, parents)
        builds.append(target.info()["n_graph_builds"])
        got, context = target.logits(0, 6), list(text)
        target.commit_path([0])
        text.append(tokens[0])
    assert builds[-1] - builds[2] == 1 and builds[70] == builds[-1]
    plain = Target(pair["target"], TargetConfig(n_ctx=256, n_ubatch=32, n_verify=16, kv_type="f32"))
    plain.prefill(context, LOGITS_LAST)
    plain.decode(tokens, LOGITS_ALL)
    np.testing.assert_allclose(got, plain.logits(0, 6), rtol=0, atol=1e-5)


def test_alternating_chain_and_tree_verifies_keep_their_graphs(pair):
    """`auto` goes back and forth between the chain and a few tree sizes: the target
    keeps several graphs, so after one round every kind of step finds its own; the
    results stay those of decoding the committed text from scratch."""
    rng = np.random.default_rng(9)
    target = Target(pair["target"], TargetConfig(n_ctx=256, n_ubatch=32, n_verify=16, kv_type="f32"))
    plain = Target(pair["target"], TargetConfig(n_ctx=256, n_ubatch=32, n_verify=16, kv_type="f32"))
    text = rng.integers(0, 1000, 17).tolist()
    target.prefill(text, LOGITS_LAST)
    builds = []
    for step in range(9):
        tokens = rng.integers(0, 1000, 6).tolist()
        if step % 3 == 2:
            target.verify(tokens)
            keep = int(rng.integers(1, 7))
            target.commit(keep)
            text += tokens[:keep]
        else:
            parents = random_tree(rng, 6 if step % 3 == 0 else 4)
            target.verify_tree(tokens[:len(parents)], parents)
            path = root_path(parents, int(rng.integers(0, len(parents))))
            target.commit_path(path)
            text += [tokens[j] for j in path]
        builds.append(target.info()["n_graph_builds"])
    assert builds[-1] == builds[5], builds
    target.decode([5], LOGITS_ALL)
    plain.prefill(text + [5], LOGITS_LAST)
    np.testing.assert_allclose(target.logits(0, 1), plain.logits(0, 1), rtol=0, atol=1e-5)


def two_length_tree(n):
    """A spine of n/2 nodes, a branch of n/4 off the root and n/4 leaves on the root: from
    12 nodes on, the recurrence runs the leaves and the long branch in a group each (a
    single group would pad every leaf to the long branch)."""
    spine, long = n // 2, n // 4
    parents = [-1] + list(range(spine - 1))
    parents += [0] + list(range(spine, spine + long - 1))
    return parents + [0] * (n - len(parents))


def test_tree_verify_graph_does_not_grow_with_the_tree(pair):
    """A tree's recurrence runs in a few delta-rule ops per layer (its spine, then the
    branches off it in at most two groups by length), whatever its node count: the
    verify graph of 4 to 16 nodes has as many nodes as any other of its number of
    groups (and conv form), a fixed few dozen per layer more than the chain's, and a
    second group adds a handful per layer."""
    target = Target(pair["target"], TargetConfig(n_ctx=256, n_ubatch=32, n_verify=16, kv_type="f32"))
    target.prefill(list(range(40, 60)), LOGITS_LAST)
    layers = target.info()["n_layer"]

    def nodes(n, parents):
        # the second verify of a size: it carries the previous one's commit, as in decoding
        for _ in range(2):
            if parents is None:
                target.verify(list(range(300, 300 + n)))
                target.commit(1)
            else:
                target.verify_tree(list(range(300, 300 + n)), parents)
                target.commit_path([0])
        return target.info()["n_last_nodes"]

    sizes = (4, 8, 16)
    chain = {n: nodes(n, None) for n in sizes}
    comb = {n: nodes(n, [-1] + [2 * ((i - 1) // 2) for i in range(1, n)]) for n in sizes}  # a spine, a leaf on each
    two = {n: nodes(n, two_length_tree(n)) for n in (12, 16)}
    bushy = {n: nodes(n, [-1] + [(i - 1) // 3 for i in range(1, n)]) for n in sizes}
    assert len(set(chain.values())) == 1 and len(set(comb.values())) == 1 and len(set(two.values())) == 1, (
        chain, comb, two)
    one_group, two_groups = comb[4], two[12]
    # give or take the conv's form (a padded shape may run it on windows alone: a dozen
    # nodes fewer per layer)
    assert all(min(abs(v - one_group), abs(v - two_groups)) <= 12 * layers for v in bushy.values()), (
        bushy, one_group, two_groups)
    assert 0 < one_group - chain[4] <= 50 * layers, (chain, comb, layers)
    assert 0 < two_groups - one_group <= 12 * layers, (comb, two, layers)


def test_a_tree_in_two_groups_equals_its_paths_verified_as_chains(pair):
    """Leaves and a long branch run in two delta-rule ops of their own lengths; the next
    tree (a longer spine, three leaves and a shorter branch) pads both groups: a padding
    branch among the leaves, padding steps on the branch. Every node's logits are those
    of verifying its root path as a chain."""
    rng = np.random.default_rng(13)
    config = TargetConfig(n_ctx=256, n_ubatch=32, n_verify=16, kv_type="f32")
    target, plain, single = Target(pair["target"], config), Target(pair["target"], config), Target(pair["target"], config)
    prompt = rng.integers(0, 1000, 15).tolist()
    single.prefill(prompt, LOGITS_LAST)
    single.verify_tree(list(range(16)), [-1] + [2 * ((i - 1) // 2) for i in range(1, 16)])
    target.prefill(prompt, LOGITS_LAST)
    for step, parents in enumerate([two_length_tree(16), [-1, 0, 1, 2, 3, 4, 5, 6, 7, 8, 0, 10, 11, 1, 2, 0]]):
        tokens = rng.integers(0, 1000, 16).tolist()
        target.verify_tree(tokens, parents)
        if step == 0:
            assert target.info()["n_last_nodes"] > single.info()["n_last_nodes"]
        got = target.logits(0, 16)
        for i in range(16):
            path = root_path(parents, i)
            plain.reset()
            plain.prefill(prompt, LOGITS_LAST)
            plain.verify([tokens[j] for j in path])
            np.testing.assert_allclose(got[i], plain.logits(len(path) - 1, 1)[0], rtol=0, atol=1e-5,
                                       err_msg=f"step {step} node {i}")
        path = root_path(parents, 15)
        target.commit_path(path)
        prompt += [tokens[j] for j in path]


def test_chain_shaped_tree_is_the_chain_path(pair):
    target = Target(pair["target"], TargetConfig(n_ctx=256, n_ubatch=32, n_verify=8))
    prompt, tokens = list(range(50, 70)), list(range(300, 308))
    target.prefill(prompt, LOGITS_LAST)
    target.verify(tokens)
    chain = target.logits(0, 8)
    target.commit(0)
    target.verify_tree(tokens, list(range(-1, 7)))
    assert np.array_equal(target.logits(0, 8), chain)


def test_both_conv_forms_verify_each_path_as_the_chain(pair):
    """A tree's short convolution runs its spine as one sequence and each node off it on
    its own window (a fresh tree of a spine of 5 and 3 nodes off it), or every node on
    its own window when the padded shape makes that cheaper (after a star and a chain of
    8 nodes pad the spine to 8 and the nodes off it to 6): either way each node's logits
    are those of verifying its root path as a chain, and the chain-shaped tree's are the
    chain's, bit for bit."""
    rng = np.random.default_rng(21)
    config = TargetConfig(n_ctx=256, n_ubatch=32, n_verify=8, kv_type="f32")
    fresh, padded, plain = Target(pair["target"], config), Target(pair["target"], config), Target(pair["target"], config)
    prompt = rng.integers(0, 1000, 17).tolist()
    tree, tokens = [-1, 0, 1, 2, 3, 1, 5, 2], rng.integers(0, 1000, 8).tolist()

    def paths_as_chains(got):
        for i in range(8):
            path = root_path(tree, i)
            plain.reset()
            plain.prefill(prompt, LOGITS_LAST)
            plain.verify([tokens[j] for j in path])
            np.testing.assert_allclose(got[i], plain.logits(len(path) - 1, 1)[0], rtol=0, atol=1e-5, err_msg=f"node {i}")

    fresh.prefill(prompt, LOGITS_LAST)
    fresh.verify_tree(tokens, tree)
    paths_as_chains(fresh.logits(0, 8))

    padded.prefill(prompt, LOGITS_LAST)
    padded.verify_tree(tokens, [-1] + [0] * 7)
    padded.commit_path([])
    padded.verify(tokens)
    chain = padded.logits(0, 8)
    padded.commit(0)
    padded.verify_tree(tokens, list(range(-1, 7)))
    assert np.array_equal(padded.logits(0, 8), chain)
    padded.commit_path([])
    padded.verify_tree(tokens, tree)
    paths_as_chains(padded.logits(0, 8))


def test_tree_input_errors(pair):
    target = Target(pair["target"], TargetConfig(n_ctx=64, n_verify=8))
    target.prefill([1, 2, 3], LOGITS_LAST)
    with pytest.raises(Exception, match="parent"):
        target.verify_tree([1, 2, 3], [-1, 2, 0])
    with pytest.raises(Exception, match="n_verify"):
        target.verify_tree(list(range(9)), list(range(-1, 8)))
    target.verify_tree([1, 2, 3], [-1, 0, 0])
    with pytest.raises(Exception, match="path"):
        target.commit_path([0, 2, 1])
    with pytest.raises(Exception, match="commit_path"):
        target.commit(1)


# ---- lossless tree decoding -----------------------------------------------------------

def load_tree(pair, target_gguf=None, kv="f32", budget=32, repack=True, top_k=4):
    meta = read_draft_metadata(pair["draft"])
    target = Target(target_gguf or pair["target"], TargetConfig(
        n_ctx=512, n_ubatch=16, n_verify=budget + 1, kv_type=kv, feature_layers=meta["target_layers"],
        repack=repack))
    return target, Draft(pair["draft"], target, DraftConfig(kv_type="f32", top_k=top_k))


def test_lossless_tree_f32(pair):
    target, draft = load_tree(pair)
    with Parity(target) as parity:
        for prompt in prompts(10, seed=21):
            ar, _ = greedy_generate(target, prompt, 128)
            for budget in (4, 8, 16, 32):
                out, stats = tree_generate(target, draft, prompt, 128, budget)
                parity.check(prompt, ar, out)
                assert sum(stats.accepted_lengths) == len(out) - 1


def test_lossless_tree_q8_0(pair, convert_model):
    target, draft = load_tree(pair, convert_model(pair["target_dir"], "q8_0"), kv="f16", repack=False)
    with Parity(target) as parity:
        for prompt in prompts(3, seed=22):
            ar, _ = greedy_generate(target, prompt, 128)
            for budget in (4, 8, 16, 32):
                out, _ = tree_generate(target, draft, prompt, 128, budget)
                parity.check(prompt, ar, out)


@pytest.mark.parametrize("kv", ["q8_0", "q4_0"])
def test_lossless_with_quantized_kv_cache(pair, kv):
    """Quantized attention caches through tree verifies and path commits (rows move in
    quantized form) and chain commits: the same tokens as plain decoding with that cache."""
    target, draft = load_tree(pair, kv=kv)
    with Parity(target) as parity:
        for prompt in prompts(3, seed=23):
            ar, _ = greedy_generate(target, prompt, 96)
            chain, _ = speculative_generate(target, draft, prompt, 96)
            parity.check(prompt, ar, chain)
            for budget in (8, 32):
                out, _ = tree_generate(target, draft, prompt, 96, budget)
                parity.check(prompt, ar, out)


class ScriptedTreeDraft(ScriptedDraft):
    """Candidates per depth: the true continuation token at a seeded rank among
    distractors, so accepted paths leave through non-first children."""

    top_k = 3

    def propose(self, bonus, n_block=None, read=True, seq=0):
        self._b = self.block_size if n_block is None else n_block
        self._i = self.ctx - self.prompt_len
        assert self.truth[self._i] == bonus
        return []

    def topk(self, n_rows, seq=0):
        rng = np.random.default_rng(self._i)
        toks = np.zeros((n_rows, 3), dtype=np.int32)
        lps = np.tile(np.array([-0.1, -1.0, -2.0], dtype=np.float32), (n_rows, 1))
        for d in range(n_rows):
            k = self._i + 1 + d
            true = self.truth[k] if k < len(self.truth) else 0
            distract = [(true + 1 + j) % 1000 for j in range(3)]
            rank = int(rng.integers(0, 4))  # 3: missing
            row = distract[:]
            if rank < 3:
                row[rank] = true
            toks[d] = row
        return toks, lps


def test_tree_steps_reuse_one_target_graph(pair):
    """Every tree is padded to its budget and the verify graph depends only on the node
    count and its recurrence's padded shape, which only grows (to the largest spine,
    branch count and branch length seen), so trees of any shape share it: only the
    prefill, the first two verifies (without and with a commit to carry), a crossing of
    the attention window's 256-token step and a few early growths build a graph."""
    target, draft = load_tree(pair, budget=8)
    prompt = prompts(1, seed=71)[0]
    shapes = set()
    original = target.step

    def step(rows, source=None):
        shapes.update(tuple(r.parents) for r in rows if r.parents is not None)
        return original(rows, source)

    target.step = step
    before = target.info()
    out, stats = tree_generate(target, draft, prompt, 96, budget=8)
    after = target.info()
    graphs = after["n_graphs"] - before["n_graphs"]
    builds = after["n_graph_builds"] - before["n_graph_builds"]
    assert len(stats.accepted_lengths) >= 20 and len(shapes) >= 5
    assert builds <= 2 + 2 + 1 + 3, f"{builds} of {graphs} target graphs were built for {len(shapes)} tree shapes"


@pytest.mark.parametrize("top_k", [4, 1])
def test_drafter_ranks_candidates_once_per_propose_and_only_when_read(pair, top_k):
    """Every propose computes its top choices' log-probabilities; with top_k > 1 the
    drafter's top-K runs in a graph of its own over the propose's logits and softmax,
    the first time they are read: a chain step's propose (reading the top choices or
    nothing) is one graph, a tree step's two; with top_k 1 one graph either way. The
    candidates are the log-softmax top-K of the logits of the propose just made, also
    after the propose graph is rebuilt (its context crossed a padding step, or an
    append ran between)."""
    target, draft = load_tree(pair, budget=8, top_k=top_k)
    rank_graphs = 1 if top_k > 1 else 0

    def log_softmax():
        logits = draft.logits(0, BLOCK - 1).astype(np.float64)
        logp = logits - logits.max(1, keepdims=True)
        return logp - np.log(np.exp(logp).sum(1, keepdims=True))

    prompt = prompts(1, seed=5)[0]
    target.prefill(prompt, LOGITS_LAST, on_chunk=lambda s, n: draft.append())
    bonus = int(target.choices()[0])
    for step in range(24):
        before = draft.info()
        block = [bonus] + draft.propose(bonus)
        assert draft.info()["n_graphs"] - before["n_graphs"] == 1
        if step % 3 == 1:  # a chain step: at most the top choices are read
            if step % 2:
                top1 = draft.top1_logprobs(BLOCK - 1)
                assert np.allclose(top1, log_softmax()[np.arange(BLOCK - 1), block[1:]], atol=1e-4)
            assert draft.info()["n_graphs"] - before["n_graphs"] == 1
            keep = 1 + step % 5
        else:
            toks, lps = draft.topk(BLOCK - 1)
            assert toks.shape == lps.shape == (BLOCK - 1, top_k)
            assert draft.info()["n_graphs"] - before["n_graphs"] == 1 + rank_graphs
            again = draft.topk(BLOCK - 1)
            assert draft.info()["n_graphs"] - before["n_graphs"] == 1 + rank_graphs  # ranked once
            assert np.array_equal(again[0], toks) and np.array_equal(again[1], lps)
            assert np.array_equal(draft.top1_logprobs(BLOCK - 1), lps[:, 0])
            logp = log_softmax()
            for r in range(BLOCK - 1):
                assert toks[r, 0] == block[1 + r]
                assert np.allclose(lps[r], logp[r, toks[r]], atol=1e-4)
                assert np.allclose(lps[r], np.sort(logp[r])[::-1][:draft.top_k], atol=1e-4)
            keep = 1 + step % 4
        target.verify(block)
        bonus = int(target.choices(0, BLOCK)[keep - 1])
        target.commit(keep)
        if step % 4 == 0:
            draft.append()  # an append of its own rebuilds the propose graph


def test_lossless_tree_with_scripted_candidates(pair):
    target, _ = load_tree(pair, budget=16)
    for prompt in prompts(3, seed=23):
        ar, _ = greedy_generate(target, prompt, 96)
        fake = ScriptedTreeDraft(len(prompt), ar, BLOCK, 10**6)
        out, stats = tree_generate(HostBlocks(target), fake, prompt, 96, budget=16)
        assert out == ar
        assert max(stats.accepted_lengths) >= 3, stats.accepted_lengths


# ---- budget choice ----------------------------------------------------------------------


class SimPair:
    """A simulated pair on a simulated device. Every step the drafter gives its top-4
    candidates per depth at the probabilities `draft` (the same at every depth); the
    target's token at each depth is the drafter's rank r with probability take[r] (the
    fifth: none of the four). A step truly takes the verify table's time at its rows
    (cost) plus the rest of its work: `drafted` (a drafted step's), `plain` (a plain
    step's), `node` (a tree's, per node) and `survey` (a survey's, per node built)."""

    def __init__(self, cost, drafted, plain, node, survey, take, draft=(0.6, 0.2, 0.12, 0.08), depth=7):
        self.cost, self.drafted, self.plain, self.node, self.survey = cost, drafted, plain, node, survey
        self.take, self.depth = np.asarray(take) / np.sum(take), depth
        self.cand = np.arange(depth * 4).reshape(depth, 4)
        self.logp = np.log(np.tile(draft, (depth, 1)))

    def tree(self, size):
        return build_tree(0, self.cand, self.logp, size)

    def walk(self, tree, rng) -> set:
        """The accepted path's nodes below the root, for one draw of the target's tokens."""
        right = rng.choice(5, size=self.depth, p=self.take)
        path, node, kids = set(), 0, tree.children()
        for d in range(self.depth):
            nxt = kids[node].get(int(self.cand[d][right[d]])) if right[d] < 4 else None
            if nxt is None:
                break
            path.add(nxt)
            node = nxt
        return path

    def expected_accepted(self, tree) -> float:
        """The mean number of the tree's nodes a step accepts: a node (its token the
        drafter's rank t % 4 at depth t // 4) is on the accepted path with the product of
        take over its path."""
        return float(sum(np.prod(self.take[np.asarray(path) % 4]) for path in tree.paths()[1:]))

    def chain_accepted(self, n: int) -> float:
        """The mean number of n chained drafts a step accepts (the drafter's top choices)."""
        return float(sum(self.take[0] ** d for d in range(1, n + 1)))

    def true_rates(self, sizes) -> dict:
        """Tokens per second of each fixed arm: plain, the chain at its best fixed length,
        each tree size (exact expectations)."""
        from dflash_gguf.speculation.auto import CHAIN, PLAIN

        rates = {PLAIN: 1.0 / (self.plain + float(self.cost.chain(1))),
                 CHAIN: max((1 + self.chain_accepted(n)) / (self.drafted + float(self.cost.chain(1 + n)))
                            for n in range(1, self.depth + 1))}
        for b in sizes:
            rates[b] = (1 + self.expected_accepted(self.tree(b))) / (self.drafted + self.node * b + float(self.cost(b + 1)))
        return rates


def simulate_auto(sim, steps=400, seed=0, auto=None, largest=32, survey_steps=None, expected=None):
    """An AutoBudget (a fresh one unless given) driven for `steps` steps by the simulated
    pair, as proposers.AutoProposer drives it (choose's Decision, what the step drafted
    added to it, handed back with the outcome to learn). Returns (arm, tokens, seconds)
    per step (and appends the index of every survey step to survey_steps, and each step's
    expected tokens, the arm and cut it ran, to expected)."""
    from dataclasses import replace

    from dflash_gguf.speculation.auto import CHAIN, PLAIN, AutoBudget, tree_nodes

    rng = np.random.default_rng(seed)
    auto = auto or AutoBudget(sim.cost, largest, sim.depth + 1)
    top1 = sim.logp[:, 0]
    full = sim.tree(auto.largest)
    full_nodes = tree_nodes(full, top1)
    out = []
    for _ in range(steps):
        decision = auto.choose()
        arm, survey = decision.arm, decision.survey
        if survey and survey_steps is not None:
            survey_steps.append(len(out))
        if arm == PLAIN:
            seconds = sim.plain + float(sim.cost.chain(1))
            auto.learn(decision, 0, seconds)
            out.append((arm, 1, seconds))
            if expected is not None:
                expected.append(1.0)
            continue
        cut = auto.chain_cut(top1)
        n = cut.n
        host = sim.survey * auto.largest if survey else 0.0
        surveyed = (host, auto.largest) if survey else None
        if arm == CHAIN:
            right = rng.choice(5, size=n, p=sim.take)
            n_acc = int(np.argmax(right != 0)) if (right != 0).any() else n
            seconds = sim.drafted + float(sim.cost.chain(1 + n)) + host
            seen = full_nodes if survey else None
            auto.learn(replace(decision, cut=cut, seen=seen, surveyed=surveyed), n_acc, seconds)
        else:
            tree = full.best(arm)
            nodes = full_nodes[0][:arm], full_nodes[1][:arm]
            path = sim.walk(tree, rng)
            n_acc = len(path)
            seconds = sim.drafted + sim.node * arm + float(sim.cost(arm + 1)) + host
            decision = replace(decision, cut=cut, seen=full_nodes if survey else nodes, surveyed=surveyed, nodes=nodes)
            auto.learn(decision, n_acc, seconds, [i in path for i in tree.pick_order])
        out.append((arm, n_acc + 1, seconds))
        if expected is not None:
            expected.append(1 + (sim.chain_accepted(n) if arm == CHAIN else sim.expected_accepted(tree)))
    return out


def late_rate(steps, start=200):
    """Tokens per second over the steps from `start` on."""
    return sum(t for _, t, _ in steps[start:]) / sum(s for _, _, s in steps[start:])


def arm_share(steps, arm, start=200):
    late = [a for a, _, _ in steps[start:]]
    return late.count(arm) / len(late)


# a CPU: a verify costs about its rows (a tree's dearer than a chain's), drafting about a row
CPU = dict(cost=_Cost(0.3e-3, 0.4e-3, 0.3e-3, 0.25e-3), drafted=0.25e-3, plain=0.1e-3, node=0.02e-3, survey=0.005e-3)
# a GPU: a verify of 33 rows costs about one row's, drafting a tenth of a verify
GPU = dict(cost=_Cost(10e-3, 0.03e-3, 10e-3, 0.02e-3), drafted=1e-3, plain=0.2e-3, node=0.005e-3, survey=0.002e-3)
GOOD = dict(take=(0.8, 0.08, 0.04, 0.03, 0.05), draft=(0.8, 0.1, 0.06, 0.04))  # a drafter about as right as it says
SPREAD = dict(take=(0.55, 0.2, 0.1, 0.05, 0.1))  # its second and third choices are often the target's


def expected_late_rate(sim, seed, steps=1000, start=200):
    """auto's tokens per second over the late steps, each step's tokens its arm's and
    cut's expectation: the luck of the acceptance draws (about 1.2% over 800 steps)
    is out of it, and what is left is auto's choices."""
    expected = []
    out = simulate_auto(sim, steps=steps, seed=seed, expected=expected)
    return out, sum(expected[start:]) / sum(s for _, _, s in out[start:])


def test_auto_prices_its_arms_at_the_sequences_depth():
    """auto prices a step where the sequence is: the verify table at the depth the step
    runs at (CostTable's per-cell seconds), and plain decoding's measured step kept as at
    no depth (what the table says the depth added taken off), so that a plain step timed
    deep and one timed shallow price alike, and both arms grow dearer together."""
    from dflash_gguf.speculation.auto import CHAIN, PLAIN, AutoBudget
    from dflash_gguf.speculation.verify_cost import CostTable

    sizes = [1, 2, 4, 8, 16]
    base = [0.010, 0.012, 0.016, 0.024, 0.040]
    cost = CostTable("test", sizes, base, base, depth_rows=[1, 16], per_cell=[1e-6, 16e-6])
    auto = AutoBudget(cost, 8, 8)
    auto.at_depth(4096)
    deep = auto.costs.depth
    assert deep == 4096
    assert auto.costs.verify_chain[5] == pytest.approx(float(cost.chain(5, deep)))
    assert auto.costs.verify_tree[8] == pytest.approx(float(cost(9, deep)))
    assert auto.seconds(PLAIN) == pytest.approx(float(cost.chain(1, deep)))  # unmeasured: a one-row verify
    auto.costs.timed(PLAIN, 0.011 + float(cost.extra(1, deep)), 0.0, 0)  # a plain step at depth 4096
    assert auto.costs.part["plain"] == pytest.approx(0.011)
    auto.at_depth(100)
    assert auto.seconds(PLAIN) == pytest.approx(0.011 + float(cost.extra(1, 64)))
    auto.costs.timed(CHAIN, 0.030, 0.0, 3)  # a chain step of 4 rows at depth 64
    assert auto.costs.part["drafted"] == pytest.approx(0.030 - float(cost.chain(4, 64)))
    auto.at_depth(16384)
    assert auto.seconds(CHAIN) - auto.seconds(PLAIN) > 0.030 - 0.011  # the chain's rows grew dearer than plain's one


@pytest.mark.parametrize("seed", range(3))
def test_auto_ends_on_the_chain_where_a_verify_costs_its_rows(seed):
    """On a CPU-like device the chain beats plain decoding (drafting pays) and every
    tree (whose verify costs more than what it accepts more): auto runs it on >= 95%
    of the late steps and makes the best fixed arm's tokens per second, at least 0.98 of
    it (design's bar), its steps counted at their expected tokens. Measured: 0.994-0.995
    on seeds 0-2, 0.985-0.996 on seeds 3-14 but seed 13, where auto decoded plainly on
    295 of the 800 late steps and made 0.958 (the realized rates, draw luck in them:
    0.98-1.02)."""
    from dflash_gguf.speculation.auto import CHAIN

    sim = SimPair(**CPU, **GOOD)
    best = max(sim.true_rates((4, 8, 16, 32)).items(), key=lambda kv: kv[1])
    assert best[0] == CHAIN
    steps, rate = expected_late_rate(sim, seed)
    assert arm_share(steps, CHAIN) >= 0.95, [a for a, _, _ in steps]
    assert rate >= 0.98 * best[1], rate / best[1]


@pytest.mark.parametrize("seed", range(3))
def test_auto_ends_on_the_best_tree_where_a_verify_costs_about_one_row(seed):
    """On a GPU-like device a tree's extra nodes cost next to nothing and trees accept
    more than the chain: auto ends on the tree size that gives the most tokens per
    second (>= 90% of the late steps), at least 0.98 of that fixed arm's speed (its
    steps at their expected tokens: measured 0.999 on seeds 0-14), though no tree runs
    before the model says it wins."""
    sim = SimPair(**GPU, **SPREAD)
    rates = sim.true_rates((4, 8, 16, 32))
    best = max(rates, key=rates.get)
    assert best in (16, 32), rates
    steps, rate = expected_late_rate(sim, seed)
    assert arm_share(steps, best) >= 0.9, [a for a, _, _ in steps]
    assert rate >= 0.98 * rates[best], rate / rates[best]


def test_auto_decodes_plainly_when_drafts_fail():
    """A target that never takes the drafts: drafting only costs, and auto decodes
    plainly on >= 95% of the late steps (the rest: probes, few enough to keep what they
    lose within about EXPLORE_SHARE of the time)."""
    from dflash_gguf.speculation.auto import PLAIN, AutoBudget

    sim = SimPair(**CPU, take=(0.0, 0.0, 0.0, 0.0, 1.0))
    steps = simulate_auto(sim, steps=600)
    assert arm_share(steps, PLAIN) >= 0.95, [a for a, _, _ in steps]
    assert late_rate(steps) >= (1 - 3 * AutoBudget.EXPLORE_SHARE) * sim.true_rates(())[PLAIN]


def test_auto_decodes_plainly_where_rows_cost_more_than_their_acceptance():
    """Drafts the target mostly takes (GOOD), on a device where each verify row costs
    as much as a whole decode and drafting as much again: every chain and tree makes
    more tokens a step than plain decoding and fewer a second. The cost model, from the
    verify table and what it measures, decodes plainly on >= 90% of the late steps."""
    from dflash_gguf.speculation.auto import PLAIN

    sim = SimPair(cost=_Cost(0.1e-3, 1e-3), drafted=1e-3, plain=0.1e-3, node=0.02e-3, survey=0.005e-3, **GOOD)
    rates = sim.true_rates((4, 8, 16, 32))
    assert max(rates, key=rates.get) == PLAIN, rates
    steps = simulate_auto(sim, steps=600)
    assert arm_share(steps, PLAIN) >= 0.9, [a for a, _, _ in steps]
    assert late_rate(steps) >= 0.96 * rates[PLAIN]


def test_auto_probes_less_the_further_drafting_is_behind():
    """On plain decoding, what probes lose against plain is kept within EXPLORE_SHARE
    of the time times the square of how close drafting comes to plain (a chain far
    behind needs a large change in the text to win): drafts the target never takes, on
    a device where the chain makes about 0.6 of plain's tokens a second, lose about
    0.4 of the share, not all of it."""
    from dflash_gguf.speculation.auto import CHAIN, PLAIN, AutoBudget

    sim = SimPair(**CPU, take=(0.0, 0.0, 0.0, 0.0, 1.0))
    rates = sim.true_rates(())
    close = rates[CHAIN] / rates[PLAIN]
    assert 0.5 < close < 0.7, rates
    late = simulate_auto(sim, steps=20000)[2000:]
    plain = 1.0 / rates[PLAIN]
    lost = sum(seconds - tokens * plain for arm, tokens, seconds in late if arm != PLAIN)
    share = lost / sum(seconds for _, _, seconds in late)
    assert 0.5 * close ** 2 * AutoBudget.EXPLORE_SHARE < share < 1.3 * close ** 2 * AutoBudget.EXPLORE_SHARE, share


def test_auto_drafts_again_when_drafts_come_back():
    """After a spell of failing drafts a sequence decodes plainly; when the drafter is
    right again, a probe finds it and auto goes back to the chain."""
    from dflash_gguf.speculation.auto import CHAIN, PLAIN, AutoBudget

    bad, good = SimPair(**CPU, take=(0.0, 0.0, 0.0, 0.0, 1.0)), SimPair(**CPU, **GOOD)
    auto = AutoBudget(bad.cost, 32, 8)
    assert arm_share(simulate_auto(bad, steps=300, auto=auto), PLAIN) >= 0.95
    steps = simulate_auto(good, steps=400, auto=auto)
    assert arm_share(steps, CHAIN) >= 0.9


def test_auto_decides_after_its_first_timed_chain_step():
    """A fresh chooser does not spend DECIDE_EVERY steps on an arm that may not pay:
    drafts the target never takes, and it decodes plainly from the step after the first
    timed chain step (the steps before that build graphs) on."""
    from dflash_gguf.speculation.auto import CHAIN, PLAIN, AutoBudget

    sim = SimPair(**CPU, take=(0.0, 0.0, 0.0, 0.0, 1.0))
    arms = [a for a, _, _ in simulate_auto(sim, steps=AutoBudget.DECIDE_EVERY)]
    first = AutoBudget.SETTLE + 1
    assert arms[:first] == [CHAIN] * first and set(arms[first:]) == {PLAIN}, arms


def test_a_cold_chooser_priced_at_load_decides_after_its_probe():
    """Where the drafter's work a step was priced at load (the `drafter` part), a cold
    chooser prices the chain before one is timed, at the least it can cost: drafts the
    target never takes, and it decodes plainly from the step after its probe. A chain
    that pays at that price is kept until a step of it is timed, as before, and left
    when the timed step costs more than it pays."""
    from dflash_gguf.speculation.auto import CHAIN, PLAIN, AutoBudget

    failing = SimPair(**CPU, take=(0.0, 0.0, 0.0, 0.0, 1.0))
    auto = AutoBudget(failing.cost, 0, failing.depth + 1, prices={"drafter": failing.drafted})
    arms = [a for a, _, _ in simulate_auto(failing, steps=AutoBudget.DECIDE_EVERY, auto=auto)]
    assert arms == [CHAIN] + [PLAIN] * (AutoBudget.DECIDE_EVERY - 1), arms
    # good drafts priced cheap at load, a drafted step dear when timed (a drafter slower in
    # use than at load): the chain until its first timed step, then plain decoding
    dear = SimPair(**{**CPU, "drafted": 5e-3}, **GOOD)
    assert max(dear.true_rates(()).items(), key=lambda kv: kv[1])[0] == PLAIN
    auto = AutoBudget(dear.cost, 0, dear.depth + 1, prices={"drafter": CPU["drafted"]})
    arms = [a for a, _, _ in simulate_auto(dear, steps=AutoBudget.DECIDE_EVERY, auto=auto)]
    first = AutoBudget.SETTLE + 1
    assert arms[:first] == [CHAIN] * first and set(arms[first:]) == {PLAIN}, arms


def test_a_cold_chooser_after_a_timed_chain_decides_after_its_probe():
    """A cold chooser whose prior timed a drafted step (a short request that ended before
    its first decision) has the chain's price already: it decides right after its probe,
    as one priced at load does, instead of timing another chain step first."""
    from dflash_gguf.speculation.auto import CHAIN, PLAIN, AutoBudget

    failing = SimPair(**CPU, take=(0.0, 0.0, 0.0, 0.0, 1.0))
    short = AutoBudget(failing.cost, 0, failing.depth + 1)
    simulate_auto(failing, steps=AutoBudget.SETTLE + 1, auto=short)  # ended before its decision
    assert not short.decided and short.costs.part["drafted"] is not None
    auto = AutoBudget(failing.cost, 0, failing.depth + 1, prior=short)
    arms = [a for a, _, _ in simulate_auto(failing, steps=AutoBudget.DECIDE_EVERY, auto=auto)]
    assert arms == [CHAIN] + [PLAIN] * (AutoBudget.DECIDE_EVERY - 1), arms


def test_a_cold_choosers_first_step_is_a_probe_and_a_warm_ones_is_not():
    """A cold chooser (none before it, or only ones whose sequences ended before their
    first decision: a short warm-up request hands on the chain it started on, not a
    choice) drafts its first step as a probe (the drafter caught up on cold_window(): COLD_LAG
    tokens, not on the whole prompt), stays on the chain and decides after its first
    timed step; one that starts from a chooser that decided drafts its first step on
    the arm it was left on, catching up as that arm does."""
    from dflash_gguf.speculation.auto import CHAIN, AutoBudget

    cost = _Cost(1e-3, 1e-4)
    cold = AutoBudget(cost, 0, BLOCK)
    first = cold.choose()
    assert (first.arm, first.probe, first.window) == (CHAIN, True, AutoBudget.COLD_LAG)
    assert [cold.choose().probe for _ in range(AutoBudget.SETTLE)] == [False] * AutoBudget.SETTLE
    after_a_short_one = AutoBudget(cost, 0, BLOCK, prior=cold)  # it ended before deciding
    assert after_a_short_one.choose().probe and after_a_short_one.next_decision == AutoBudget.SETTLE + 2
    for _ in range(AutoBudget.SETTLE):
        cold.choose()
    assert cold.decided
    warm = AutoBudget(cost, 0, BLOCK, prior=cold)
    step = warm.choose()
    assert (step.arm, step.probe) == (cold.current, False)  # plain here: nothing priced the chain
    assert warm.next_decision == AutoBudget.DECIDE_EVERY
    restored = AutoBudget.restored(cost, 0, BLOCK, after_a_short_one.state())
    assert restored is not None and not restored.decided


def test_a_drafted_step_catches_the_drafter_up_on_what_it_can_afford():
    """A chain step catches the drafter up on all it lacks while that costs at most
    DECIDE_EVERY plain steps at the cost a token measured, else on the last PROBE_LAG
    tokens (a turn's new prompt behind a chain in use), and on PROBE_LAG before a cost
    is measured; a cold chooser's first step keeps COLD_LAG."""
    from dflash_gguf.speculation.auto import AutoBudget

    auto = AutoBudget(_Cost(1e-3, 1e-4), 0, BLOCK)
    assert auto.choose().window == AutoBudget.COLD_LAG
    assert auto.choose().window == auto.catch_up_window() == AutoBudget.PROBE_LAG
    auto.costs.part.update(plain=40e-3, catch_up=5e-3)  # a CPU: 8 plain steps buy 64 tokens
    assert auto.catch_up_window() == AutoBudget.PROBE_LAG
    auto.costs.part.update(catch_up=1e-5)  # a device: 32,000
    assert auto.catch_up_window() == int(AutoBudget.DECIDE_EVERY * (40e-3 + auto.costs.plain_extra) / 1e-5)
    assert auto.choose().window == auto.catch_up_window()


def test_a_cold_choosers_first_step_catches_up_on_what_a_plain_step_costs():
    """With the drafter's cost a token of catching up measured at load (AutoMemory's
    prices), a cold chooser's first step catches it up on as many tokens as cost one
    plain step at the sequence's depth, at least COLD_LAG and at most PROBE_LAG; a prior
    that measured the cost itself keeps its own."""
    from dflash_gguf.speculation.auto import PLAIN, AutoBudget, AutoMemory

    class DeepCost(_Cost):  # every row reads the context: a step costs more at depth
        def __call__(self, n, depth=0):
            return super().__call__(n) + 1e-6 * depth

        def chain(self, n, depth=0):
            return super().chain(n) + 1e-6 * depth

    cost = DeepCost(1e-3, 1e-4)

    def first_window(catch_up: float, depth: int = 0) -> int:
        chooser = AutoMemory(cost, 0, BLOCK, prices={"catch_up": catch_up}).chooser()
        chooser.at_depth(depth)
        plain = chooser.seconds(PLAIN)
        window = chooser.choose().window
        assert window == min(AutoBudget.PROBE_LAG, max(AutoBudget.COLD_LAG, int(plain / catch_up)))
        return window

    assert first_window(1e-3) == AutoBudget.COLD_LAG  # a drafter dear beside the target: the floor
    assert AutoBudget.COLD_LAG < first_window(5e-5) < AutoBudget.PROBE_LAG
    assert first_window(5e-5, depth=4096) > first_window(5e-5)  # a dearer plain step affords more
    assert first_window(1e-7) == AutoBudget.PROBE_LAG
    measured = AutoBudget(cost, 0, BLOCK)
    measured.costs.part["catch_up"] = 2e-5
    assert AutoBudget(cost, 0, BLOCK, prior=measured, prices={"catch_up": 1e-3}).costs.part["catch_up"] == 2e-5


def test_a_probe_is_priced_with_catching_the_drafter_up_until_one_is_measured():
    """Before a probe has run, its price is a chain step plus catching the drafter up on
    PROBE_LAG tokens at the cost a token measured on drafted steps (the lowest reading);
    a measured probe replaces the estimate. A dearer probe comes later."""
    from dflash_gguf.speculation.auto import CHAIN, AutoBudget, Decision

    auto = AutoBudget(_Cost(1e-3, 1e-4), 16, BLOCK)
    auto.costs.part.update(drafted=2e-3, plain=1e-3)
    assert auto.probe_seconds() == auto.seconds(auto.arms[1])  # a drafter that never catches up
    for caught_up in ((4, 8e-3), (1, 5e-3), (0, 1.0)):  # dearer a token: the low figure stays,
        auto.learn(Decision(CHAIN, caught_up=caught_up), 0, 1e-3)  # creeping up 1%; nothing taken: nothing learnt
    assert auto.probe_seconds() == pytest.approx(auto.seconds(auto.arms[1]) + AutoBudget.PROBE_LAG * 2e-3 * 1.01)
    auto.costs.part["probe"] = 0.05
    assert auto.probe_seconds() == 0.05


def test_auto_probes_across_short_sequences():
    """Probes are spaced by plain steps counted across the sequences of one engine: where
    the gap between them is longer than a request, short requests still get them, about
    one a gap."""
    from dflash_gguf.speculation.auto import CHAIN, AutoMemory

    sim = SimPair(**CPU, take=(0.0, 0.0, 0.0, 0.0, 1.0))
    memory = AutoMemory(sim.cost, 32, 8)
    arms = []
    for i in range(100):
        chooser = memory.chooser()
        arms += [a for a, _, _ in simulate_auto(sim, steps=30, auto=chooser, seed=i)]
        chooser.finish()
    gap, late = memory.learnt.probe_gap, arms[600:]
    assert gap > 30
    assert len(late) / gap / 2 <= late.count(CHAIN) <= 2 * len(late) / gap + 1, (gap, late.count(CHAIN))


def test_unasked_plain_steps_count_as_chosen_ones():
    """On plain decoding the steps up to the next probe run without asking auto (a plain
    Decision's until_probe) and are told together (one Decision of `unasked` steps): the
    probe comes at the same step, and the counts are those of choosing each step."""
    import copy

    from dflash_gguf.speculation.auto import CHAIN, PLAIN, AutoBudget, Decision

    sim = SimPair(**CPU, take=(0.0, 0.0, 0.0, 0.0, 1.0))
    each = AutoBudget(sim.cost, 32, 8)
    simulate_auto(sim, steps=300, auto=each)
    plain = sim.plain + float(sim.cost.chain(1))  # a plain step's seconds, as the simulation times it
    decision = each.choose()
    while decision.arm != PLAIN or each.to_probe < 3:  # to the start of the plain steps before a probe
        each.learn(decision, 0, plain)
        decision = each.choose()
    together = copy.deepcopy(each)
    each.learn(decision, 0, plain)
    together.learn(decision, 0, plain)
    n = decision.until_probe
    assert n == together.to_probe - 1 >= 2
    for _ in range(n):
        chosen = each.choose()
        assert chosen.arm == PLAIN
        each.learn(chosen, 0, plain)
    together.learn(Decision(PLAIN, unasked=n), 0, n * plain)
    probe = each.choose()
    assert probe == together.choose() and probe.arm == CHAIN and probe.probe  # the probe
    for field in ("steps", "run", "to_probe", "tally"):
        assert getattr(each, field) == getattr(together, field), field


def test_auto_chooses_per_sequence():
    """Two sequences decoded together (-np), from one engine's memory: one whose drafts
    the target takes, one whose drafts it never takes. Each chooses for its own text:
    the first drafts a chain, the second decodes plainly."""
    from dflash_gguf.speculation.auto import CHAIN, PLAIN, AutoMemory

    good, bad = SimPair(**CPU, **GOOD), SimPair(**CPU, take=(0.0, 0.0, 0.0, 0.0, 1.0))
    memory = AutoMemory(good.cost, 32, 8)
    first, second = memory.chooser(), memory.chooser()
    a, b = [], []
    for _ in range(40):  # their steps interleaved, as in a batch
        a += simulate_auto(good, steps=10, auto=first, seed=len(a))
        b += simulate_auto(bad, steps=10, auto=second, seed=len(b))
    assert arm_share(a, CHAIN) >= 0.9 and arm_share(b, PLAIN) >= 0.9
    first.finish()
    assert memory.learnt is first and memory.chooser().current == CHAIN  # the next sequence starts from it


def test_auto_surveys_within_their_share_of_the_time():
    """A survey (the drafter's top-K ranked, the largest tree built) costs host time:
    free ones come every DECIDE_EVERY steps; dear ones are spaced so that they take
    about EXPLORE_SHARE of the time."""
    from dflash_gguf.speculation.auto import AutoBudget

    free, dear = [], []
    simulate_auto(SimPair(**{**CPU, "survey": 0.0}, **GOOD), survey_steps=free)
    sim = SimPair(**{**CPU, "survey": 0.3e-3 / 32}, **GOOD)  # a survey as dear as drafting
    steps = simulate_auto(sim, survey_steps=dear)
    late_free = [s for s in free if s >= 100]
    assert len(late_free) >= 300 // AutoBudget.DECIDE_EVERY - 2, free
    late = [s for s in dear if s >= 100]
    share = len(late) * 0.3e-3 / sum(s for _, _, s in steps[100:])
    assert 0.3 * AutoBudget.EXPLORE_SHARE <= share <= 1.5 * AutoBudget.EXPLORE_SHARE, dear


def test_auto_switches_rarely():
    """Each switch builds graphs: over a long run of a steady pair, once settled, auto
    keeps its arm."""
    for sim in (SimPair(**CPU, **GOOD), SimPair(**GPU, **SPREAD)):
        arms = [a for a, _, _ in simulate_auto(sim, steps=600)]
        assert sum(x != y for x, y in zip(arms[100:], arms[101:])) <= 4, arms


def test_auto_cuts_the_chain_where_its_verify_stops_paying():
    """The chain's length is chosen every step from the drafter's probabilities and the
    verify table: where a row costs little against the step, the whole block; where
    rows are dear, the drafts before the ones unlikely to be accepted."""
    from dflash_gguf.speculation.auto import AutoBudget

    top1 = np.log([0.95, 0.9, 0.85, 0.5, 0.3, 0.2, 0.1])
    flat = AutoBudget(_Cost(10e-3, 1e-6), 32, 8)
    assert flat.chain_cut(top1).n == 7
    steep = AutoBudget(_Cost(0.1e-3, 1e-3), 32, 8)
    cut = steep.chain_cut(top1)
    assert 1 <= cut.n <= 3 and len(cut.probs) == cut.n
    assert steep.chain_cut(top1) == cut  # the cut changes nothing: learn takes it with the step's result


def test_auto_calibrates_an_overconfident_drafter():
    """A drafter that believes 0.6 where the target agrees 0.3 of the time: the
    calibration learns it from what was accepted."""
    from dflash_gguf.speculation.auto import Calibration

    cal = Calibration()
    assert cal(0.6) == pytest.approx(0.6)  # a fresh calibration believes the drafter
    rng = np.random.default_rng(3)
    for _ in range(300):
        cal.update([0.6] * 4, rng.random(4) < 0.3)
        cal.age()
    assert abs(cal(0.6) - 0.3) < 0.05


def test_auto_calibrates_spine_and_branches_apart():
    """At the same drafter probability a deep node on the chain of top choices (right
    when the drafter is on a run) and a sibling of a top choice are accepted at very
    different rates: auto learns each from the trees it verifies."""
    from dflash_gguf.speculation.auto import AutoBudget, Decision

    auto = AutoBudget(_Cost(1e-3, 1e-4), 16, BLOCK)
    rng = np.random.default_rng(4)
    nodes = ([0.1, 0.1], [True, False])
    for _ in range(400):
        auto.choose()
        auto.learn(Decision(4, nodes=nodes), 1, 1e-3, [rng.random() < 0.5, rng.random() < 0.01])  # a tree's step
    assert auto.acceptance.spine(0.1) > 0.3 and auto.acceptance.branch(0.1) < 0.05


def test_auto_arms_are_few():
    from dflash_gguf.speculation.auto import auto_arms

    assert auto_arms(32) == [-1, 0, 4, 8, 16, 32]
    assert auto_arms(12) == [-1, 0, 4, 8, 12]
    assert auto_arms(3) == [-1, 0, 3]


def test_a_step_decision_is_frozen_data():
    """What a step decided is data that nothing changes: a Plan, auto's Decision and its
    ChainCut raise on assignment, and the chooser keeps no step under way."""
    from dataclasses import FrozenInstanceError

    from dflash_gguf.decoding.proposal import Plan
    from dflash_gguf.speculation.auto import AutoBudget

    auto = AutoBudget(_Cost(1e-3, 1e-4), 16, BLOCK)
    plan, decision = Plan(block=4), auto.choose()
    cut = auto.chain_cut(np.log([0.9, 0.8, 0.5]))
    for record, field in ((plan, "block"), (plan, "judged"), (decision, "arm"), (decision, "cut"), (cut, "n")):
        with pytest.raises(FrozenInstanceError):
            setattr(record, field, None)
    assert replace(plan, block=2).block == 2 and plan.block == 4
    for name in ("arm", "survey_due"):
        assert not hasattr(auto, name)
    for name in ("pending", "step_tokens"):
        assert not hasattr(auto.acceptance, name)


class _FakeDraft:
    """A drafter for AutoProposer without a model: a SimPair's candidates every step."""

    def __init__(self, sim):
        self.sim = sim

    def top1_logprobs(self, n, seq=0):
        return self.sim.logp[:n, 0]

    def topk(self, n, seq=0):
        return self.sim.cand[:n], self.sim.logp[:n]


def test_each_decision_reaches_learn_once():
    """AutoProposer driven through the step's calls (plan, propose, then verified at the
    next step and at the end): every decision choose() made comes back to learn once, in
    order, with what its propose added; the plain steps it runs unasked (until_probe)
    come back counted in decisions of `unasked` steps, each step once."""
    from types import SimpleNamespace

    from dflash_gguf.speculation.auto import AutoBudget
    from dflash_gguf.speculation.proposers import UNASKED, AutoProposer

    chosen, learnt = [], []

    class Recording(AutoBudget):
        def choose(self):
            chosen.append(super().choose())
            return chosen[-1]

        def learn(self, decision, n_acc, seconds, accepted=None):
            learnt.append(decision)
            super().learn(decision, n_acc, seconds, accepted)

    rng = np.random.default_rng(5)
    for sim in (SimPair(**CPU, take=(0.0, 0.0, 0.0, 0.0, 1.0)), SimPair(**GPU, **SPREAD)):
        chosen.clear(), learnt.clear()
        proposer = AutoProposer(_FakeDraft(sim), sim.depth + 1, Recording(sim.cost, 32, sim.depth + 1))
        seq = SimpleNamespace(tokens=SimpleNamespace(bonus=0, n_past=64), room=10 ** 6, remaining=10 ** 6, slot=0,
                              sampler=SimpleNamespace(guided=False, guide=None))
        seq.proposing = proposer.start(seq)
        heard, unasked = None, 0
        for _ in range(300):
            if heard is not None:
                proposer.verified(seq, *heard)
            plan = proposer.plan(seq)
            unasked += plan is UNASKED
            proposal = proposer.propose(seq, plan)
            if proposal.tree is not None:  # as simulate_auto times and accepts its steps
                path = [0] + sorted(sim.walk(proposal.tree, rng))
                seconds = sim.drafted + sim.node * proposal.nodes + float(sim.cost(len(proposal.tree)))
            elif proposal.decode or proposal.tokens is not None:
                path, seconds = [0], sim.plain + float(sim.cost.chain(1))
            else:
                right = rng.choice(5, size=proposal.n - 1, p=sim.take)
                path = list(range(1 + (int(np.argmax(right != 0)) if (right != 0).any() else proposal.n - 1)))
                seconds = sim.drafted + float(sim.cost.chain(proposal.n))
            heard = (proposal.plan or plan, proposal, path, [0] * len(path), seconds)
        proposer.verified(seq, *heard)
        proposer.finish(seq)
        told = [d for d in learnt if not d.unasked]
        added = dict(cut=None, seen=None, surveyed=None, nodes=None)
        assert [replace(d, **added) for d in told] == chosen
        assert sum(d.unasked for d in learnt) == unasked
        assert len(chosen) + unasked == 300 and (unasked > 100 if sim.take[0] == 0 else unasked == 0)


def test_lossless_auto_mixing_plain_chain_and_trees(pair):
    """Steps that go from plain decoding to the chain (the drafter's block verified on the
    device) to trees of several sizes and back, surveys among them: greedy output is
    still the target's own, and the sequence's statistics get auto's report."""
    from dflash_gguf.speculation.auto import PLAIN

    target, draft = load_tree(pair, budget=16)
    for prompt in prompts(3, seed=61):
        ar, _ = greedy_generate(target, prompt, 64)
        auto = _ScriptedAuto([0, 0, 4, PLAIN, PLAIN, 16, 0, 8, 8, PLAIN, 4], 16)
        out, stats = tree_generate(target, draft, prompt, 64, budget=16, auto=auto)
        assert out == ar
        assert 0 < stats.trees.chain_steps < len(stats.accepted_lengths)
        assert auto.n_trees > 0 and auto.surveys
        steps = stats.trees.auto["arms"]
        assert steps["plain"]["steps"] == auto.seen.count(PLAIN) and steps["tree 16"]["steps"] > 0
        # every step's decision came back to learn once, in order, as chosen but for what
        # its propose added
        added = dict(cut=None, seen=None, surveyed=None, nodes=None)
        assert [replace(d, **added) for d in auto.learnt] == auto.chosen


def test_auto_plain_stretches_run_no_drafter(pair):
    """Over `auto`'s plain decoding the drafter stays behind and runs no graph while the
    target's feature rows can keep what it lacks (64 rows here: a stretch of 30 steps
    runs none; one of 60 catches it up once or twice, in one graph each); the step that
    drafts again takes the stretch's positions first. Greedy output stays the target's."""
    from dflash_gguf.speculation.auto import PLAIN

    meta = read_draft_metadata(pair["draft"])
    target = Target(pair["target"], TargetConfig(n_ctx=512, n_ubatch=64, n_verify=17, kv_type="f32",
                                                 feature_layers=meta["target_layers"]))
    draft = Draft(pair["draft"], target, DraftConfig(kv_type="f32", top_k=4))
    script = [0, 4] + [PLAIN] * 30 + [0, 8, 0] + [PLAIN] * 60 + [16, 0]
    for prompt in prompts(2, seed=63):
        ar, _ = greedy_generate(target, prompt, 140)
        auto = CountingAuto(script, 16, draft)
        out, stats = tree_generate(target, draft, prompt, 140, budget=16, auto=auto)
        assert out == ar
        runs = np.diff(auto.graphs)  # the drafter's graphs in each step
        assert len(runs) >= len(script) - 1
        assert list(runs[2:32]) == [0] * 30  # the first stretch: none
        assert runs[32] == 1  # the step that drafts again: its catch-up rides in its propose
        assert 1 <= sum(runs[35:95]) <= 2  # the long stretch: caught up in a graph or two
        assert stats.trees.auto["arms"]["plain"]["steps"] == auto.seen.count(PLAIN) >= 90


def test_lossless_auto(pair):
    """The real chooser on the real pair, greedy and across requests: lossless whatever
    it picks."""
    from dflash_gguf.speculation.auto import AutoMemory

    target, draft = load_tree(pair, budget=16)
    memory = AutoMemory(_Cost(1e-3, 1e-4), 16, BLOCK)
    for prompt in prompts(3, seed=62):
        ar, _ = greedy_generate(target, prompt, 64)
        out, stats = tree_generate(target, draft, prompt, 64, budget=16, auto=memory.chooser())
        assert out == ar
        assert sum(a["steps"] for a in stats.trees.auto["arms"].values()) == len(stats.accepted_lengths)
        assert memory.learnt is not None


def test_verify_cost_is_measured_as_decoding_sees_it(pair, tmp_path, monkeypatch):
    """The cost curve times verifies whose graph is already built and which carry the
    previous step's commit: a graph build in the timed runs would make big trees look
    dearer than they are. Each size is timed in two rounds after one prefill; measured
    once, then read from the cache. A context too short to tell depth from noise prices
    every depth as shallow."""
    from dflash_gguf.speculation import verify_cost
    from dflash_gguf.speculation.verify_cost import VerifyCost

    monkeypatch.setattr(verify_cost, "NOISY", float("inf"))  # cached however busy the machine

    target = Target(pair["target"], TargetConfig(n_ctx=256, n_verify=8, kv_type="f32"))
    before = target.info()
    cost = VerifyCost(target, cache=tmp_path / "cost.json")
    after = target.info()
    sizes, kinds, rounds = 4, 2, 2  # 1, 2, 4, 8 nodes; tree and chain
    # per size, kind and round: two verifies build (without and with a commit to carry),
    # three timed verifies reuse; one 64-token prefill a kind, built once, as graphs
    # outlive a reset
    assert after["n_graphs"] - before["n_graphs"] == kinds * (1 + rounds * sizes * 5)
    # every graph is built by an untimed verify (or the prefill), none by a timed one
    assert 1 + sizes * kinds * 2 <= after["n_graph_builds"] - before["n_graph_builds"] <= 1 + kinds * rounds * sizes * 2
    assert after["n_past"] == 0
    assert np.all(cost.tree_seconds > 0) and np.all(cost.chain_seconds > 0)
    assert float(cost.chain(8, 200)) == float(cost.chain(8))  # no depth measured in 256 cells
    again = VerifyCost(target, cache=tmp_path / "cost.json")
    assert target.info()["n_graphs"] == after["n_graphs"]
    assert np.array_equal(again.tree_seconds, cost.tree_seconds)
    target.close()


def test_verify_cost_prices_depth(pair, tmp_path, monkeypatch):
    """A verify's rows each read the whole context: the table times chains at a deeper
    point too, and a verify at depth costs its shallow price plus what each cell adds,
    the more the more rows (never less for more rows, never less deeper). The deep
    point is timed once and cached with the rest."""
    import json

    from dflash_gguf.speculation import verify_cost
    from dflash_gguf.speculation.verify_cost import SHALLOW, VerifyCost

    monkeypatch.setattr(verify_cost, "NOISY", float("inf"))  # cached however busy the machine
    target = Target(pair["target"], TargetConfig(n_ctx=1024, n_verify=8, kv_type="f32"))
    cost = VerifyCost(target, cache=tmp_path / "cost.json")
    (entry,) = json.loads((tmp_path / "cost.json").read_text()).values()
    assert entry["deep"]["depth"] == 1024 - 8 - SHALLOW
    assert sorted(map(int, entry["deep"]["per_cell"])) == [1, 8]
    assert list(cost.depth_rows) == [1, 8] and np.all(cost.per_cell >= 0) and np.all(np.diff(cost.per_cell) >= 0)
    shallow = cost.chain(np.arange(1, 9))
    deep = cost.chain(np.arange(1, 9), 4096)
    assert np.all(deep >= shallow) and np.all(np.diff(deep - shallow) >= 0)
    assert float(cost.chain(4, SHALLOW)) == float(cost.chain(4))
    assert float(cost(4, 4096)) - float(cost(4)) == pytest.approx(float(cost.chain(4, 4096)) - float(cost.chain(4)))
    before = target.info()["n_graphs"]
    VerifyCost(target, cache=tmp_path / "cost.json")
    assert target.info()["n_graphs"] == before
    target.close()


class _ClockedTarget:
    """A stand-in target on a made-up clock: a chain of n rows over c cells of context
    takes (10 ms + 10 us a cell) a row, times `slow` (a slow spell while it lasts)."""

    def __init__(self):
        self.now, self.n_past, self.slow, self.truncates = 0.0, 0, 1.0, False

    def set_sampling(self, sampling):
        pass

    def reset(self):
        self.n_past = 0

    def prefill(self, tokens, logits):
        self.n_past += len(tokens)

    def info(self):
        return {"n_past": self.n_past}

    def verify(self, tokens):
        self.now += self.slow * len(tokens) * (1e-2 + 1e-5 * self.n_past)

    def choices(self, first, n):
        pass

    def commit(self, n_keep):
        self.n_past += n_keep

    def can_truncate(self):
        return self.truncates

    def seq_truncate(self, seq, n_past):
        self.n_past = n_past


@pytest.mark.parametrize("truncates", [True, False])
@pytest.mark.parametrize("slow", [1.0, 1.2])
def test_what_depth_adds_is_measured_from_points_timed_in_a_row(monkeypatch, slow, truncates):
    """What a cell of context adds to a verify is the slope through the same chains timed
    at depths from SHALLOW up to the deep point (and down again where the target can
    take positions back), one after the other, so that a slow spell lasting the whole
    measurement slows every point alike: the slope comes out `slow` times the true one,
    as every price does, and not several times steeper as a deep point timed apart from
    its shallow table did. Rows and depth as in the table: chains of 1, 8 and 48 rows,
    the deep point 2K cells in."""
    from types import SimpleNamespace

    from dflash_gguf.speculation import verify_cost

    target = _ClockedTarget()
    target.slow, target.truncates = slow, truncates
    monkeypatch.setattr(verify_cost, "time", SimpleNamespace(perf_counter=lambda: target.now))
    per, agreed = verify_cost.measure_per_cell(target, [1, 8, 48], verify_cost.DEEP)
    assert agreed
    assert per == {n: pytest.approx(slow * n * 1e-5, rel=1e-9) for n in (1, 8, 48)}
    assert target.n_past == 0  # reset afterwards


@pytest.mark.parametrize("spell, cell_cost, factor, agreed", [
    ({4: 1.6}, 1e-5, 1.0, True),  # the deepest point timed in a busy moment
    ({1: 1.6}, 1e-5, 1.0, True),  # ... or another, one way
    ({k: 1 + 0.05 * k for k in range(9)}, 1e-5, 1.2, True),  # the machine slowing steadily, to 1.4x
    ({0: 1.3}, 0.0, None, False),  # depth adding nothing, its first point slow
])
def test_a_busy_moment_does_not_move_what_depth_adds(monkeypatch, spell, cell_cost, factor, agreed):
    """Points of the depth measurement timed slow (by call: up the stairs 0-4, down 5-8).
    One point 1.6x slow leaves its slope as it was (the difference of two points at 1K
    cells, each a fifth of a one-row verify apart, came out below nothing on a noisy VM);
    the machine slowing steadily, up one way and down the other, slows every depth alike,
    by its average (1.2x), as a spell lasting the whole measurement does, and does not
    tilt it. A slope of nothing or less is not kept."""
    from types import SimpleNamespace

    from dflash_gguf.speculation import verify_cost

    target, calls = _ClockedTarget(), []
    target.truncates = True
    target.verify = lambda tokens: setattr(
        target, "now", target.now + target.slow * len(tokens) * (1e-2 + cell_cost * target.n_past))
    monkeypatch.setattr(verify_cost, "time", SimpleNamespace(perf_counter=lambda: target.now))
    time_sizes = verify_cost._time_sizes

    def timed_stair(t, sizes, tree, repeats):
        target.slow = spell.get(len(calls), 1.0)
        calls.append(target.n_past)
        return time_sizes(t, sizes, tree, repeats)

    monkeypatch.setattr(verify_cost, "_time_sizes", timed_stair)
    per, ok = verify_cost.measure_per_cell(target, [1, 8], verify_cost.DEEP)
    assert len(calls) == 2 * verify_cost.STAIRS + 1 and ok == agreed
    if factor is not None:
        assert per == {n: pytest.approx(factor * n * cell_cost, rel=1e-6) for n in (1, 8)}


@pytest.mark.parametrize("slow, rounds, agreed", [((1.6, 1.0), 3, True), ((1.0, 1.6), 3, True),
                                                 ((1.0, 1.1), 2, True), ((1.0, 1.6, 2.6), 3, False)])
def test_one_slow_round_gets_another_and_the_floor_seen_twice_is_kept(monkeypatch, slow, rounds, agreed):
    """Rounds slowed by `slow` in turn (then none): a round 1.6x slow (a busy moment on a
    noisy VM) makes the table time a third round, and two rounds agreeing keep it, the
    figure the floor and not the slow round; no two rounds of three agreeing leave the
    table to its own process, as a busy machine's."""
    from types import SimpleNamespace

    from dflash_gguf.speculation import verify_cost

    target, calls = _ClockedTarget(), []
    monkeypatch.setattr(verify_cost, "time", SimpleNamespace(perf_counter=lambda: target.now))
    time_sizes = verify_cost._time_sizes

    def timed_round(t, sizes, tree, repeats):
        target.slow = slow[len(calls)] if len(calls) < len(slow) else 1.0
        calls.append(sizes)
        return time_sizes(t, sizes, tree, repeats)

    monkeypatch.setattr(verify_cost, "_time_sizes", timed_round)
    got, ok = verify_cost.measure_verify_cost(target, [1, 4, 8], tree=False)
    assert (len(calls), ok) == (rounds, agreed)
    if agreed:
        # each verify keeps a cell: the least is within a few dozen cells of SHALLOW, far below 1.6x
        assert got == {n: pytest.approx(n * (1e-2 + 1e-5 * verify_cost.SHALLOW), rel=0.05) for n in (1, 4, 8)}


def test_verify_cost_on_a_busy_machine_is_not_cached(pair, tmp_path, monkeypatch):
    """Where a size's two rounds disagree (another process took the cores), the table
    serves the run that measured it and is not written: the next run measures again."""
    from dflash_gguf.speculation import verify_cost

    monkeypatch.setattr(verify_cost, "NOISY", 0.5)  # no two rounds agree
    target = Target(pair["target"], TargetConfig(n_ctx=256, n_verify=4, kv_type="f32"))
    cost = verify_cost.VerifyCost(target, cache=tmp_path / "cost.json")
    assert np.all(cost.chain_seconds > 0)
    assert not (tmp_path / "cost.json").exists()
    target.close()


def test_verify_cost_adds_the_sizes_another_engine_lacked(pair, tmp_path, monkeypatch):
    """Engines of one model verify up to different row counts: a second one with a longer
    limit measures only the sizes the cached entry lacks and keeps the others', and a
    shorter one after it measures nothing."""
    import json

    from dflash_gguf.speculation import verify_cost
    from dflash_gguf.speculation.verify_cost import VerifyCost

    monkeypatch.setattr(verify_cost, "NOISY", float("inf"))  # cached however busy the machine
    cache = tmp_path / "cost.json"
    short = Target(pair["target"], TargetConfig(n_ctx=256, n_verify=4, kv_type="f32"))
    first = VerifyCost(short, cache=cache)
    short.close()
    long = Target(pair["target"], TargetConfig(n_ctx=256, n_verify=16, kv_type="f32"))
    before = long.info()["n_graphs"]
    second = VerifyCost(long, cache=cache)
    # sizes 8, 12 and 16 only (tree and chain, two rounds of five verifies each), plus
    # their prefills' graphs
    measured = long.info()["n_graphs"] - before
    assert measured == 2 * (1 + 2 * 3 * 5)
    assert np.array_equal(second.tree_seconds[:3], first.tree_seconds)
    (entry,) = json.loads(cache.read_text()).values()
    assert sorted(map(int, entry["tree"])) == sorted(map(int, entry["chain"])) == [1, 2, 4, 8, 12, 16]
    long.close()
    again = Target(pair["target"], TargetConfig(n_ctx=256, n_verify=4, kv_type="f32"))
    before = again.info()["n_graphs"]
    VerifyCost(again, cache=cache)
    assert again.info()["n_graphs"] == before
    again.close()
