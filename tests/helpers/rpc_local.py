"""A ggml RPC server serving the CPU backend (tests/helpers/rpc_server.py) for the tests of
placement across devices: its memory is not host memory, so every tensor crossing
between devices really is copied."""
from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest


def local_rpc_server():
    """A ggml RPC server serving the CPU backend on a free loopback port: yields host:port."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    endpoint = f"127.0.0.1:{port}"
    server = subprocess.Popen([sys.executable, str(Path(__file__).resolve().parent / "rpc_server.py"), endpoint],
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
