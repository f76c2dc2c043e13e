"""Routed experts in host memory beside a device (issue 39): weights placed by name with
llama.cpp's -ot/--override-tensor, --cpu-moe and --n-cpu-moe, on the ggml RPC stand-in
for a GPU (tests/helpers/rpc_server.py), with every layer on the device and the experts on the
CPU. Oracles: the all-CPU run of the same file (text equal, logits within float noise),
llama.cpp's own expert pattern (common/common.h), the process memory the load and run
really take against the planner's host and device figures."""
from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from helpers.draft_fixtures import make_dflash
from helpers.fixtures import make_qwen35moe, missing_oracle
from helpers.gemma4_fixtures import GEMMA4_SHAPES, make_gemma4, make_gemma_drafter
from helpers.paths import HELPERS, ROOT
from helpers.target_workers import run_isolated

from dflash_gguf.runtime import placement
from dflash_gguf.convert.shape_model import write_header_only, write_model
from dflash_gguf.convert.shapes import QWEN35_35B_A3B, shrunk, tensor_nbytes, tensor_table
from dflash_gguf.tools.llama_cpp_tree import source_dir

BIN = Path(sys.executable).parent
N_NEW = 24


def run_cli(tool: str, *args):
    return subprocess.run([str(BIN / tool), *args], capture_output=True, text=True, timeout=300,
                          stdin=subprocess.DEVNULL)


@pytest.fixture(scope="module", params=["qwen35moe", "gemma4"])
def pair(request, tmp_path_factory, convert_model):
    """A tiny MoE target (Qwen3.5 MoE: 8 experts, 4 used, a shared expert; Gemma 4:
    8 experts, 2 used, beside its dense FFN) of 4 and 6 layers, with a drafter."""
    root = tmp_path_factory.mktemp(f"moe-{request.param}")
    if request.param == "qwen35moe":
        target = make_qwen35moe(root / "target")
        draft = make_dflash(root / "draft", target, target_layer_ids=(0, 2), block_size=8, seed=4)
        layers, vocab = 4, 1000
    else:
        target = make_gemma4(root / "target", **GEMMA4_SHAPES["moe"])
        draft = make_gemma_drafter(root / "draft", target)
        layers, vocab = 6, 1000
    return {"arch": request.param, "layers": layers,
            "prompt": [int(x) for x in np.random.default_rng(3).integers(300, vocab, size=29)],
            "target": str(convert_model(target, "f32")),
            "draft": str(convert_model(draft, "f32", "--target-model-dir", str(target)))}


def test_experts_on_the_cpu_beside_the_device_give_the_cpu_text(pair, rpc_endpoint):
    """Every layer on the device, every layer's routed experts on the CPU, by
    --n-cpu-moe's rules and by an -ot pattern: plain, chain and tree text equal the
    all-CPU run's; the expert products run on the CPU (their weights' backend) and only
    activations cross: a verify copies far less than one layer's experts weigh, and
    more for more rows."""
    placements = [{"device": "CPU", "rules": []},
                  {"device": "RPC0", "rules": placement.expert_rules(pair["layers"])},
                  {"device": "RPC0", "rules": placement.parse_rules(r"exps\.=CPU")}]
    res = run_isolated("moe_workers:placed_runs", rpc_endpoint, pair["target"], pair["draft"], placements,
                       pair["prompt"], N_NEW, timeout=900)
    cpu, *placed = res["runs"]
    assert cpu["plain"] == cpu["chain"] == cpu["tree"] and cpu["info"]["host_layer_weights"] == 0
    for r, place in zip(placed, placements[1:]):
        assert (r["plain"], r["chain"], r["tree"]) == (cpu["plain"], cpu["chain"], cpu["tree"]), place
        err = np.abs(np.asarray(r["tree_logits"]) - np.asarray(cpu["tree_logits"])).max()
        assert err < 1e-4, f"{place}: tree logits differ by {err}"
        experts = r["info"]["host_layer_weights"]
        assert experts > 0 and r["p_min"] > 0  # a verify there computes on the CPU: the chain is cut
        v4, v8 = r["verify"]["4"], r["verify"]["8"]
        assert any(n.startswith("MUL_MAT_ID(blk.0.ffn_") and "exps" in n for n in v4["host_nodes"]), v4
        assert v4["n_splits"] >= 2 * pair["layers"]  # to the CPU and back in every layer
        assert 0 < v4["copy_bytes"] < v8["copy_bytes"] < experts / pair["layers"] / 4, (v4, v8, experts)


@pytest.mark.parametrize("pair", ["qwen35moe"], indirect=True)
def test_cli_server_and_api_take_the_placement(pair, rpc_endpoint):
    """dflash-run: --n-cpu-moe on the device (and the drafter's FFN on the CPU, -otd)
    gives the CPU's text and says what crossed per step (--json); dflash-server plans
    with the same flags; the Engine takes them as keywords."""
    base = ["-m", pair["target"], "-md", pair["draft"], "-p", "def f(x):", "-n", "16", "--tree-budget", "6", "-t", "1"]
    cpu = run_cli("dflash-run", *base, "--device", "CPU")
    moe = run_cli("dflash-run", *base, "--rpc", rpc_endpoint, "--device", "RPC0", "--n-cpu-moe", "4",
                  "-otd", "ffn_(gate|up|down)=CPU", "--json")
    assert cpu.returncode == 0 and moe.returncode == 0, moe.stderr
    assert moe.stdout == cpu.stdout
    stats = json.loads(moe.stderr.strip().splitlines()[-1])
    assert stats["graph_splits"] >= 8 and stats["copy_bytes_per_step"] > 0
    served = run_cli("dflash-server", "-m", pair["target"], "-md", pair["draft"], "--rpc", rpc_endpoint,
                     "-ot", "blk\\.[01]\\.ffn_.*_exps=CPU", "--cpu-moe", "--print-memory", "--json")
    assert served.returncode == 0, served.stderr
    on_device, host = json.loads(served.stdout)["devices"]
    assert host["weight_groups"]["target_experts"] > 0 and on_device["weight_groups"]["target_experts"] == 0
    api = run_isolated("moe_workers:engine_run", rpc_endpoint, pair["target"], pair["draft"],
                       {"device": "RPC0", "cpu_moe": True, "tree_budget": 6, "n_threads": 1}, pair["prompt"], N_NEW,
                       timeout=600)
    plain = run_isolated("moe_workers:engine_run", rpc_endpoint, pair["target"], pair["draft"],
                         {"device": "CPU", "n_threads": 1}, pair["prompt"], N_NEW, timeout=600)
    assert api["tokens"] == plain["tokens"] and api["info"]["host_layer_weights"] > 0
    assert api["graph_splits"] >= 8 and api["copy_bytes_per_step"] > 0


@pytest.mark.parametrize("flags,message", [
    (["-ot", "exps(=CPU"], "is not a regular expression"),
    (["-ot", "exps=GPU7"], "unknown device 'GPU7'"),
    (["-ot", "exps"], "is not PATTERN=DEVICE"),
    (["-otd", "ffn=NPU"], "unknown device 'NPU'"),
])
def test_bad_patterns_and_devices_exit_2_with_one_line(flags, message):
    from dflash_gguf.runtime.demo import demo_paths

    target, draft = demo_paths()
    res = run_cli("dflash-run", "-m", str(target), "-md", str(draft), "-p", "x", "-n", "2", *flags)
    assert res.returncode == 2
    assert message in res.stderr and len(res.stderr.strip().splitlines()) == 1, res.stderr
    res = run_cli("dflash-run", "-m", str(target), "-p", "x", "--n-cpu-moe", "-2")
    assert res.returncode == 2 and "--n-cpu-moe takes a number of layers >= 0" in res.stderr


def test_a_device_the_model_does_not_use_is_refused(rpc_endpoint):
    from dflash_gguf.runtime.demo import demo_paths

    res = run_cli("dflash-run", "-m", str(demo_paths()[0]), "-p", "x", "--rpc", rpc_endpoint, "--device", "CPU",
                  "-ot", "ffn=RPC0")
    assert res.returncode == 2 and "the model runs on CPU, not RPC0" in res.stderr


def test_the_expert_pattern_is_llama_cpps():
    """--cpu-moe and --n-cpu-moe stand for llama.cpp's rules: its LLM_FFN_EXPS_REGEX
    (common/common.h), and "blk\\.N" before it for each of the first N layers."""
    src = source_dir()
    if src is None:
        missing_oracle("llama.cpp's sources (scripts/setup.sh test fetches them)")
    header = (src / "common" / "common.h").read_text()
    theirs = re.search(r'LLM_FFN_EXPS_REGEX\s*=\s*"((?:[^"\\]|\\.)*)"', header).group(1)
    assert theirs.encode().decode("unicode_escape") == placement.EXPERTS
    assert placement.expert_rules(2) == ((r"blk\.0" + placement.EXPERTS, "CPU"), (r"blk\.1" + placement.EXPERTS, "CPU"))
    names = ["blk.1.ffn_gate_exps.weight", "blk.11.ffn_up_exps.weight", "blk.1.ffn_gate_up_exps.weight",
             "blk.1.ffn_down_exps.scale", "blk.1.ffn_gate_shexp.weight", "blk.1.ffn_gate_inp.weight"]
    rule = placement.expert_rules(2)[1][0]
    assert [n for n in names if re.search(rule, n)] == [names[0], names[2], names[3]]


# ---- the memory planner against what a load takes ------------------------------------------------

# a Qwen3.5-35B-A3B layer's attention and recurrent shapes at 4 layers, 16 experts of which 2
# are used, small recurrent states (so that the verify graphs' compute stays small beside the
# weights) and a wide shared expert: ~116 MiB of routed experts, ~88 MiB of other weights
MEASURED = shrunk(QWEN35_35B_A3B, 4, vocab=4096, experts=16, experts_used=2, lin_k_heads=2, lin_v_heads=4,
                  lin_dim=64, shared_ffn=4096)


def _rpc_server(env):
    """A fresh RPC server (nothing allocated or freed in it yet): (endpoint, process)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen([sys.executable, str(HELPERS / "rpc_server.py"), f"127.0.0.1:{port}"], env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 30
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return f"127.0.0.1:{port}", server
        except OSError:
            if server.poll() is not None or time.time() > deadline:
                server.kill()
                pytest.fail("the ggml RPC test server did not start")
            time.sleep(0.2)


def test_planned_host_and_device_memory_is_what_a_run_takes(tmp_path, monkeypatch):
    """A shape model on the RPC device, all of it there, then with its routed experts in
    host memory (and the token embedding on the device, so that the host holds only
    what is read whole): the peak memory a run takes in this process (the host) and in
    the RPC server (the device), less what they held before the load. What the placement
    moves (the experts and the compute that follows them) is what the planner says
    within 5% on each side, and the plan covers the device's whole peak within 5%.
    glibc keeps freed blocks of up to 32 MiB for reuse after one such block is freed,
    which would keep the transport's staging copies of the weights resident:
    MALLOC_MMAP_THRESHOLD_ returns every block over 64 KiB to the system when freed."""
    path = write_model(MEASURED, "q4_k_m", tmp_path / "moe.gguf", progress=False)
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")
    prompt = [(13 * i + 5) % 4000 + 10 for i in range(448)]
    runs = {}
    for name, rules in (("device", [["token_embd", "RPC0"]]),
                        ("experts on the host", [*placement.expert_rules(cpu_moe=True), ["token_embd", "RPC0"]])):
        endpoint, server = _rpc_server(dict(os.environ))
        try:
            runs[name] = run_isolated("moe_workers:measured_memory", endpoint, server.pid, str(path), rules, 512,
                                      prompt, timeout=900)
        finally:
            server.kill()
            server.wait()
    a, b = runs["device"], runs["experts on the host"]
    (a_dev, a_host), (b_dev, b_host) = ([d["need"] for d in r["plan"]["devices"]] for r in (a, b))
    print(f"planned device {a_dev >> 20} -> {b_dev >> 20} MiB, host {a_host >> 20} -> {b_host >> 20} MiB; "
          f"measured device {a['device'] >> 20} -> {b['device'] >> 20} MiB, host {a['host'] >> 20} -> "
          f"{b['host'] >> 20} MiB")
    assert b["plan"]["devices"][1]["weight_groups"]["target_experts"] > 100 << 20
    moved_host, moved_device = b_host - a_host, a_dev - b_dev
    assert abs((b["host"] - a["host"]) - moved_host) <= 0.05 * moved_host
    assert abs((a["device"] - b["device"]) - moved_device) <= 0.05 * moved_device
    assert a["device"] <= 1.05 * a_dev and b["device"] <= 1.05 * b_dev


# ---- the planner's advice ---------------------------------------------------------------------------

def test_a_plan_over_the_device_names_the_smallest_n_cpu_moe(tmp_path, rpc_endpoint):
    """Qwen3.5-35B-A3B Q4_K_M (weightless) on the device with a limit it does not fit:
    --print-memory shows where each weight group lives and names the smallest
    --n-cpu-moe that fits, which a plan of one layer fewer does not."""
    path = str(write_header_only(tmp_path / "a3b.gguf", QWEN35_35B_A3B, "q4_k_m"))
    base = ["-m", path, "--rpc", rpc_endpoint, "--device", "RPC0", "-c", "32768", "--memory-limit", "6000"]
    res = run_cli("dflash-run", *base, "--print-memory", "--json")
    assert res.returncode == 2, res.stderr
    out = json.loads(res.stdout)
    hint = next(h for h in out["would_fit"] if h.startswith("--n-cpu-moe"))
    n = int(hint.split()[1])
    assert 0 < n < QWEN35_35B_A3B["layers"]
    fits = run_cli("dflash-run", *base, "--n-cpu-moe", str(n), "--print-memory", "--json")
    short = run_cli("dflash-run", *base, "--n-cpu-moe", str(n - 1), "--print-memory", "--json")
    assert fits.returncode == 0 and short.returncode == 2, fits.stdout
    device, host = json.loads(fits.stdout)["devices"]
    first_n = sum(tensor_nbytes(shape, qtype) for name, shape, qtype in tensor_table(QWEN35_35B_A3B, "q4_k_m")
                  if "_exps" in name and int(name.split(".")[1]) < n)
    assert host["weight_groups"]["target_experts"] == first_n
    assert host["need"] > 6000 << 20 > device["need"]  # the limit is the device's
    text = run_cli("dflash-run", *base, "--n-cpu-moe", str(n), "--print-memory").stdout
    assert re.search(r"  routed experts\s+[\d.]+ MiB\s+[\d.]+ MiB", text), text


# ---- the benchmark -----------------------------------------------------------------------------

BENCH = ROOT / "experiments" / "moe_offload_bench.py"


def test_benchmark_smoke_runs_and_counts_only_activations(tmp_path):
    """experiments/moe_offload_bench.py --smoke (timed, one repetition) and --bytes --smoke:
    every verify of k rows and every decode copies, per layer and row, exactly what the
    experts' products read and give back: the rows [hidden] f32 and their chosen
    experts [used] i32 to the CPU, each chosen expert's output [hidden] f32 back."""
    timed = subprocess.run([sys.executable, str(BENCH), "--smoke", "-t", "1", "--out", str(tmp_path / "t.json")],
                           capture_output=True, text=True, timeout=300)
    assert timed.returncode == 0, timed.stderr
    result = json.loads((tmp_path / "t.json").read_text())
    assert result["header"]["smoke"] and result["host_layer_weights"] > 0
    assert [r["k"] for r in result["rows"]] == [4, 8, 16]
    for r in result["rows"]:
        assert r["graph_builds_timed"] == 0 and r["verify_ms"] > 0 and r["decodes_ms"] > 0
        assert r["verify_copy_bytes"] == r["decodes_copy_bytes"] > 0  # k rows at once or one by one: the same rows

    counted = subprocess.run([sys.executable, str(BENCH), "--bytes", "--smoke", "-t", "1", "--out",
                              str(tmp_path / "b.json")], capture_output=True, text=True, timeout=300)
    assert counted.returncode == 0, counted.stderr
    fit = json.loads((tmp_path / "b.json").read_text())["fit"]
    hidden, used = 256, 2  # the smoke shape's
    per_row = 4 * hidden + 4 * used + 4 * hidden * used
    for key, rows in (("4", 4), ("8", 8), ("16", 16), ("1 (decode)", 1)):
        assert fit[key]["copy_bytes"]["per_layer"] == rows * per_row, (key, fit[key])
        assert fit[key]["splits"]["per_layer"] == 2  # to the CPU and back
