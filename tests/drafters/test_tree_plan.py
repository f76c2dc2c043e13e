"""Tree verify planning (csrc/dfl_tree.c) on its own: for random trees, the layout the
planner gives is read the way the verify graph reads it, and every node must come out
with its own root path: the recurrence's output row of each node is the state after
exactly the nodes on its path, in order, and the convolution's window of each node is
the last d_conv inputs along that path."""
from __future__ import annotations

import numpy as np
import pytest

from dflash_gguf.runtime.native import DflashError, check, ffi, lib

from helpers.tree_paths import root_path


def describe(parents, d_conv=4):
    out = ffi.new("dfl_tree_layout *")
    par = np.ascontiguousarray(parents, dtype=np.int32)
    check(lib.dfl_tree_describe(ffi.from_buffer("int32_t[]", par), len(par), d_conv, out))
    return out


def random_tree(rng, n, branching):
    """Parents of an n-node tree, node 0 the root and parents before children; branching
    near 0 gives long chains, near 1 bushy trees."""
    parents = [-1]
    for i in range(1, n):
        parents.append(i - 1 if rng.random() > branching else int(rng.integers(0, i)))
    return parents


def ints(arr, n):
    return [int(arr[i]) for i in range(n)]


def recurrence_outputs(lay):
    """Per output row, the nodes the recurrence ran to produce it (from the committed
    state), reading the layout as the graph does."""
    steps = ints(lay.step_node, lay.n_steps)
    n_rows = lay.n_out_rows
    if lay.n_branches == 0:
        spine = [steps[:s + 1] for s in range(lay.spine)]
        return [spine[r] for r in ints(lay.out_rows, n_rows)]
    head = [steps[:s + 1] for s in range(lay.split)]
    out = [head[r] for r in ints(lay.out_rows, n_rows)]
    scatter = ints(lay.scatter, lay.n_scatter)
    at = 0

    def put(results):
        nonlocal at
        for res in results:
            out[scatter[at]] = res
            at += 1

    put([steps[:s + 1] for s in range(lay.split, lay.spine)])  # the spine's second op
    kept = lay.split - lay.first
    # the first op's kept states, most recent first: state s is after step split - 1 - s
    states = [steps[:lay.split - s] for s in range(kept)]
    b = 0
    row = lay.spine
    for g in range(2):
        results = []
        for _ in range(lay.branches[g]):
            start = states[lay.branch_from[b]]
            run = steps[row:row + lay.steps[g]]
            results += [start + run[:s + 1] for s in range(lay.steps[g])]
            row += lay.steps[g]
            b += 1
        put(results)
    return out


def conv_windows(lay, d_conv):
    """Per node, the columns of [committed inputs | nodes] its convolution output reads."""
    W, n = d_conv - 1, lay.n
    rows = ints(lay.conv_rows, lay.n_conv_rows)
    if not lay.conv_spine:
        return [rows[i * d_conv:(i + 1) * d_conv] for i in range(n)]
    spine = [rows[s:s + d_conv] for s in range(lay.spine)]
    out = [spine[r] for r in ints(lay.conv_out, lay.n_conv_out)]
    for k in range(lay.off):
        at = W + lay.spine + k * d_conv
        out[lay.conv_scatter[k]] = rows[at:at + d_conv]
    return out[:n]


def expected_window(parents, i, d_conv):
    W = d_conv - 1
    cols = list(range(W)) + [W + j for j in root_path(parents, i)]
    return cols[-d_conv:]


SHAPES = [
    [-1],
    [-1, 0],
    [-1, 0, 1, 2, 3, 4],              # a chain
    [-1, 0, 0, 0, 0, 0],              # a star
    [-1, 0, 1, 2, 0, 4, 5, 1, 7, 3],  # branches off several spine steps
]


@pytest.mark.parametrize("parents", SHAPES)
@pytest.mark.parametrize("d_conv", [2, 4])
def test_every_node_gets_its_own_root_path(parents, d_conv):
    lay = describe(parents, d_conv)
    n = len(parents)
    for i in range(n):
        path = root_path(parents, i)
        assert lay.depth[i] == len(path) - 1
        assert [j for j in range(n) if lay.ancestors[i] >> j & 1] == sorted(path)
        assert ints(lay.windows[i * d_conv:(i + 1) * d_conv], d_conv) == expected_window(parents, i, d_conv)
    outs = recurrence_outputs(lay)
    assert [outs[i] for i in range(n)] == [root_path(parents, i) for i in range(n)]
    assert conv_windows(lay, d_conv) == [expected_window(parents, i, d_conv) for i in range(n)]


@pytest.mark.parametrize("seed", range(12))
def test_random_trees(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(2, 65))
    parents = random_tree(rng, n, branching=float(rng.uniform(0.05, 0.9)))
    lay = describe(parents, 4)
    outs = recurrence_outputs(lay)
    assert [outs[i] for i in range(n)] == [root_path(parents, i) for i in range(n)]
    assert conv_windows(lay, 4) == [expected_window(parents, i, 4) for i in range(n)]
    # the spine is a longest root path; a tree's recurrence runs at most 2 + 2 ops of
    # padded steps, never more branches than the nodes off the spine allow
    assert lay.spine == max(lay.depth[i] for i in range(n)) + 1
    assert lay.n_branches <= max(n - 2, 0)


def test_a_chain_is_the_spine_alone():
    lay = describe(list(range(-1, 15)), 4)
    assert lay.spine == 16 and lay.n_branches == 0
    assert ints(lay.step_node, lay.n_steps) == list(range(16))


def test_bad_trees_are_refused():
    for parents, what in (([0, 0], "parent"), ([-1, 1], "parent"), ([-1, 0, 5], "parent"), (list(range(-1, 64)), "64")):
        with pytest.raises(DflashError, match=what):
            describe(parents)
    with pytest.raises(DflashError, match="kernel"):
        describe([-1, 0], 1)
