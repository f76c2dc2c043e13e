"""The tests' stand-in for a GPU, for the measurement scripts beside it: a ggml RPC server on loopback serving
the CPU backend (tests/helpers/rpc_server.py), whose memory is not this process's, so that a
model placed on it is split across two devices as on a card."""
from __future__ import annotations

import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

SERVER = Path(__file__).resolve().parent.parent / "tests" / "helpers" / "rpc_server.py"


@contextmanager
def rpc_device():
    """Start the server on a free port and register its device (RPC0 when it is the first);
    yields the server process, stopped on exit."""
    from dflash_gguf.runtime.devices import add_rpc_server

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen([sys.executable, str(SERVER), f"127.0.0.1:{port}"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(150):
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if server.poll() is not None:
                    raise RuntimeError("the ggml RPC server exited at start") from None
                time.sleep(0.2)
        else:
            raise RuntimeError("the ggml RPC server did not start")
        add_rpc_server(f"127.0.0.1:{port}")
        yield server
    finally:
        server.kill()
        server.wait()
