"""Work for tests/runtime/test_moe_offload.py that runs in a child process (run_isolated
"moe_workers:<func>"): routed experts in host memory beside a device (the ggml RPC
stand-in), and what that costs in memory. No torch import."""
from __future__ import annotations

import os
import re
from pathlib import Path


def _status_kib(pid, field: str) -> int:
    text = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(rf"^{field}:\s+(\d+) kB", text, re.M).group(1))


def resident(pid) -> int:
    return _status_kib(pid, "VmRSS") << 10


def reset_peak(pid) -> None:
    """Make the process's peak resident set (VmHWM) its current one."""
    Path(f"/proc/{pid}/clear_refs").write_text("5")


def peak(pid) -> int:
    return _status_kib(pid, "VmHWM") << 10


def placed_runs(endpoint: str, target_path: str, draft_path: str, placements: list, prompt: list,
                n_new: int) -> dict:
    """For each placement {"device", "rules": [[pattern, device], ...]}: greedy plain,
    chain and tree (budget 6) generations of n_new tokens after `prompt`, the logits of a
    4-node tree verify after the prompt, and of chain verifies of 4 and 8 rows: the
    graph's splits, bytes copied between devices and the nodes left on the CPU; the
    target's info (host_layer_weights)."""
    import numpy as np

    from dflash_gguf.runtime.devices import add_rpc_server
    from dflash_gguf.runtime.drafter import Draft, DraftConfig, read_draft_metadata
    from dflash_gguf.speculation.drafting import default_p_min
    from helpers.loops import greedy_generate, speculative_generate, tree_generate
    from dflash_gguf.runtime.target import LOGITS_ALL, Target, TargetConfig

    add_rpc_server(endpoint)
    layers = read_draft_metadata(draft_path)["target_layers"]
    out = []
    for place in placements:
        cfg = TargetConfig(n_ctx=256, n_ubatch=16, n_verify=16, kv_type="f32", n_threads=1, feature_layers=layers,
                           device=place["device"], tensor_overrides=tuple(map(tuple, place["rules"])))
        with Target(target_path, cfg) as t, Draft(draft_path, t, DraftConfig(kv_type="f32", top_k=4)) as d:
            run = {"info": t.info(), "p_min": default_p_min(t), "verify": {}}
            t.prefill(prompt, LOGITS_ALL)
            t.verify_tree(prompt[:4], [-1, 0, 0, 1])
            run["tree_logits"] = np.asarray(t.logits(0, 4)).tolist()
            for n in (4, 8):
                t.reset()
                t.prefill(prompt, LOGITS_ALL)
                t.verify(prompt[:n])
                run["verify"][n] = t.placement()
            for mode in ("plain", "chain", "tree"):
                t.reset()
                d.reset()
                run[mode] = (greedy_generate(t, prompt, n_new) if mode == "plain" else
                             speculative_generate(t, d, prompt, n_new) if mode == "chain" else
                             tree_generate(t, d, prompt, n_new, budget=6))[0]
            out.append(run)
    return {"runs": out}


def engine_run(endpoint: str, target_path: str, draft_path: str, options: dict, prompt: list, n_new: int) -> dict:
    """dflash_gguf.Engine with these options (the Python API's placement keywords): a
    greedy tree generation, its statistics of graph splits and copied bytes, and the plan."""
    from dflash_gguf.runtime.devices import add_rpc_server
    from dflash_gguf.engine.engine import Engine

    add_rpc_server(endpoint)
    with Engine(target_path, draft_path, **options) as engine:
        result = engine.generate(prompt, max_tokens=n_new)
        return {"tokens": result.tokens, "graph_splits": result.stats.graphs.splits,
                "copy_bytes_per_step": result.stats.graphs.copy_bytes_per_step,
                "plan": engine.memory_plan.to_json(), "info": engine.target.info()}


def measured_memory(endpoint: str, server_pid: int, target_path: str, rules: list, n_ctx: int,
                    prompt: list) -> dict:
    """The memory plan of the target on the RPC device with `rules`, then what a run
    uses: the peak resident memory over a prefill of `prompt`, then chain and tree
    verifies and decodes to the end of the context (the graphs the plan measures at the
    full context), less the resident memory before the load, of this process (the host)
    and of the RPC server (the device). The load's own transient peak (each weight read
    from the file and staged for the transport as it is copied) is left out; prefill
    chunks of 64 rows keep small the server's staging of each activation it receives,
    which grows with the rows (a card's driver stages those in host memory)."""
    from dflash_gguf.runtime.devices import add_rpc_server
    from dflash_gguf.engine.memory import plan_memory
    from dflash_gguf.runtime.target import LOGITS_LAST, Target, TargetConfig

    add_rpc_server(endpoint)
    cfg = TargetConfig(n_ctx=n_ctx, n_ubatch=64, n_verify=17, kv_type="f16", n_threads=1, device="RPC0",
                       tensor_overrides=tuple(map(tuple, rules)), repack=False)
    plan = plan_memory(target_path, None, cfg).to_json()
    host0, device0 = resident(os.getpid()), resident(server_pid)
    with Target(target_path, cfg) as t:
        reset_peak(os.getpid())
        reset_peak(server_pid)
        t.prefill(prompt, LOGITS_LAST)
        parents = [-1] + [k // 2 for k in range(16)]
        while t.n_past + 40 <= n_ctx:
            t.verify(prompt[:17])
            t.commit(8)
            t.verify_tree(prompt[:17], parents)
            t.commit_path([0, 1, 3])
            t.decode(prompt[:1])
        info = t.info()
    return {"plan": plan, "host": peak(os.getpid()) - host0, "device": peak(server_pid) - device0, "info": info}
