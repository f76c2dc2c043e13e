"""Device placement and results on a device other than the CPU.

The device under test is chosen with DFLASH_TEST_DEVICE (or pytest --device-under-test):
by default `RPC`, a ggml RPC server serving the CPU backend (tests/helpers/rpc_server.py) — its
memory is not host memory, so every tensor crossing between devices really is copied,
but it runs the CPU's kernels. `Vulkan0` (scripts/test-vulkan.sh, Mesa's lavapipe) runs
ggml's Vulkan shaders under a GPU API's rules; CUDA0 (scripts/cuda/test.sh) or Metal work
the same way. The tests marked `device` are the ones scripts/test-vulkan.sh runs.

Every model here is a bundled demo pair (shipped, or converted again from its HF copy by
our converter): this module needs neither torch nor transformers, which the lent GPU
machine lacks."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np
import pytest
from gguf import GGUFReader

from helpers.paths import TESTS
from helpers.rpc_local import local_rpc_server
from helpers.target_workers import run_isolated

from dflash_gguf.convert.shape_model import write_header_only
from dflash_gguf.convert.shapes import QWEN35_0_8B
from dflash_gguf.runtime.demo import DATA, demo_paths
from dflash_gguf.speculation.drafting import DEFAULT_DRAFT_P_MIN

DEMO_HF = TESTS / "data" / "demo-hf"
DFLASH_RUN = str(Path(sys.executable).with_name("dflash-run"))


def run(*args):
    """dflash-run of the installation running the tests."""
    return subprocess.run([DFLASH_RUN, *args], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONUNBUFFERED": "1"})


@dataclass
class Device:
    name: str                # ggml device name, e.g. RPC0, Vulkan0
    rpc: Optional[str]       # host:port of the RPC server providing it, if any

    def cli(self) -> list:
        return ["--rpc", self.rpc] if self.rpc else []

    @property
    def logit_tol(self) -> float:
        """How far f32 logits (f32 weights and caches) may be from the CPU's. The RPC
        stand-in runs the CPU's kernels: only the split between devices can differ, ~1e-5.
        ggml's Vulkan flash attention holds Q and K in f16 on devices with f16 arithmetic
        (lavapipe has it), whatever the cache type: on lavapipe ~2e-3 on the demo pair's
        logits, 1.3e-2 on the random tiny pair's (measured)."""
        return 2e-4 if self.rpc else 3e-2


@pytest.fixture(scope="module")
def device(request):
    name = request.config.getoption("--device-under-test") or os.environ.get("DFLASH_TEST_DEVICE") or "RPC"
    if name != "RPC":
        yield Device(name, None)
        return
    for endpoint in local_rpc_server():
        yield Device("RPC0", endpoint)


@pytest.fixture(scope="module")
def demo_pairs(convert_model):
    """The bundled pairs as shipped (q8_0): "demo", the demo target with its drafter,
    "weak", with the weak drafter (chain AL ~2, dflash_gguf/data/README.md), "mtp", with
    its own MTP layer, and "eagle3", with its EAGLE3 head; and the demo pair converted again from its checkpoints, "f32" and
    "f16"."""
    target, draft = demo_paths()
    pairs = {"demo": (target, draft), "weak": (target, str(DATA / "demo-draft-weak.gguf")), "mtp": (target, target),
             "eagle3": (target, str(DATA / "demo-eagle3.gguf"))}
    for outtype in ("f32", "f16"):
        target = convert_model(DEMO_HF / "target", outtype)
        draft = convert_model(DEMO_HF / "draft", outtype, "--target-model-dir", str(DEMO_HF / "target"))
        pairs[outtype] = (str(target), str(draft))
    return pairs


# Tokens each offload placement generates (plain, chain, tree): several verify steps and
# commits with the demo drafter, which accepts 3-5 tokens per step.
OFFLOAD_TOKENS = 24


@pytest.mark.device
def test_partial_offload_matches_the_cpu(demo_pairs, device):
    """Every -ngl split between the CPU and the device: none of the layers, some, all
    layers but the LM head, everything — the last with its weights in 8 MiB buffers
    (the largest tensors, the f32 token embedding and LM head, are 4 MiB), as a device
    that caps single allocations (Vulkan, Metal) makes them. The logits
    stay within the device's tolerance of the CPU's; speculation on each split equals
    that split's own plain greedy decoding (the lossless property: greedy tokens
    themselves may part from the CPU's at a near tie, as the logits may differ)."""
    placements = [{"device": "CPU", "n_gpu_layers": -1}] + [
        {"device": device.name, "n_gpu_layers": n} for n in (0, 2, 4)] + [
        {"device": device.name, "n_gpu_layers": -1, "weight_buffer_mib": 8}]
    target, draft = demo_pairs["f32"]
    res = run_isolated("offload_trace", device.rpc, target, draft, placements, OFFLOAD_TOKENS, timeout=3600)
    assert any(d["name"] == device.name and d["type"] in ("gpu", "igpu") for d in res["devices"]), res["devices"]
    cpu, *offloaded = res["runs"]
    assert cpu["info"]["n_gpu_layers"] == 0
    assert [r["info"]["n_gpu_layers"] for r in offloaded] == [0, 2, 4, 4]
    assert offloaded[-1]["info"]["n_weight_buffers"] >= 3, offloaded[-1]["info"]
    assert cpu["plain"] == cpu["chain"] == cpu["tree"]
    for place, r in zip(placements[1:], offloaded):
        assert r["info"]["device"] == device.name
        for stage, (a, b) in enumerate(zip(r["logits"], cpu["logits"])):
            err = np.abs(np.asarray(a) - np.asarray(b)).max()
            assert err < device.logit_tol, f"{place}, stage {stage}: logits differ by {err}"
        assert r["chain"] == r["plain"] and r["tree"] == r["plain"], f"{place}: speculation is not lossless"
        if device.rpc:  # the CPU's own kernels: the very same tokens
            assert r["plain"] == cpu["plain"], place


@pytest.mark.device
def test_cli_offload_and_device_list(demo_pairs, device):
    listed = run(*device.cli(), "--list-devices")
    assert listed.returncode == 0 and device.name in listed.stdout and "CPU" in listed.stdout
    target, draft = demo_pairs["f32"]
    base = ["-m", target, "-md", draft, "-p", "def f(x):", "-n", "24",
            "--tree-budget", "6"]
    cpu = run(*base, "--device", "CPU")
    split = run(*base, *device.cli(), "--device", device.name, "-ngl", "2")
    assert cpu.returncode == 0 and split.returncode == 0, split.stderr
    assert split.stdout == cpu.stdout


def test_unreachable_rpc_server_is_a_clear_error():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens once the socket closes
    res = run("--rpc", f"127.0.0.1:{port}", "--list-devices")
    assert res.returncode == 1 and "cannot connect to a ggml RPC server" in res.stderr
    res = run("--rpc", "no-port-here", "--list-devices")
    assert res.returncode == 1 and "host:port" in res.stderr


# ---- the demo pair on the device --------------------------------------------------------

# A short and a long prompt; 24 new tokens take several verify steps and commits even
# with the trained demo drafter.
DEMO_PROMPTS = [[(37 * i + 11 * k) % 4000 for i in range(n)] for k, n in enumerate((9, 40))]
N_NEW, BUDGET = 24, 8


@pytest.mark.device
@pytest.mark.parametrize("outtype", ["f32", "f16"])
def test_demo_pair_greedy_equals_the_cpu(demo_pairs, device, outtype):
    target, draft = demo_pairs[outtype]
    res = run_isolated("greedy_on_devices", device.rpc, target, draft, ["CPU", device.name], DEMO_PROMPTS, N_NEW,
                       BUDGET, timeout=1800)
    for k, (cpu, dev) in enumerate(zip(res["CPU"], res[device.name])):
        assert cpu["plain"] == cpu["chain"] == cpu["cut"] == cpu["tree"], f"prompt {k}: CPU speculation is not lossless"
        assert dev["plain"] == cpu["plain"], f"prompt {k}: plain greedy differs from the CPU's"
        assert dev["chain"] == cpu["chain"], f"prompt {k}: chain differs from the CPU's"
        assert dev["cut"] == cpu["cut"], f"prompt {k}: the chain cut by p-min differs from the CPU's"
        assert dev["tree"] == cpu["tree"], f"prompt {k}: tree differs from the CPU's"
        # the device holds every layer: a verify costs about the same for any block, no cut
        assert (cpu["default_p_min"], dev["default_p_min"]) == (DEFAULT_DRAFT_P_MIN, 0.0)
    # ... so an engine's chain drafter there ranks nothing; on the CPU it ranks its top choice
    assert (res["CPU chain top_k"], res[f"{device.name} chain top_k"]) == (1, 0)


@pytest.mark.device
@pytest.mark.parametrize("drafter", ["demo", "weak", "mtp", "eagle3"])
def test_bundled_pairs_are_lossless_on_the_device(demo_pairs, device, drafter):
    """The shipped pairs (q8_0; the weak drafter's short accepted runs make more verify
    steps and commits): the CPU quantizes activations to q8_0 before its integer dot
    products, Vulkan without integer dot products (lavapipe) multiplies the dequantized
    weights with f32 activations. Logits differ by the activation rounding, so greedy
    text may part from the CPU's where the top two logits are that close; on the device
    chain and tree must still equal the device's own plain greedy decoding."""
    target, draft = demo_pairs[drafter]
    res = run_isolated("greedy_on_devices", device.rpc, target, draft, ["CPU", device.name], DEMO_PROMPTS, N_NEW,
                       BUDGET, timeout=1800)
    for k, (cpu, dev) in enumerate(zip(res["CPU"], res[device.name])):
        assert dev["plain"] == dev["chain"] == dev["cut"] == dev["tree"], \
            f"prompt {k}: speculation on the device is not lossless"
        err = np.abs(np.asarray(dev["logits"]) - np.asarray(cpu["logits"])).max()
        # lavapipe: 0.098 at most (measured), with f16 Q and K in its flash attention too
        assert err < 0.15, f"prompt {k}: q8_0 logits differ from the CPU's by {err}"
        if dev["plain"] != cpu["plain"]:
            i = next(j for j, (a, b) in enumerate(zip(dev["plain"], cpu["plain"])) if a != b)
            gap = run_isolated("top2_gap_after", device.rpc, target, "CPU", DEMO_PROMPTS[k] + cpu["plain"][:i])
            print(f"prompt {k}: q8_0 greedy parts from the CPU's at token {i}, CPU top-2 gap {gap:.4f}")
            assert gap < 2 * err, f"prompt {k}: parts at token {i} where the CPU's top two logits are {gap} apart"


@pytest.mark.device
def test_engine_plain_decoding_equals_the_cpu(device):
    """Plain greedy decoding as dflash-run runs it (the Engine's defaults: f16 caches, one
    graph kept and computed again each step) over many steps, on the device against the
    CPU. On an H100 this parted at the third step while ggml's CUDA graphs replayed the
    kept decode graph (scripts/cuda/plain_check.py, 2026-11-25), where the CPU's top two
    logits are 0.53 apart: not a rounding difference. As in the lossless test above, a
    parting is allowed only where the CPU's top two logits are closer than the q8_0
    activation rounding can move them."""
    target, _ = demo_paths()
    prompt = "def read_lines(path, encoding='utf-8'):\n    \"\"\"Return the lines of a text file.\"\"\"\n"
    res = run_isolated("engine_plain_greedy", device.rpc, target, ["CPU", device.name], prompt, 96, timeout=600)
    cpu, dev = res["CPU"]["tokens"], res[device.name]["tokens"]
    assert len(cpu) == len(dev) == 96
    if dev != cpu:
        i = next(j for j, (a, b) in enumerate(zip(dev, cpu)) if a != b)
        gap = run_isolated("top2_gap_after", device.rpc, target, "CPU", res["CPU"]["prompt"] + cpu[:i])
        assert gap < 0.3, f"plain greedy parts from the CPU's at step {i}, where the CPU's top two logits are {gap} apart"


@pytest.mark.device
def test_chain_and_tree_equal_plain_on_the_device_at_the_engines_defaults(device):
    """Lossless on the device as dflash-run runs it (f16 caches, graphs as shipped), 96
    steps: chain and tree equal the device's own plain greedy decoding token for token.
    Holds where the device's kernels are batch-invariant (docs/exactness.md says which);
    stock CUDA's MMVQ (1-8 columns) and MMQ (9 and more) round apart, so there this is the
    check the verify kernel of ggml-patches/0004 must pass. On Vulkan it holds through
    ggml-patches/0003 (stock ggml-vulkan's f16 product rounds 9+ columns otherwise than
    fewer, and the tree parted from plain decoding at step 20, 2026-11-27)."""
    target, draft = demo_paths()
    prompt = "def read_lines(path, encoding='utf-8'):\n    \"\"\"Return the lines of a text file.\"\"\"\n"
    res = run_isolated("engine_modes_greedy", device.rpc, target, draft, device.name, prompt, 96, timeout=900)
    assert len(res["plain"]) == 96
    assert res["chain"] == res["plain"], "chain greedy differs from plain greedy on the device"
    assert res["tree"] == res["plain"], "tree greedy differs from plain greedy on the device"


@pytest.mark.device
@pytest.mark.parametrize("pair", ["f32", "mtp"])
def test_demo_pair_sampling_on_the_device(demo_pairs, device, pair):
    """Sampling runs in the graphs, so on a device it runs there; with the same seed the
    device draws what the CPU draws where their kernels are the same (the RPC stand-in
    runs the CPU's): every mode, with top-k and a penalty, and with no truncation, with
    the DFlash drafter and with the target's own MTP layer. On another device its logits
    differ in the last bits, and a draw may fall the other side of a boundary: there only
    the lengths are checked and the agreement printed."""
    target, draft = demo_pairs[pair]
    res = run_isolated("sampled_on_devices", device.rpc, target, draft, ["CPU", device.name], DEMO_PROMPTS, N_NEW,
                       BUDGET, timeout=1800)
    same = total = 0
    for k, (cpu, dev) in enumerate(zip(res["CPU"], res[device.name])):
        for mode in ("plain", "chain", "reject", "tree"):
            assert len(dev[mode]) == N_NEW, (k, mode)
            total += 1
            same += dev[mode] == cpu[mode]
            if device.rpc:
                assert dev[mode] == cpu[mode], f"run {k} ({cpu['setting']}): sampled {mode} differs from the CPU's"
    print(f"{device.name}: {same} of {total} sampled continuations equal the CPU's")


@pytest.mark.device
def test_grammar_masks_on_the_device(demo_pairs, device):
    """A grammar's masks on the device: sampled (exception lists, and the dense path), its
    logits -inf exactly where disallowed and as they were elsewhere; greedy (looked up at
    the rows' largest logits), its choices the masked argmax, and the CPU's where the
    kernels are the same (the RPC stand-in)."""
    target, _ = demo_pairs["f32"]
    res = run_isolated("masked_on_devices", device.rpc, target, ["CPU", device.name], DEMO_PROMPTS[1],
                       timeout=600)
    for dev, kinds in res.items():
        for kind, r in kinds.items():
            assert r["exact"], f"{dev}: the {kind} masks are not exact"
    if device.rpc:
        assert res[device.name] == res["CPU"]


# ---- placement: every node on the device -----------------------------------------------

# What may stay on the host: the token embedding lookup (the table lives on the CPU, as
# in llama.cpp), nothing else.
HOST_ALLOWED = {"GET_ROWS(token_embd.weight)"}


@pytest.mark.device
def test_every_node_of_every_graph_runs_on_the_device(demo_pairs, device):
    target, draft = demo_pairs["f16"]
    res = run_isolated("placement_trace", device.rpc, target, draft, device.name)
    for graph, p in res.items():
        print(f"{device.name} {graph}: {p['n_nodes']} nodes, {p['n_splits']} splits, "
              f"on the host: {', '.join(p['host_nodes']) or 'none'}")
    for graph, p in res.items():
        assert set(p["host_nodes"]) <= HOST_ALLOWED, f"{graph}: {p['host_nodes']} ran on the CPU"


@pytest.mark.device
def test_a_0_8b_shape_model_loads_and_runs_on_the_device(tmp_path, device):
    """Qwen3.5-0.8B's shapes (weights all zero): its LM head, tied to the token embedding
    as in the published model (248320 x 1024, 258 MiB in q8_0), is larger than one Vulkan
    storage buffer on lavapipe (128 MiB): the device multiplies it in row slices and the
    token lookup gathers from a host copy."""
    path = write_header_only(tmp_path / "qwen35-0.8b-q8_0.gguf", QWEN35_0_8B, "q8_0")
    res = run_isolated("shape_model_steps", device.rpc, str(path), device.name, timeout=1800)
    assert res["info"]["device"] == device.name and res["finite"]
    # The memory plan counts the host copy the lookup gathers from (none when the device
    # takes the embedding whole and gathers from it there).
    embd = next(int(w.n_bytes) for w in GGUFReader(path).tensors if w.name == "token_embd.weight")
    on_device, host = res["plan"]["devices"]
    assert on_device["name"] == device.name and host["name"] == "CPU"
    if "GET_ROWS(token_embd.weight)" in res["prefill"]["host_nodes"]:
        assert embd <= host["target_weights"] < embd + (1 << 20), (embd, host)
    else:
        assert host["target_weights"] == 0, host
    for graph in ("prefill", "verify", "decode"):
        p = res[graph]
        print(f"{device.name} 0.8B {graph}: {p['n_nodes']} nodes, {p['n_splits']} splits, "
              f"on the host: {', '.join(p['host_nodes']) or 'none'}")
        assert set(p["host_nodes"]) <= HOST_ALLOWED, f"{graph}: {p['host_nodes']} ran on the CPU"
