"""Workers for tests/runtime/test_reuse_check.py, run in a fresh interpreter
(target_workers.run_isolated): RPC devices stay registered for the life of a process."""
from __future__ import annotations

from typing import Optional

MODES = {"plain": None, "chain": {}, "tree": {"tree_budget": 8}, "auto": {"tree_budget": "auto"}}


def demo_modes(endpoint: Optional[str], n: int) -> dict:
    """The demo pair's greedy tokens in every mode, on the CPU or (endpoint) all on the
    RPC stand-in's device, with how many of the target's and the drafter's graphs were
    computed and how many of those were built (the rest: kept graphs computed again)."""
    from dflash_gguf.runtime.demo import DEMO_PROMPT, demo_paths
    from dflash_gguf.engine.engine import Engine

    device = {}
    if endpoint is not None:
        from dflash_gguf.runtime.devices import add_rpc_server

        add_rpc_server(endpoint)
        device = {"device": "RPC0", "n_gpu_layers": -1}
    target, draft = demo_paths()
    out = {}
    for mode, options in MODES.items():
        with Engine(target, None if options is None else draft, n_ctx=256, n_threads=1, kv_type="f16",
                    **device, **(options or {})) as engine:
            got = engine.generate(DEMO_PROMPT, n, stop_tokens=())
            graphs = [engine.target.info()]
            if engine.draft is not None:
                graphs.append(engine.draft.info())
            out[mode] = {"tokens": got.tokens,
                         "graphs": [[int(i["n_graphs"]), int(i["n_graph_builds"])] for i in graphs]}
    return out
