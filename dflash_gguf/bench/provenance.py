"""Where a benchmark ran: the code (commit), the machine (CPU, devices), the versions of
everything that computes, and how loaded the machine was. A number without these cannot
be compared with another."""
from __future__ import annotations

import ctypes
import datetime
import os
import platform
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from typing import Optional

from ..runtime.devices import list_devices
from . import slim


def load_average() -> list:
    """The 1, 5 and 15 minute load averages."""
    return [round(x, 2) for x in os.getloadavg()]


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def checkout() -> Optional[dict]:
    """The git commit of the dflash-gguf checkout this runs from: the one holding this
    package's source (a checkout on PYTHONPATH or installed editable runs its own code,
    whichever virtualenv runs it), else the one holding the virtualenv (scripts/setup.sh
    makes .venv inside the checkout and installs the package into it), else the working
    directory's (git_state). None outside a checkout."""
    for where in (Path(__file__).resolve().parents[2], Path(sys.prefix).parent, Path.cwd()):
        pyproject = where / "pyproject.toml"
        if pyproject.is_file() and 'name = "dflash-gguf"' in pyproject.read_text(errors="replace"):
            state = git_state(where)
            if state is not None:
                return state
    return None


def git_state(where: Path) -> Optional[dict]:
    """A checkout's commit, whether tracked files differ from it, and its untracked files
    (a prompt file or a script that no commit holds; ignored ones, builds and models, left
    out). None where git cannot tell."""
    try:
        sha = subprocess.run(["git", "-C", str(where), "rev-parse", "HEAD"], capture_output=True, text=True,
                             check=True).stdout.strip()
        status = subprocess.run(["git", "-C", str(where), "status", "--porcelain", "--untracked-files=all"],
                                capture_output=True, text=True, check=True).stdout.splitlines()
    except (OSError, subprocess.CalledProcessError):
        return None
    untracked = [line[3:] for line in status if line.startswith("?? ")]
    return {"commit": sha, "uncommitted_changes": len(untracked) < len(status), "untracked": untracked,
            "path": str(where)}


def ggml_version() -> dict:
    """The version and commit of the ggml this process runs (llama-cpp-python's)."""
    import llama_cpp

    lib = ctypes.CDLL(str(Path(llama_cpp.__file__).parent / "lib" / "libggml-base.so"))
    out = {}
    for name in ("ggml_version", "ggml_commit"):
        fn = getattr(lib, name)
        fn.restype = ctypes.c_char_p
        out[name.removeprefix("ggml_")] = fn().decode()
    return out


def versions() -> dict:
    from .. import __version__

    out = {"dflash_gguf": __version__, "llama_cpp_python": metadata.version("llama_cpp_python"),
           "ggml": ggml_version(), "python": platform.python_version(), "numpy": metadata.version("numpy")}
    return out


def machine(threads: int, device: str) -> dict:
    return {"cpu": cpu_name(), "cpus": os.cpu_count(), "cpus_usable": len(os.sched_getaffinity(0)),
            "platform": platform.platform(), "devices": list_devices(), "device": device, "threads": threads}


def results_doc(tool: str, argv: list, **fields) -> dict:
    """The head of a script's results file: the tool, when, how it was called, the checkout."""
    return {"tool": tool, "date": datetime.datetime.now().isoformat(timespec="minutes"), "argv": list(argv),
            "checkout": checkout(), **fields}


def write_results(path: Path, doc: dict, keep_raw: bool = False) -> Optional[Path]:
    """Every tool's results file, in the form kept in git (slim.py: runs' texts and token
    ids as hashes, a record a line); keep_raw: the whole document also as
    <name>.raw.json.gz (returned), which git ignores."""
    return slim.write(path, doc, keep_raw)
