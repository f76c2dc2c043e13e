"""Device placement: partial offload (-ngl) splits the target between the CPU and a
second device. This machine has no GPU, so the second device is a ggml RPC server
serving the CPU backend (tests/rpc_server.py): its memory is not host memory and every
tensor crossing between layers on different devices really is copied."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from target_workers import run_isolated
from test_cli import run
from test_speculative import pair  # noqa: F401 (fixture)

HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def rpc_endpoint():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    endpoint = f"127.0.0.1:{port}"
    server = subprocess.Popen([sys.executable, str(HERE / "rpc_server.py"), endpoint],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 30
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            if server.poll() is not None or time.time() > deadline:
                server.kill()
                pytest.fail("the ggml RPC test server did not start")
            time.sleep(0.2)
    yield endpoint
    server.kill()
    server.wait()


def test_partial_offload_matches_the_cpu(pair, rpc_endpoint):
    placements = [{"device": "CPU", "n_gpu_layers": -1}] + [
        {"device": "RPC0", "n_gpu_layers": n} for n in (0, 1, 2, 4, 5, -1)]
    res = run_isolated("offload_trace", rpc_endpoint, str(pair["target"]), str(pair["draft"]), placements)
    assert any(d["name"] == "RPC0" and d["type"] == "gpu" for d in res["devices"])
    cpu, *offloaded = res["runs"]
    assert cpu["info"]["n_gpu_layers"] == 0
    assert [r["info"]["n_gpu_layers"] for r in offloaded] == [0, 1, 2, 4, 4, 4]
    for place, r in zip(placements[1:], offloaded):
        assert r["info"]["device"] == "RPC0"
        for stage, (a, b) in enumerate(zip(r["logits"], cpu["logits"])):
            err = np.abs(np.asarray(a) - np.asarray(b)).max()
            assert err < 1e-4, f"ngl {place['n_gpu_layers']}, stage {stage}: logits differ by {err}"
        assert r["chain"] == cpu["chain"] and r["tree"] == cpu["tree"], place


def test_weights_split_into_buffers_the_device_allows(pair, rpc_endpoint, monkeypatch):
    """A device caps single allocations (Vulkan, Metal): weights then take several
    buffers. DFLASH_WEIGHT_BUFFER_MIB lowers the cap to show it on any device."""
    placements = [{"device": "CPU", "n_gpu_layers": -1}, {"device": "RPC0", "n_gpu_layers": -1}]
    monkeypatch.setenv("DFLASH_WEIGHT_BUFFER_MIB", "1")
    res = run_isolated("offload_trace", rpc_endpoint, str(pair["target"]), str(pair["draft"]), placements)
    cpu, rpc = res["runs"]
    assert rpc["info"]["n_weight_buffers"] >= 3, rpc["info"]
    for a, b in zip(rpc["logits"], cpu["logits"]):
        assert np.abs(np.asarray(a) - np.asarray(b)).max() < 1e-4
    assert rpc["chain"] == cpu["chain"] and rpc["tree"] == cpu["tree"]


def test_cli_rpc_offload_and_device_list(pair, rpc_endpoint):
    listed = run("--rpc", rpc_endpoint, "--list-devices")
    assert listed.returncode == 0 and "RPC0" in listed.stdout and "CPU" in listed.stdout
    base = ["-m", str(pair["target"]), "-md", str(pair["draft"]), "-p", "def f(x):", "-n", "24",
            "--tree-budget", "6"]
    cpu = run(*base, "--device", "CPU")
    split = run(*base, "--rpc", rpc_endpoint, "-ngl", "2")
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
