"""DDTree: the best-first tree builder, tree verification of the hybrid target against
plain decoding along each node's path, and lossless tree speculative decoding."""
from __future__ import annotations

import itertools

import numpy as np
import pytest

from parity import Parity
from tree_paths import root_path
from test_speculative import BLOCK, ScriptedDraft, pair, prompts  # noqa: F401 (fixture)

from dflash_gguf.ddtree import accept_path, build_tree, chain_tree
from dflash_gguf.draft import Draft, DraftConfig, read_draft_metadata
from dflash_gguf.generate import greedy_generate
from dflash_gguf.speculative import speculative_generate, tree_generate
from dflash_gguf.target import LOGITS_ALL, LOGITS_LAST, Target, TargetConfig


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
    original = target.verify_tree

    def verify_tree(tokens, parents, seq=0):
        shapes.add(tuple(parents))
        return original(tokens, parents, seq=seq)

    target.verify_tree = verify_tree
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
        out, stats = tree_generate(target, fake, prompt, 96, budget=16)
        assert out == ar
        assert max(stats.accepted_lengths) >= 3, stats.accepted_lengths


# ---- budget choice ----------------------------------------------------------------------

class _Cost:
    """A verify cost table: time linear in the node count (the chain's own line)."""

    def __init__(self, fixed, per_node, chain_fixed=None, chain_per_node=None):
        self.fixed, self.per_node = fixed, per_node
        self.chain_fixed = fixed if chain_fixed is None else chain_fixed
        self.chain_per_node = per_node if chain_per_node is None else chain_per_node

    def __call__(self, n):
        return self.fixed + self.per_node * np.asarray(n, dtype=float)

    def chain(self, n):
        return self.chain_fixed + self.chain_per_node * np.asarray(n, dtype=float)


def simulate_auto(step_seconds, accept, steps=400, seed=0, depth=7, largest=32, cost=None, surveys=None,
                  survey_seconds=None, cold=(0, 1.0)):
    """AutoBudget driven by a simulated pair: every step the drafter gives its top-4
    candidates per depth (the top one at 0.6, the others sharing the rest), the target
    accepts each drafted node with probability accept(node's drafter probability), and
    an arm's step takes step_seconds[arm] (a survey's work survey_seconds more, when
    given; the first cold[0] steps cold[1] times as long). Returns the arm of every step
    (and appends the index of every survey step to `surveys`)."""
    from dflash_gguf.budget import CHAIN, AutoBudget, chain_nodes, tree_nodes

    rng = np.random.default_rng(seed)
    auto = AutoBudget(cost or _Cost(1e-3, 1e-4), largest, depth + 1)
    arms = []
    cand = np.arange(depth * 4).reshape(depth, 4)
    logp = np.log(np.tile([0.6, 0.2, 0.12, 0.08], (depth, 1)))
    accept_rank = accept(np.exp(logp[0]))
    accept_rank = np.append(accept_rank, max(0.0, 1.0 - accept_rank.sum()))  # last: none of the four
    for _ in range(steps):
        arm = auto.choose()
        survey = auto.wants_survey()
        if survey and surveys is not None:
            surveys.append(len(arms))
        full = build_tree(0, cand, logp, largest)
        if survey:
            auto.survey(tree_nodes(full, logp[:, 0]), chain_nodes(logp[:, 0]))
        if arm == CHAIN:
            nodes = chain_nodes(logp[:, 0])
            ok = rng.random(depth) < accept(np.full(depth, 0.6))  # each depth's top choice right or not
            accepted = np.cumprod(ok).astype(bool)
        else:
            tree = full.best(arm)
            # the target's token at each depth: the drafter's rank r with the probability
            # accept gives it, walking down while it is a child
            right = rng.choice(5, size=depth, p=accept_rank)
            path, node, kids = set(), 0, tree.children()
            for d in range(depth):
                nxt = kids[node].get(int(cand[d][right[d]])) if right[d] < 4 else None
                if nxt is None:
                    break
                path.add(nxt)
                node = nxt
            nodes, accepted = tree_nodes(tree, logp[:, 0]), [i in path for i in tree.pick_order]
        extra = 0.0
        if survey:
            auto.verified(nodes, accepted)
            if survey_seconds is not None:
                extra = survey_seconds
                auto.surveyed(survey_seconds)
        slow = cold[1] if len(arms) < cold[0] else 1.0
        auto.timed(arm, slow * step_seconds[arm] + extra, 1 + (depth if arm == CHAIN else arm))
        arms.append(arm)
    return arms


def test_auto_converges_to_the_chain_when_the_chain_is_fastest():
    """A drafter whose top choice is right as often as it says, and tree verifies that
    cost twice the chain's: the chain gives the most tokens per second, and auto ends
    up running it almost always, whatever the cost table claimed (here: that trees
    are nearly free)."""
    from dflash_gguf.budget import CHAIN

    seconds = {0: 1.0, 4: 2.0, 8: 2.2, 16: 2.6, 32: 3.4}
    arms = simulate_auto(seconds, lambda p: p, cost=_Cost(1e-3, 1e-5, 1.0, 0.1))
    assert arms[-1] == CHAIN
    assert arms[200:].count(CHAIN) >= 0.9 * 200, arms


def test_auto_converges_to_the_best_tree_when_a_tree_is_fastest():
    """The same drafter with trees priced like the chain plus a little per node: a tree
    of 8 accepts more than the chain for nearly the same time and beats both the chain
    and the dearer large trees; auto ends up there, although the cost table (here:
    trees far dearer than the chain) would have kept it on the chain."""
    seconds = {0: 1.0, 4: 1.0, 8: 1.02, 16: 1.8, 32: 3.0}
    arms = simulate_auto(seconds, lambda p: p, cost=_Cost(1.0, 1.0, 1e-3, 1e-5))
    assert arms[-1] == 8
    assert arms[200:].count(8) >= 0.8 * 200, arms


def test_auto_times_the_arm_in_use_again_before_a_trial_replaces_it():
    """A process's first steps run cold: the chain's first figures come out 1.6x its
    steady time, and a tree of 4, in truth 15% slower a step for what it accepts
    more, wins its trial against them. auto times the chain again before leaving it
    and keeps it; judged against the cold figures the tree would run for good."""
    from dflash_gguf.budget import CHAIN

    seconds = {0: 1.0, 4: 1.15, 8: 1.3, 16: 1.8, 32: 3.0}
    assert simulate_auto(seconds, lambda p: p)[40:].count(CHAIN) >= 0.9 * 360  # warm from the start
    for seed in range(3):
        arms = simulate_auto(seconds, lambda p: p, seed=seed, cold=(8, 1.6))
        assert arms[40:].count(CHAIN) >= 0.9 * 360, (seed, arms)


def test_auto_never_runs_sizes_past_the_peak():
    """Tokens per second peak at one tree size: auto climbs the sizes from the chain and
    stops at the first one past the peak, so the dear large trees, whose trial steps
    alone would cost more than the rest of a short request gains, never run."""
    chain_best = simulate_auto({0: 1.0, 4: 2.0, 8: 2.2, 16: 2.6, 32: 3.4}, lambda p: p)
    assert set(chain_best) == {0, 4}, sorted(set(chain_best))
    eight_best = simulate_auto({0: 1.0, 4: 1.0, 8: 1.02, 16: 1.8, 32: 3.0}, lambda p: p)
    assert 32 not in eight_best and eight_best[-1] == 8, sorted(set(eight_best))


def test_auto_surveys_rarely_once_an_arm_leads_clearly():
    """A survey (ranking the drafter's candidates, building a tree, calibrating) costs
    a small model's step a few percent: once the arm in use leads its neighbours by the
    switching margin they come every SURVEY_SETTLED steps; while it is a close call
    (the chain against a tree of 4 that accepts about as much for the same time, after
    the first trials) every SURVEY_EVERY steps, so that the calibration learns fast
    enough to tell them apart."""
    from dflash_gguf.budget import AutoBudget

    clear, close = [], []
    simulate_auto({0: 1.0, 4: 2.0, 8: 2.2, 16: 2.6, 32: 3.4}, lambda p: p, surveys=clear)
    simulate_auto({0: 1.0, 4: 1.0, 8: 1.02, 16: 1.8, 32: 3.0}, lambda p: p, surveys=close)
    assert sum(s >= 200 for s in clear) <= 200 // AutoBudget.SURVEY_SETTLED + 2, clear
    assert sum(12 <= s < 60 for s in close) >= 48 // AutoBudget.SURVEY_EVERY - 1, close


def test_auto_spaces_surveys_that_cost_a_visible_part_of_a_step():
    """On a small model a survey's work is a fifth of a step or more: at the learning
    rate of a close call (a survey every SURVEY_EVERY steps) that would be 5% of the
    decoding time. auto measures the surveys' work and spaces them so that it stays
    near SURVEY_SHARE of the time (trials, which survey every step, apart); a survey
    that costs next to nothing, as on a large model, leaves the rate as it was."""
    from dflash_gguf.budget import AutoBudget

    close = {0: 1.0, 4: 1.0, 8: 1.02, 16: 1.8, 32: 3.0}
    free, cheap, dear = [], [], []
    simulate_auto(close, lambda p: p, surveys=free)
    simulate_auto(close, lambda p: p, surveys=cheap, survey_seconds=1e-4)
    arms = simulate_auto(close, lambda p: p, surveys=dear, survey_seconds=0.25)
    assert cheap == free
    later = [s for s in dear if s >= 100]
    share = 0.25 * len(later) / sum(close[a] for a in arms[100:])
    assert share <= 1.2 * AutoBudget.SURVEY_SHARE, dear
    assert 0.25 * sum(s >= 100 for s in free) / sum(close[a] for a in arms[100:]) > 1.5 * AutoBudget.SURVEY_SHARE
    assert min(b - a for a, b in zip(later, later[1:])) >= 0.25 / (AutoBudget.SURVEY_SHARE * 1.02), later


def test_auto_calibrates_an_overconfident_drafter():
    """A drafter that believes 0.6 where the target agrees 0.3 of the time: the
    calibration learns it from what was accepted, and with it the chain's long tail
    stops looking worth a dearer verify."""
    from dflash_gguf.budget import Calibration

    cal = Calibration()
    rng = np.random.default_rng(3)
    for _ in range(300):
        cal.update(np.full(4, 0.6), rng.random(4) < 0.3)
    assert abs(float(cal(np.array([0.6]))[0]) - 0.3) < 0.05
    assert float(cal(np.array([0.6]))[0]) < 0.6
    # a fresh calibration believes the drafter
    assert float(Calibration()(np.array([0.6]))[0]) == pytest.approx(0.6)


def test_auto_calibrates_spine_and_branches_apart():
    """At the same drafter probability a deep node on the chain of top choices (right
    when the drafter is on a run) and a sibling of a top choice are accepted at very
    different rates: auto learns each from what it verifies."""
    from dflash_gguf.budget import AutoBudget

    auto = AutoBudget(_Cost(1e-3, 1e-4), 16, BLOCK)
    rng = np.random.default_rng(4)
    nodes = (np.array([0.1, 0.1]), np.array([True, False]))
    for _ in range(400):
        auto.verified(nodes, [rng.random() < 0.5, rng.random() < 0.01])
    spine, branch = auto.gains(nodes)
    assert spine > 0.3 and branch < 0.05


def test_auto_switches_rarely():
    """Each switch builds graphs: over a long run of a steady pair auto settles; it
    leaves its arm only to check the runner-up now and then."""
    seconds = {0: 1.0, 4: 1.05, 8: 1.1, 16: 1.8, 32: 3.0}
    arms = simulate_auto(seconds, lambda p: p, steps=600)
    switches = sum(a != b for a, b in zip(arms[200:], arms[201:]))
    assert switches <= 2 * 400 // 96 + 2, switches


def test_auto_refreshes_less_often_while_refreshes_confirm_the_arm():
    """A refresh trial of a neighbour that loses costs its slower steps: each one that
    confirms the arm in use doubles the interval to the next, so a steady pair runs a
    few of them over a long run, not one every REFRESH steps."""
    for seed in range(3):
        arms = simulate_auto({0: 1.0, 4: 1.05, 8: 1.1, 16: 1.8, 32: 3.0}, lambda p: p, steps=1200, seed=seed)
        switches = sum(a != b for a, b in zip(arms[12:], arms[13:]))
        assert switches <= 10, (seed, switches)


def test_auto_prices_the_chain_at_the_verify_length_it_runs_lately():
    """The chain's steps are kept less the cost table's verify of the length they
    verified: timed on easy text (long chains), it is priced on hard text with the
    short verifies it runs there, not the long ones it was timed with."""
    from dflash_gguf.budget import CHAIN, AutoBudget, chain_nodes, tree_nodes

    cost = _Cost(1e-3, 1e-4, 0.5e-3, 0.2e-3)  # a chain verify of n: 0.5 ms + 0.2 ms a token
    auto = AutoBudget(cost, 8, 8)
    for _ in range(12):  # easy text: every chain verifies 8 tokens, steps of 1 ms + its verify
        assert auto.choose() == CHAIN
        auto.timed(CHAIN, 1e-3 + float(cost.chain(8)), 8)
    assert auto.step_seconds(CHAIN) == pytest.approx(1e-3 + float(cost.chain(8)))
    empty = build_tree(0, np.zeros((0, 4), dtype=int), np.zeros((0, 4)), 8)
    for _ in range(20):  # hard text: surveys see chains cut to one draft
        auto.survey(tree_nodes(empty, []), chain_nodes([np.log(0.9)]))
    assert auto.chain_drafts == pytest.approx(1.0, abs=1e-3)
    assert auto.step_seconds(CHAIN) == pytest.approx(1e-3 + float(cost.chain(2)), rel=1e-3)


def test_auto_arms_are_few():
    from dflash_gguf.budget import auto_arms

    assert auto_arms(32) == [0, 4, 8, 16, 32]
    assert auto_arms(12) == [0, 4, 8, 12]
    assert auto_arms(3) == [0, 3]


class _ScriptedAuto:
    """An AutoBudget stand-in that runs a fixed sequence of arms (the chain and tree
    sizes interleaved) and records what the loop reports."""

    def __init__(self, arms, largest):
        from dflash_gguf.budget import AutoBudget

        self.real = AutoBudget(_Cost(1e-3, 1e-4), largest, BLOCK)
        self.largest, self.script, self.seen, self.n_verified, self.survey_costs = largest, list(arms), [], 0, []

    def choose(self):
        self.real.choose()
        arm = self.script[len(self.seen) % len(self.script)]
        self.seen.append(arm)
        return arm

    def wants_survey(self):
        return len(self.seen) % 3 == 1

    def survey_size(self):
        return self.largest  # every size runs

    def start_request(self):
        self.real.start_request()

    def survey(self, *a):
        self.real.survey(*a)

    def verified(self, nodes, accepted):
        probs, spine = nodes
        assert len(probs) == len(spine) == len(accepted) and np.all((0 <= probs) & (probs <= 1))
        # the chain is all spine; a tree's first node is the drafter's top choice
        assert spine.all() if self.seen[-1] == 0 else spine[0]
        self.n_verified += 1
        self.real.verified(nodes, accepted)

    def surveyed(self, seconds):
        assert seconds > 0
        self.survey_costs.append(seconds)
        self.real.surveyed(seconds)

    def timed(self, arm, seconds, n_verified):
        assert arm == self.seen[-1] and seconds > 0 and n_verified >= 1
        self.real.timed(arm, seconds, n_verified)


def test_lossless_auto_mixing_chain_and_trees(pair):
    """Steps that go from the chain (the drafter's block verified on the device) to
    trees of several sizes and back, surveys between them: greedy output is still the
    target's own."""
    target, draft = load_tree(pair, budget=16)
    for prompt in prompts(3, seed=61):
        ar, _ = greedy_generate(target, prompt, 64)
        auto = _ScriptedAuto([0, 0, 4, 16, 0, 8, 8, 4], 16)
        out, stats = tree_generate(target, draft, prompt, 64, budget=16, auto=auto)
        assert out == ar
        assert stats.chain_steps > 0 and stats.chain_steps < len(stats.accepted_lengths)
        assert auto.n_verified > 0 and len(auto.survey_costs) == auto.n_verified


def test_auto_chain_arm_is_cut_by_p_min(pair):
    """auto's chain steps verify the drafts chain_length keeps (here one: the random
    drafter is never that sure), greedy output unchanged; the trees are not cut."""
    target, draft = load_tree(pair, budget=16)
    for prompt in prompts(2, seed=63):
        ar, _ = greedy_generate(target, prompt, 48)
        auto = _ScriptedAuto([0, 0, 8, 0], 16)
        out, stats = tree_generate(target, draft, prompt, 48, budget=16, auto=auto, p_min=0.999)
        assert out == ar
        sizes = [n for n, arm in zip(stats.tree_sizes, auto.seen) if arm == 0]
        assert sizes and set(sizes) == {1}, stats.tree_sizes
        assert max(n for n, arm in zip(stats.tree_sizes, auto.seen) if arm == 8) == 8


def test_lossless_auto(pair):
    """The real chooser on the real pair: lossless whatever it picks."""
    from dflash_gguf.budget import AutoBudget

    target, draft = load_tree(pair, budget=16)
    auto = AutoBudget(_Cost(1e-3, 1e-4), 16, BLOCK)
    for prompt in prompts(3, seed=62):
        ar, _ = greedy_generate(target, prompt, 64)
        out, _ = tree_generate(target, draft, prompt, 64, budget=16, auto=auto)
        assert out == ar


def test_verify_cost_is_measured_as_decoding_sees_it(pair, tmp_path):
    """The cost curve times verifies whose graph is already built and which carry the
    previous step's commit: a graph build in the timed runs would make big trees look
    dearer than they are. Measured once, then read from the cache."""
    from dflash_gguf.budget import VerifyCost

    target = Target(pair["target"], TargetConfig(n_ctx=256, n_verify=8, kv_type="f32"))
    before = target.info()
    cost = VerifyCost(target, cache=tmp_path / "cost.json")
    after = target.info()
    sizes, kinds = 4, 2  # 1, 2, 4, 8 nodes; tree and chain
    # per size and kind: two verifies build (without and with a commit to carry), five
    # timed verifies reuse; the 64-token prefill is built once, as graphs outlive a reset
    assert after["n_graphs"] - before["n_graphs"] == sizes * kinds * (1 + 7)
    assert after["n_graph_builds"] - before["n_graph_builds"] == 1 + sizes * kinds * 2
    assert after["n_past"] == 0
    assert np.all(cost.tree_seconds > 0) and np.all(cost.chain_seconds > 0)
    again = VerifyCost(target, cache=tmp_path / "cost.json")
    assert target.info()["n_graphs"] == after["n_graphs"]
    assert np.array_equal(again.tree_seconds, cost.tree_seconds)


