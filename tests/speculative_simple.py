"""llama.cpp's llama-speculative-simple as an oracle of drafted and accepted counts: its
run (greedy, on the same GGUFs) and the same loop on our runtime, for every drafter kind
(test_mtp, test_eagle3, test_dspark, test_draft_simple)."""
from __future__ import annotations

from typing import Callable, List, Optional

# runs of llama-speculative-simple until one logs its summary (each takes a fraction of a
# second on the tests' tiny models)
ATTEMPTS = 20


def llama_speculative_simple(model: str, text: str, n_predict: int, spec_type: str, n_max: int, *,
                             draft: Optional[str] = None, p_min: float = 0.0, n_ctx: int = 512) -> dict:
    """llama-speculative-simple --spec-type `spec_type`, greedy, n-min 0, one thread: its
    counts (bench.llama_cpp.parse_speculative). A missing tool is a missing oracle."""
    from dflash_gguf import llama_cpp_tree
    from dflash_gguf.bench.llama_cpp import parse_speculative, run_parsed
    from fixtures import missing_oracle

    exe = llama_cpp_tree.tool("llama-speculative-simple")
    if exe is None:
        missing_oracle("llama-speculative-simple is not built (.venv/bin/python scripts/llama_cpp_build.py "
                       "llama-speculative-simple)")
    cmd = [str(exe), "-m", str(model), *(["-md", str(draft)] if draft else []), "-c", str(n_ctx),
           "-n", str(n_predict), "-t", "1", "-tb", "1", "--temp", "0", "--spec-type", spec_type,
           "--spec-draft-n-max", str(n_max), "--spec-draft-n-min", "0", "--spec-draft-p-min", str(p_min),
           "-p", text]
    # llama.cpp's logger is a thread its exit does not wait for (common/log.cpp leaks it on
    # purpose): on a loaded machine most runs lose the summary, so a run is tried often
    _, r = run_parsed(cmd, parse_speculative, "rounds", attempts=ATTEMPTS)
    return r


def speculative_simple_loop(target, draft_step: Callable[[int, List[int], int], List[int]], tokens: List[int],
                            n_predict: int, n_ctx: int, eog) -> dict:
    """llama-speculative-simple's loop on our target, whose context holds the prompt but
    its last token: every step drafts after the last token (draft_step(last, pending,
    room): `pending` the tokens committed since its last call, `room` what the context
    and n_predict leave, 0 for no limit, as llama.cpp passes it), verifies the drafts
    with it and keeps the accepted; the loop ends past n_predict tokens or at an
    end-of-generation token. Its counts."""
    last, n_past, pending = tokens[-1], len(tokens) - 1, []
    counts = {"n_drafted": 0, "n_accept": 0, "n_predict": 0}
    while True:
        room = max(0, min(n_ctx - n_past - 2, n_predict - counts["n_predict"] - 1))
        drafts = draft_step(last, pending, room)
        drafts = drafts[:room] if room > 0 else drafts
        block = [last] + drafts
        target.verify(block)
        choice = target.choices(0, len(block))
        n_acc = 0
        while n_acc < len(drafts) and drafts[n_acc] == int(choice[n_acc]):
            n_acc += 1
        ids = drafts[:n_acc] + [int(choice[n_acc])]
        target.commit(n_acc + 1)
        pending = block[:n_acc + 1]
        counts["n_drafted"] += len(drafts)
        counts["n_accept"] += n_acc
        counts["n_predict"] += len(ids)
        n_past += len(ids)
        last = ids[-1]
        if counts["n_predict"] > n_predict or any(t in eog for t in ids):
            return counts
