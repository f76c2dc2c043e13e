"""The OpenMP teams of ggml's CPU backend, handed back by threads that compute no more graphs.

ggml's CPU backend built with OpenMP (llama.cpp's default, and this package's) runs each
graph on an OpenMP team of the thread that computes it, and crosses a team barrier at
every node. The OpenMP runtime keeps a thread's team (its worker threads) after the
graph is done, for the next. Once it keeps more threads than the process may use CPUs,
libgomp shortens the spin of every barrier of every team to almost nothing (its
"throttled" spin count), so that a worker waiting for the others sleeps and is woken
through the kernel at every node. A server loads its models and measures its verify
cost table on the main thread and decodes on its engine thread: two teams of two on two
cores, and every step ran 25-40% slower than the same step on one thread
(docs/performance.md, "One thread computes the graphs"). A thread that is done computing
graphs hands its team back (release_team); the next graph it computes, if any, builds
a new one."""
from __future__ import annotations

import ctypes
import os
from typing import Optional

# the OpenMP runtimes a ggml build may link: GCC's, LLVM's, Intel's
_RUNTIMES = ("libgomp.so.1", "libomp.so", "libomp.so.5", "libiomp5.so")
_PAUSE_SOFT = 1  # omp_pause_soft (OpenMP 5.0): threads end, nothing is kept


def loaded_runtime() -> Optional[ctypes.CDLL]:
    """The OpenMP runtime this process has loaded (through ggml's CPU backend), or None:
    a build without OpenMP has its own thread pool and nothing to hand back. Never loads
    one (RTLD_NOLOAD)."""
    noload = getattr(os, "RTLD_NOLOAD", None)
    if noload is None:  # no dlopen (Windows): not looked for
        return None
    for name in _RUNTIMES:
        try:
            lib = ctypes.CDLL(name, mode=noload | os.RTLD_NOW)
        except OSError:
            continue
        if hasattr(lib, "omp_pause_resource_all"):
            return lib
    return None


def release_team() -> bool:
    """Hand back the calling thread's OpenMP team: its worker threads end, and the runtime
    counts them no more. Call it on a thread that has computed graphs and hands the
    decoding to another (a server's main thread once its engine is loaded and measured).
    Whether a runtime was loaded and released it."""
    lib = loaded_runtime()
    if lib is None:
        return False
    lib.omp_pause_resource_all.restype = ctypes.c_int
    lib.omp_pause_resource_all.argtypes = [ctypes.c_int]
    return lib.omp_pause_resource_all(_PAUSE_SOFT) == 0
