"""Whether greedy speculation is exact where the engine runs, asked of the device at load.

Lossless greedy speculation needs a verify's rows to round as one-row decodes do (docs/
exactness.md). That holds where the backend carries the project's batch-invariance
patches and its kernels keep the promise for the model's weight types at the row counts
the settings allow. So at load, for each device the target runs on:

  1. the backend must carry the patches: a patched backend names them through its
     registry (dfl_device_batch_invariance), ending with the patch set's key, which must
     be the key our library was built for; a stock ggml, or one patched from another
     patch set, is "no" at once;
  2. the probe the tests use (devices.matmul_invariance): every weight type of the
     model, the columns of a product from 2 up to the step's most rows against each
     column alone, bit for bit;
  3. a backend the project has proven end to end for this model's step (unproven(): the
     CPU on x86 for every model; Vulkan on lavapipe for the architectures shown there with
     an f16 cache and no experts) is "yes" when the probe passes; elsewhere a passing probe
     is "unverified", with why: the rest of the step (attention over that cache, MoE
     products, norms) has not been shown exact there.

The answer is cached per build (the native library's and ggml's files), device, the
model's step (Step) and rows, so a warm start reads one small file."""
from __future__ import annotations

import hashlib
import json
import os
import platform
import warnings
from dataclasses import astuple, dataclass
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Sequence, Tuple, Union

import numpy as np
from gguf import GGMLQuantizationType

from .demo import cache_dir
from .devices import device_description, matmul_invariance
from .gguf_meta import GGUFMeta
from .native import _HERE, DflashError, ffi, lib

MODES = ("report", "require", "off")
# column counts on both sides of every kernel switch the backends have (gemv/gemm at 4,
# the tiled kernels at 8 and 16, CUDA's MMVQ/MMQ at 8/9, attention's tiles at 64)
PROBE_COLUMNS = (2, 3, 4, 5, 8, 9, 16, 17, 33, 64, 65, 128, 256)
# the probe's matrix: six K-quant super blocks in, eight repacked row groups out
PROBE_SHAPE = (1536, 64)
Q = GGMLQuantizationType
# the weight types the probe can make (ggml quantizes them without an importance matrix:
# tests/runtime/test_batch_invariance.py's); a model's other types are not probed
PROBED = frozenset({Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K,
                    Q.Q6_K, Q.IQ4_NL, Q.IQ4_XS, Q.MXFP4})
INTEGER = frozenset({Q.I8, Q.I16, Q.I32, Q.I64})  # never a matrix a product reads
# the rules the answers follow, in the cache key: a new rule (what is proven) asks again
ANSWERS = 3
# architectures whose every verify mode lavapipe has shown equal to one-row decodes with an
# f16 cache: Gemma 3 270M and Qwen2.5-Coder 1.5B by the near-tie hunts
# (results/near-tie-hunt-vulkan-*2026-11-30.json), the demo's Qwen3.5 by CI's device tests
LAVAPIPE_SHOWN = ("gemma3", "qwen2", "qwen35")


@dataclass(frozen=True)
class Exactness:
    """exact: "yes", "no" or "unverified", and why (empty for a plain yes)."""

    exact: str
    why: str = ""

    def __str__(self) -> str:
        return f"{self.exact} ({self.why})" if self.why else self.exact

    def as_dict(self) -> dict:
        return {"exact": self.exact, "why": self.why}


@dataclass(frozen=True)
class Step:
    """What of a model's step, beside its weight types, decides whether a backend has
    been shown exact for it: the architecture, the cache's K and V types (a tree row's
    attention gathers its own cells only over f16 on Vulkan) and whether its feed-forward
    products pick experts (mul_mat_id, stock on Vulkan)."""

    arch: str
    kv_types: Tuple[str, str] = ("f16", "f16")
    experts: bool = False

    @classmethod
    def of(cls, gguf: Union[str, GGUFMeta], kv_type: str = "f16", kv_type_v: Optional[str] = None) -> "Step":
        meta = _meta(gguf)
        return cls(str(meta.get("general.architecture", "")), (kv_type, kv_type_v or kv_type),
                   any(name.endswith("_exps.weight") for name in meta.tensor_names()))


def unproven(device: str, description: str, remote: bool, step: Step) -> Optional[str]:
    """Why the project has not shown this model's whole step exact on the backend (the
    answer's "why"), or None where it has (docs/exactness.md's table): the CPU on x86, its
    kernels patched and every mode of the published models checked end to end; Vulkan on
    lavapipe for the architectures shown there (LAVAPIPE_SHOWN) over an f16 cache without
    experts. Elsewhere a passing matrix probe leaves the answer unverified: the backend's
    other kernels (attention, expert products, norms) take paths not shown exact."""
    if remote:
        return "a remote backend"
    if device.upper() == "CPU" and platform.machine().lower() in ("x86_64", "amd64"):
        return None
    if device.upper().startswith("VULKAN") and "llvmpipe" in description.lower():
        if step.experts:
            return "expert products (mul_mat_id) keep ggml-vulkan's stock kernels"
        if step.kv_types != ("f16", "f16"):
            return (f"a tree row's attention over a {'/'.join(step.kv_types)} cache takes ggml-vulkan's stock "
                    f"kernel; an f16 cache (-ctk f16 -ctv f16) is shown exact")
        if step.arch not in LAVAPIPE_SHOWN:
            return f"{step.arch} is not shown exact on lavapipe (shown: {', '.join(LAVAPIPE_SHOWN)})"
        return None
    return "this backend's whole step is not yet proven (docs/exactness.md)"


def backend_patch(device: str) -> Optional[str]:
    """The batch-invariance patch the device's backend names, or None for a stock one."""
    buf = ffi.new("char[256]")
    if not lib.dfl_device_batch_invariance(device.encode(), buf, len(buf)):
        return None
    return ffi.string(buf).decode("utf-8", "replace")


def built_for() -> str:
    """The key of the patch set our library was built for (CMakeLists.txt)."""
    return ffi.string(lib.dfl_ggml_patch_key()).decode()


def patch_problem(device: str, patch: Optional[str]) -> Optional[str]:
    """Why a backend's patch is not the one this build needs (the answer's "why"), or None
    when it is: a stock backend names none; a ggml patched from another patch set (an
    older set-up's, a hand-built one) ends its name with another key."""
    if patch is None:
        return f"{device}: ggml without the batch-invariance patch"
    named = patch.rsplit("patches ", 1)[1] if "patches " in patch else "unkeyed"
    if named != built_for():
        return (f"{device}: ggml carries batch-invariance patch set {named}, this dflash-gguf is built for "
                f"{built_for()} (run scripts/setup.sh, or reinstall the package)")
    return None


def _meta(gguf: Union[str, GGUFMeta]) -> GGUFMeta:
    """A GGUF's metadata, read once where one caller asks several questions of it."""
    return gguf if isinstance(gguf, GGUFMeta) else GGUFMeta(gguf)


def weight_types(gguf: Union[str, GGUFMeta]) -> List[int]:
    """The ggml types of a GGUF's matrices that multiply activations (every tensor of two
    or more dimensions but the token embedding, which is read row by row)."""
    return sorted({t for name, (shape, t) in _meta(gguf).tensors().items()
                   if len(shape) >= 2 and name != "token_embd.weight" and t not in INTEGER})


def probe_columns(max_rows: int) -> List[int]:
    """The column counts probed for steps of at most max_rows rows."""
    cols = [c for c in PROBE_COLUMNS if c <= max_rows]
    if max_rows >= 2 and max_rows not in cols:
        cols.append(max_rows)
    return cols


def _type_name(t: int) -> str:
    try:
        return GGMLQuantizationType(t).name
    except ValueError:
        return f"type {t}"


def probe(device: str, types: Iterable[int], max_rows: int, n_threads: int = 2) -> Optional[Tuple[str, int]]:
    """The first (weight type, columns) whose product on `device` rounds a column
    otherwise than that column alone, or None when every one is invariant."""
    n_in, n_out = PROBE_SHAPE
    rng = np.random.default_rng(0)
    w = rng.normal(0, 0.05, (n_out, n_in)).astype(np.float32)
    for t in types:
        for n_cols in probe_columns(max_rows):
            x = rng.normal(0, 1, (n_cols, n_in)).astype(np.float32)
            x[:, ::97] *= 30  # outliers, as real activations have: an 8-bit scale follows them
            n_differ, _ = matmul_invariance(t, w, x, device=device, repack=True, n_threads=n_threads)
            if n_differ:
                return _type_name(t), n_cols
    return None


def _build_files() -> List[Path]:
    """The libraries whose code decides the answer: ours and the ggml it loads (bundled
    beside it by a build that found no patched ggml, else llama-cpp-python's)."""
    files = [_HERE / "libdflash.so"] + sorted((_HERE / "ggml").glob("libdflash-ggml*.so"))
    try:
        import llama_cpp  # noqa: F401 - only its location: ggml is installed beside it

        files += sorted((Path(llama_cpp.__file__).parent / "lib").glob("libggml*.so*"))
    except ImportError:
        pass
    return files


def _cache_key(device: str, description: str, patch: Optional[str], types: Sequence[int], step: Step,
               max_rows: int) -> str:
    stats = [(str(p), p.stat().st_size, p.stat().st_mtime_ns) for p in _build_files() if p.exists()]
    blob = json.dumps([ANSWERS, stats, device, description, patch, list(types), astuple(step), max_rows,
                       list(PROBE_COLUMNS), PROBE_SHAPE])
    return hashlib.sha256(blob.encode()).hexdigest()[:24]


def _cache_path() -> Path:
    return cache_dir() / "exactness.json"


def _cached() -> Dict[str, dict]:
    try:
        return json.loads(_cache_path().read_text())
    except (OSError, ValueError):
        return {}


def _remember(key: str, answer: Exactness) -> None:
    path = _cache_path()
    entries = _cached()
    entries[key] = answer.as_dict()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(entries, indent=1, sort_keys=True))
        tmp.replace(path)
    except OSError:
        pass  # a read-only cache costs the next start a probe, nothing else


def device_exactness(device: str, types: Sequence[int], max_rows: int, n_threads: int = 2,
                     step: Step = Step("")) -> Exactness:
    """The answer for one device (cached; see the module's docstring)."""
    if max_rows < 2:
        return Exactness("yes", "one row a step: nothing to round apart")
    description = device_description(device)
    remote = device.upper().startswith("RPC")
    # the patch's name is in the key: a backend may withdraw it (ggml-vulkan does under
    # GGML_VK_BATCH_VARIANT, its stock kernel choices) with the same files
    patch = None if remote else backend_patch(device)
    key = _cache_key(device, description, patch, types, step, max_rows)
    known = _cached().get(key)
    if known is not None:
        return Exactness(known["exact"], known.get("why", ""))
    answer = _ask(device, description, remote, patch, types, step, max_rows, n_threads)
    _remember(key, answer)
    return answer


def _ask(device: str, description: str, remote: bool, patch: Optional[str], types: Sequence[int], step: Step,
         max_rows: int, n_threads: int) -> Exactness:
    problem = None if remote else patch_problem(device, patch)
    if problem:
        return Exactness("no", problem)
    try:
        differs = probe(device, [t for t in types if t in PROBED], max_rows, n_threads)
    except DflashError as e:
        return Exactness("unverified", f"{device}: the probe could not run: {e}")
    if differs is not None:
        t, n_cols = differs
        return Exactness("no", f"{device}: {t} at {n_cols} columns")
    unprobed = [_type_name(t) for t in types if t not in PROBED]
    if unprobed:
        return Exactness("unverified", f"{device}: {', '.join(unprobed)} weights are not probed")
    why = unproven(device, description, remote, step)
    if why is None:
        return Exactness("yes")
    return Exactness("unverified", f"{device}: the matrix probe passes; {why}")


def exactness(model: str, devices: Sequence[str], max_rows: int, n_threads: int = 2,
              mode: str = "report", kv_types: Tuple[str, Optional[str]] = ("f16", None)) -> Exactness:
    """The engine's answer: its target's weight types and step (over a cache of kv_types)
    on every device it runs on, at steps of up to max_rows rows; the first device that is
    not "yes" decides."""
    if mode not in MODES:
        raise ValueError(f"exact must be one of {', '.join(MODES)}, got {mode!r}")
    if mode == "off":
        return Exactness("unverified", "not checked: --exact off")
    meta = GGUFMeta(model)
    types, step = weight_types(meta), Step.of(meta, *kv_types)
    answers = [device_exactness(d, types, max_rows, n_threads, step) for d in dict.fromkeys(devices)]
    return next((a for a in answers if a.exact == "no"), None) or \
        next((a for a in answers if a.exact != "yes"), None) or answers[0]


def import_problem() -> Optional[str]:
    """The check made at import: whether the ggml this process loaded carries the patch set
    our library was built for, asked of its CPU backend (every ggml has one)."""
    return patch_problem("CPU", backend_patch("CPU"))


_problem = import_problem()
if _problem:
    warnings.warn(f"dflash_gguf: {_problem}; greedy speculation is not exact on it (docs/exactness.md)",
                  RuntimeWarning, stacklevel=2)
