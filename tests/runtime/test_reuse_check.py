"""DFLASH_CHECK_REUSE=1 (csrc/dfl_reuse_check.h): every graph the runtime keeps is, at each
later compute, the graph it was at its first, in every field ggml-cuda compares before
it replays a recorded CUDA graph (and does not compare when the scheduler's split ids are
those it recorded). On the CPU and on the RPC stand-in for a device, the demo pair in
every mode keeps its graphs unchanged: the CUDA-graph fault of the H100's run is not the
project changing a kept graph between steps."""
from __future__ import annotations

import pytest

from dflash_gguf.runtime.native import DflashError, check, lib

from helpers.target_workers import run_isolated

N_TOKENS = 40


@pytest.mark.parametrize("change,field", [(1, "data"), (2, "op_params"), (3, "src")])
def test_the_check_names_the_node_and_field_that_changed(change, field):
    check(lib.dfl_reuse_check_probe(0))  # the same graph again: nothing to say
    with pytest.raises(DflashError, match=rf"DFLASH_CHECK_REUSE: a kept graph .* changed since its first compute: "
                                          rf"node \d+ .* differs in {field}"):
        check(lib.dfl_reuse_check_probe(change))


@pytest.mark.parametrize("device", ["CPU", "RPC0"])
def test_kept_graphs_stay_unchanged_in_every_mode(device, monkeypatch, request):
    endpoint = request.getfixturevalue("rpc_endpoint") if device == "RPC0" else None
    want = run_isolated("reuse_workers:demo_modes", endpoint, N_TOKENS)
    monkeypatch.setenv("DFLASH_CHECK_REUSE", "1")
    got = run_isolated("reuse_workers:demo_modes", endpoint, N_TOKENS)
    for mode, res in got.items():
        assert res["tokens"] == want[mode]["tokens"], mode
        assert len(res["tokens"]) == N_TOKENS
        # kept graphs were computed again (and checked): the target's, the drafter's when it ran
        for computed, built in res["graphs"]:
            assert computed == 1 or computed > built, (mode, res["graphs"])
    assert sum(c - b for res in got.values() for c, b in res["graphs"]) > 2 * N_TOKENS
