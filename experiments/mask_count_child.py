"""The passes experiments/mask_count.py counts under callgrind, each between two marks (a
callgrind dump each); prints the log of passes as JSON. Run as a file, so that Python puts
experiments/ (for sampling_cost) first on the path, not the working directory.

    python experiments/mask_count_child.py TARGET DRAFT GRAMMAR.npy REPS MARKER.so greedy|sampled
"""
import ctypes, json, sys
import numpy as np
from sampling_cost import SAMPLED, TREE_NODES, best_first_tree, half_mask
from dflash_gguf.runtime.drafter import Draft, DraftConfig, read_draft_metadata
from dflash_gguf.decoding.sampling import GREEDY, Sampler
from dflash_gguf.runtime.target import CHAIN, LOGITS_LAST, Rows, Target, TargetConfig

target_path, draft_path, grammar_path, reps = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
mark = ctypes.CDLL(sys.argv[5]).cg_mark
sampled = sys.argv[6] == "sampled"
grammar = np.load(grammar_path)
log = []

def one_pass(t, d, sampler, tree, mask):
    rows = TREE_NODES if tree else d.block_size
    sampler.prepare(t, rows)
    if mask is not None:
        t.set_masks(mask[:rows])
    if tree:
        t.verify_tree(list(range(500, 500 + rows)), best_first_tree(rows))
    else:
        t.step([Rows(0, CHAIN, n=rows)], d)
    sampler.choices(t, 0, rows)
    mark()  # a dump: this pass's instructions
    builds = t.info()["n_graph_builds"]
    if tree:
        t.commit_path([0])
    else:
        t.commit(1)
    return builds

def start(t, d):
    t.reset()
    d.reset()
    t.set_sampling(GREEDY.native())
    t.prefill(list(range(1000, 1064)), LOGITS_LAST)
    d.append()
    d.propose(7, d.block_size, read=False)

meta = read_draft_metadata(draft_path)
with Target(target_path, TargetConfig(n_ctx=512, n_ubatch=64, n_verify=TREE_NODES, kv_type="f16",
                                      feature_layers=meta["target_layers"], n_threads=1)) as t, \
        Draft(draft_path, t, DraftConfig(top_k=4)) as d:
    dense = half_mask(t.n_vocab, TREE_NODES)
    for tree in (False, True):
        rows = TREE_NODES if tree else d.block_size
        name = "tree16" if tree else "chain16"
        if sampled:
            samplers = {"sampled": Sampler(SAMPLED), "sampled-masked": Sampler(SAMPLED)}
        else:
            samplers = {"greedy": Sampler(GREEDY), "masked": Sampler(GREEDY)}
        start(t, d)
        mark()  # a dump: set-up, not counted
        builds = t.info()["n_graph_builds"]
        for rep in range(reps + 2):  # the first passes build graphs
            for kind, sampler in samplers.items():
                sampler.apply(t)
                now = one_pass(t, d, sampler, tree, dense if kind.endswith("masked") else None)
                log.append([name, kind, rep >= 2, now - builds])
                builds = now
        if sampled:
            continue
        windows = [grammar[(5 * i) % (len(grammar) - rows + 1):][:rows] for i in range(reps + 3)]
        start(t, d)
        sampler = Sampler(GREEDY)
        mark()
        builds = t.info()["n_graph_builds"]
        for rep, window in enumerate(windows):
            for kind in ("greedy", "json"):
                now = one_pass(t, d, sampler, tree, window if kind == "json" else None)
                log.append([name, "json-" + kind if kind == "greedy" else kind, rep >= 3, now - builds])
                builds = now
print(json.dumps(log))
