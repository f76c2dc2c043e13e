"""Tensor-by-tensor parity with llama.cpp: where does a numerical difference start?

    python -m dflash_gguf.tools.parity -m model.gguf -p "def quicksort(" [-t 2] [--out result.json]
    python -m dflash_gguf.tools.parity -m model.gguf -p "def quicksort(" --rows 8   # batch invariance

A drafter's tensors against llama.cpp's: `python -m dflash_gguf.tools.parity_draft` (its docstring).

Runs llama.cpp's `llama-eval-callback` (built by `scripts/llama_cpp_build.py
llama-eval-callback`) and our runtime's named-tensor dump (DFLASH_DUMP_TENSORS, see
csrc/dfl_dump.h) on the same GGUF and the same prompt tokens (llama.cpp's tokenization,
read from its log), pairs the tensors by name (llama.cpp's: `attn_norm-3`, `l_out-3`,
`result_output`, ...) and reports, per tensor, the largest absolute difference over the
elements llama-eval-callback prints (the first and last three along each dimension, to
four decimals). The first tensor, in llama.cpp's order of computation, whose difference
passes atol + rtol * (the tensor's largest printed magnitude) is named as the divergence.

Pairing rules: where a name occurs several times in llama.cpp's graph (its Qcur is named
after the projection, the bias, the reshape and the rotation), the last one is the named
step and is the one compared. Where llama.cpp computes only the rows with outputs in its
last layer (one row) and we compute all, its row is compared with our last row.

llama.cpp's log is written by a thread that the process leaves unflushed at exit on
purpose, so the tail of its output is lost (on a tiny model, every time): the tool runs
with a preloaded library whose destructor waits half a second at exit for that thread;
a run whose output still lacks `result_output` is retried, and after that what both runs
have is compared and the result says `"truncated": true`.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from . import llama_cpp_tree

TOOL = "llama-eval-callback"
PRINT_EDGE = 3  # llama-eval-callback prints the first and last 3 along each dimension
ATOL, RTOL = 5e-3, 5e-3
# the names the dense attention builders give, as llama.cpp's do (one layer's; -il appended)
LAYER_NAMES = ("attn_norm", "Qcur", "Kcur", "Vcur", "kqv_out", "ffn_inp", "ffn_norm", "ffn_out", "l_out")
GLOBAL_NAMES = ("inp_embd", "inp_scaled", "result_norm", "result_output")  # inp_scaled: Gemma's scaled embedding
# every name with a layer number (not ggml's derived "Kcur-0 (view)"), and the global ones
DEFAULT_REGEX = r"^[A-Za-z_]+-[0-9]+$|^(" + "|".join(GLOBAL_NAMES) + ")$"


@dataclass
class Printed:
    """One tensor as llama-eval-callback printed it: its header and the printed values."""
    name: str
    op: str
    type: str
    ne: tuple
    values: list = field(default_factory=list)
    sums: list = field(default_factory=list)


def printed_indices(ne: Sequence[int], edge: int = PRINT_EDGE) -> list[int]:
    """Flat (ggml order) indices of the elements llama-eval-callback prints, in its order."""
    def keep(n):
        return list(range(n)) if n <= 2 * edge else list(range(edge)) + list(range(n - edge, n))
    ne0, ne1, ne2, ne3 = ne
    return [i0 + ne0 * (i1 + ne1 * (i2 + ne2 * i3))
            for i3 in range(ne3) for i2 in keep(ne2) for i1 in keep(ne1) for i0 in keep(ne0)]


# "common_debug_cb_eval:   Kcur-0 (view) = (f32)   VIEW(src{..}, }) = {256, 6, 1, 1}"
_HEADER = re.compile(r"^common_debug_cb_eval:\s+(.+?) = \((\w+)\)\s+(\S+)\(.*\) = \{(\d+), (\d+), (\d+), (\d+)\}\s*$")
_NUMBER = re.compile(r"-?(?:\d+\.\d+|nan|inf)", re.IGNORECASE)


def parse_eval_callback(text: str) -> tuple[list[int], list[Printed]]:
    """The prompt tokens and the printed tensors of a llama-eval-callback log, in order.
    A tensor whose values were cut off (a truncated log) keeps the values it has."""
    tokens: list[int] = []
    tensors: list[Printed] = []
    lines = text.splitlines()
    cur: Optional[Printed] = None
    i = 0
    while i < len(lines):
        line = lines[i]
        m = re.search(r"number of input tokens = (\d+)", line)
        if m and not tokens:
            n = int(m.group(1))
            # one id a line, after the logger's time stamp and level
            tokens = [int(x.split()[-1]) for x in lines[i + 1:i + 1 + n]]
            i += 1 + n
            continue
        h = _HEADER.match(line)
        if h:
            cur = Printed(h.group(1), h.group(3), h.group(2), tuple(int(h.group(k)) for k in range(4, 8)))
            tensors.append(cur)
        elif cur is not None:
            s = line.strip()
            if s.startswith("sum = "):
                cur.sums.append(float(s[6:]))
            elif s.startswith("[") and s.endswith("],") and len(s) > 3:
                cur.values.extend(float(x) for x in _NUMBER.findall(s))
        i += 1
    return tokens, tensors


def read_dump_tensors(path) -> list[dict]:
    """Our dump file (csrc/dfl_dump.h) in its order (the graph's order of computation):
    each tensor as {name, op, type, ne, values}."""
    out = []
    with open(path, "rb") as f:
        while True:
            header = f.readline()
            if not header:
                break
            h = json.loads(header)
            data = f.read(4 * h["n"])
            if len(data) != 4 * h["n"]:
                raise ValueError(f"{path}: the dump ends inside tensor {h['name']}")
            h["values"] = np.frombuffer(data, dtype="<f4")
            out.append(h)
    return out


def by_name(tensors: list[dict]) -> dict[str, dict]:
    """Each name's last tensor (the named step, as pairing wants)."""
    return {t["name"]: t for t in tensors}


def read_dump(path) -> dict[str, dict]:
    """Our dump file: name -> tensor; a name dumped more than once keeps its last."""
    return by_name(read_dump_tensors(path))


def _slowest(ne) -> int:
    """The slowest dimension with more than one element (a tensor's rows)."""
    return max((d for d in range(4) if ne[d] > 1), default=0)


def _rows_apart(ne_small, ne_big) -> bool:
    """Whether one tensor is the other with fewer rows along the slowest dimension."""
    last = _slowest(ne_big)
    return (all(ne_small[d] == ne_big[d] for d in range(last)) and 0 < ne_small[last] < ne_big[last]
            and all(ne_small[d] == 1 for d in range(last + 1, 4)))


def compare(ours: dict[str, dict], theirs: list[Printed], atol: float = ATOL, rtol: float = RTOL,
            row_shift: Optional[dict[str, int]] = None) -> dict:
    """Per shared name (llama.cpp's order, its last tensor of the name): the largest
    absolute difference over the printed elements, and the first tensor past tolerance.
    Where ours has more or fewer rows (along the slowest dimension), the last rows of
    both are paired; row_shift names tensors whose row r+k is llama.cpp's row r (their
    first k rows ours alone)."""
    last = {}
    for t in theirs:
        if t.values and not any(ch in t.name for ch in " ()"):
            last.pop(t.name, None)  # keep the order of the last occurrences
            last[t.name] = t
    rows, first = [], None
    for name, t in last.items():
        if name not in ours:
            continue
        o = ours[name]
        n_theirs = math.prod(t.ne)
        n_ours = len(o["values"])
        idx = np.asarray(printed_indices(t.ne))
        row = {"name": name, "ne_llama": list(t.ne), "ne_ours": o["ne"]}
        if n_ours != n_theirs and not (_rows_apart(o["ne"], t.ne) or _rows_apart(t.ne, o["ne"])
                                       or (n_ours > n_theirs and n_ours % n_theirs == 0)):
            row["skipped"] = "shapes do not pair"
            rows.append(row)
            continue
        if len(t.values) != len(idx):
            row["skipped"] = f"llama.cpp printed {len(t.values)} of {len(idx)} values (truncated log)"
            rows.append(row)
            continue
        # where ours is longer, its last rows are llama.cpp's (it keeps only the output rows
        # in its last layer); where shorter, llama.cpp's last rows are ours (a DFlash
        # drafter's head skips the anchor's row); a shift as row_shift says
        row_size = math.prod(t.ne[:_slowest(t.ne)])
        offset = n_ours - n_theirs + (row_shift or {}).get(name, 0) * row_size
        keep = (idx + offset >= 0) & (idx + offset < n_ours)
        ref, idx = np.asarray(t.values, dtype=np.float64)[keep], idx[keep]
        if not keep.any():
            row["skipped"] = "no printed row in common"
            rows.append(row)
            continue
        mine = o["values"][idx + offset].astype(np.float64)
        with np.errstate(invalid="ignore"):
            diff = np.abs(mine - ref)
        # equal infinities (an EAGLE3 head's tokens outside its vocabulary) and NaNs agree
        diff[(mine == ref) | (np.isnan(mine) & np.isnan(ref))] = 0.0
        diff[np.isnan(diff)] = np.inf
        finite = np.abs(ref[np.isfinite(ref)])
        scale = float(finite.max()) if finite.size else 0.0
        row.update(n_compared=int(ref.size), max_abs_diff=float(diff.max()), max_abs=scale,
                   argmax=int(idx[int(diff.argmax())]),
                   sum_llama=t.sums[-1] if t.sums and offset == 0 else None,
                   sum_ours=float(o["values"].astype(np.float64).sum()) if offset == 0 else None)
        # the sums cover every element, not only the printed ones (llama.cpp adds in float32)
        if row["sum_llama"] is not None:
            row["sum_rel_diff"] = abs(row["sum_ours"] - row["sum_llama"]) / max(1.0, abs(row["sum_llama"]))
        row["ok"] = bool(row["max_abs_diff"] <= atol + rtol * scale)
        if not row["ok"] and first is None:
            first = name
        rows.append(row)
    compared = [r for r in rows if "max_abs_diff" in r]
    worst = max(compared, key=lambda r: r["max_abs_diff"], default=None)
    sums = [r["sum_rel_diff"] for r in compared if "sum_rel_diff" in r]
    return {"atol": atol, "rtol": rtol, "n_compared": len(compared), "first_divergence": first,
            "max_abs_diff": worst["max_abs_diff"] if worst else None, "worst": worst["name"] if worst else None,
            "max_sum_rel_diff": max(sums, default=None),
            # llama.cpp's unnamed nodes (node_N) left out
            "only_llama": [n for n in last if n not in ours and not n.startswith("node_")],
            "only_ours": [n for n in ours if n not in last],
            "tensors": rows}


# llama.cpp's logger writes from a thread that exit() does not wait for (common/log.cpp
# leaks it on purpose), so a small model's run loses the last tensors' lines every time.
# A library preloaded into the tool whose destructor waits a moment at exit lets the
# thread drain its queue; the retries below cover a run where that was not enough.
_EXIT_WAIT_C = """
#include <stdlib.h>
#include <unistd.h>
__attribute__((destructor)) static void dflash_parity_wait_for_logger(void) {
    const char * ms = getenv("DFLASH_PARITY_EXIT_WAIT_MS");
    usleep((useconds_t) (ms ? atoi(ms) : 500) * 1000u);
}
"""


def _exit_wait_library() -> Optional[Path]:
    """The preload library (built once next to llama.cpp's tools), None without a C compiler."""
    lib = llama_cpp_tree.build_dir() / "dflash-parity-exit-wait.so"
    if lib.is_file():
        return lib
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        return None
    lib.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=lib.parent) as tmp:
        src = Path(tmp) / "exit_wait.c"
        src.write_text(_EXIT_WAIT_C)
        out = Path(tmp) / lib.name
        if subprocess.run([cc, "-shared", "-fPIC", "-O2", "-o", str(out), str(src)], capture_output=True).returncode:
            return None
        out.replace(lib)  # whole or not at all
    return lib


def run_printer(name: str, args: Sequence[str], tool: Optional[Path] = None) -> subprocess.CompletedProcess:
    """One run of a tool that prints tensors through llama.cpp's logger (llama-eval-callback,
    our dflash-draft-eval; `tool`: its binary, else the built one), with the library that
    lets the logger drain at exit preloaded."""
    exe = tool or llama_cpp_tree.tool(name)
    if exe is None:
        raise FileNotFoundError(f"{name} is not built: run `python scripts/llama_cpp_build.py {name}`")
    env = dict(os.environ)
    preload = _exit_wait_library()
    if preload is not None:
        env["LD_PRELOAD"] = " ".join(filter(None, [str(preload), env.get("LD_PRELOAD")]))
    return subprocess.run([str(exe), *args], capture_output=True, text=True, errors="replace", env=env)


def llama_log(model, prompt: str, threads: int, tool: Optional[Path] = None, n_ctx: int = 512) -> str:
    """One run of llama-eval-callback: its log (stdout and stderr)."""
    # it never warms up
    proc = run_printer(TOOL, ["-m", str(model), "-p", prompt, "-t", str(threads), "-c", str(n_ctx)], tool)
    if proc.returncode != 0:
        raise RuntimeError(f"{TOOL} failed ({proc.returncode}): " + proc.stderr.strip()[-2000:])
    return proc.stderr + "\n" + proc.stdout


def run_llama(model, prompt: str, threads: int, tool: Optional[Path] = None, retries: int = 2,
              n_ctx: int = 512) -> tuple[list[int], list[Printed], bool]:
    """llama-eval-callback's tokens and tensors; retried while its log lacks the last tensor
    (its logger may lose the tail at exit). Returns (tokens, tensors, truncated)."""
    best = ([], [], True)
    for _ in range(1 + retries):
        tokens, tensors = parse_eval_callback(llama_log(model, prompt, threads, tool, n_ctx))
        if not tokens:
            raise RuntimeError(f"{TOOL} printed no prompt tokens")
        if any(t.name == "result_output" and t.sums for t in tensors):
            return tokens, tensors, False
        if len(tensors) > len(best[1]):
            best = (tokens, tensors, True)
    return best


@contextlib.contextmanager
def dump_env(regex: Optional[str], path, file_var: str = "DFLASH_DUMP_FILE", skip: int = 0):
    """DFLASH_DUMP_TENSORS, DFLASH_DUMP_FILE and DFLASH_DUMP_SKIP (csrc/dfl_dump.h; a
    drafter's file: file_var="DFLASH_DUMP_DRAFT_FILE") set for what loads a runtime inside
    (it reads them then), restored after; no regex: nothing set."""
    if not regex:
        yield
        return
    saved = {k: os.environ.get(k) for k in ("DFLASH_DUMP_TENSORS", file_var, "DFLASH_DUMP_SKIP")}
    os.environ.update({"DFLASH_DUMP_TENSORS": regex, file_var: str(path), "DFLASH_DUMP_SKIP": str(skip)})
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def run_ours(model, tokens: Sequence[int], threads: int, regex: str = DEFAULT_REGEX, n_ctx: int = 512,
             device: Optional[str] = None) -> dict:
    """Our runtime's dump of the prompt pass over `tokens` (on `device`, a ggml device name;
    None: the runtime's default)."""
    from ..runtime.target import LOGITS_LAST, Target, TargetConfig

    with tempfile.TemporaryDirectory(prefix="dflash-parity-") as tmp:
        path = Path(tmp) / "dump.bin"
        with dump_env(regex, path):
            target = Target(str(model), TargetConfig(n_ctx=max(n_ctx, len(tokens) + 1), n_threads=threads,
                                                        device=device))
        try:
            target.prefill(list(tokens), LOGITS_LAST)
        finally:
            target.close()
        return read_dump(path)


def parity(model, prompt: str, threads: int = 2, atol: float = ATOL, rtol: float = RTOL,
           our_tokens: Optional[Sequence[int]] = None, tool: Optional[Path] = None,
           device: Optional[str] = None) -> dict:
    """Both runs compared. our_tokens: feed our side other tokens than llama.cpp's (a
    deliberate perturbation, for testing that a divergence is found where it starts)."""
    tokens, theirs, truncated = run_llama(model, prompt, threads, tool)
    ours = run_ours(model, tokens if our_tokens is None else our_tokens, threads, device=device)
    result = compare(ours, theirs, atol, rtol)
    result.update(model=str(model), prompt=prompt, tokens=list(tokens), threads=threads, device=device,
                  truncated=truncated,
                  tool=str(tool or llama_cpp_tree.tool(TOOL)))
    return result


def row_parity(model, prompt: str, rows: int, threads: int = 2, device: Optional[str] = None) -> dict:
    """Batch invariance, op by op: our named tensors of a one-row first pass (the prompt's
    first token) against row 0 of the same tensors in a `rows`-row first pass (its first
    `rows` tokens), compared bit for bit. The first tensor, in our order of computation,
    whose row differs is named as the divergence: the op whose kernel rounds one row
    alone otherwise than among several. No llama.cpp run is needed."""
    from ..runtime.tokenizer import Tokenizer

    tokens = Tokenizer(str(model)).encode(prompt)
    if len(tokens) < rows:
        raise RuntimeError(f"the prompt has {len(tokens)} tokens; --rows {rows} needs as many")
    one = run_ours(model, tokens[:1], threads, device=device)
    many = run_ours(model, tokens[:rows], threads, device=device)
    out = []
    for name, a in one.items():  # the dump's order: the order of computation
        b = many.get(name)
        if b is None:
            continue
        # the token dimension: 1 in the one-row pass, `rows` in the other, the rest equal
        dims = [d for d in range(4) if a["ne"][d] == 1 and b["ne"][d] == rows
                and all(a["ne"][e] == b["ne"][e] for e in range(4) if e != d)]
        if not dims:
            out.append({"name": name, "ne_one": a["ne"], "ne_rows": b["ne"], "skipped": "no token dimension"})
            continue
        row0 = b["values"].reshape(b["ne"][::-1])[tuple(0 if 3 - e == dims[-1] else slice(None) for e in range(4))]
        mine = a["values"].reshape(a["ne"][::-1])[tuple(0 if 3 - e == dims[-1] else slice(None) for e in range(4))]
        diff = float(np.max(np.abs(row0.astype(np.float64) - mine))) if mine.size else 0.0
        out.append({"name": name, "op": a["op"], "ne_one": a["ne"], "equal": bool(np.array_equal(row0, mine)),
                    "max_abs_diff": diff})
    compared = [r for r in out if "equal" in r]
    first = next((r["name"] for r in compared if not r["equal"]), None)
    return {"model": str(model), "prompt": prompt, "rows": rows, "threads": threads, "device": device,
            "n_compared": len(compared), "first_divergence": first, "tensors": out}


def row_summary(result: dict) -> str:
    lines = [f"{'tensor':<24} {'op':<12} {'ne (one row)':<22} {'row 0 of ' + str(result['rows']):>14}"]
    for r in result["tensors"]:
        if "equal" in r:
            state = "equal" if r["equal"] else f"differs by {r['max_abs_diff']:.3g}  <--"
            lines.append(f"{r['name']:<24} {r['op']:<12} {str(r['ne_one']):<22} {state:>14}")
        else:
            lines.append(f"{r['name']:<24} {'':<12} {str(r['ne_one']):<22} skipped: {r['skipped']}")
    lines.append(f"{result['n_compared']} tensors compared bit for bit; first divergence: "
                 f"{result['first_divergence'] or 'none'}")
    return "\n".join(lines)


def to_json(result: dict) -> str:
    """The result as JSON, one line per tensor."""
    head = [f" {json.dumps(k)}: {json.dumps(v)}" for k, v in result.items() if k != "tensors"]
    rows = ",\n  ".join(json.dumps(r) for r in result["tensors"])
    return "{\n" + ",\n".join(head) + f',\n "tensors": [\n  {rows}\n ]\n}}\n'


def summary(result: dict) -> str:
    lines = [f"{'tensor':<24} {'ne (llama.cpp)':<22} {'max |diff|':>12} {'max |ref|':>12}"]
    for r in result["tensors"]:
        if "max_abs_diff" in r:
            flag = "" if r["ok"] else "  <-- past tolerance"
            lines.append(f"{r['name']:<24} {str(r['ne_llama']):<22} {r['max_abs_diff']:>12.3g} {r['max_abs']:>12.3g}{flag}")
        else:
            lines.append(f"{r['name']:<24} {str(r['ne_llama']):<22} skipped: {r['skipped']}")
    lines.append(f"{result['n_compared']} tensors compared (tolerance {result['atol']:g} + {result['rtol']:g} * max |ref|); "
                 f"largest difference {result['max_abs_diff']} at {result['worst']}; largest relative difference of "
                 f"whole-tensor sums {result['max_sum_rel_diff']}; first divergence: "
                 f"{result['first_divergence'] or 'none'}" + ("; llama.cpp's log was truncated" if result["truncated"] else ""))
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("-m", "--model", required=True, help="GGUF file")
    p.add_argument("-p", "--prompt", required=True)
    p.add_argument("-t", "--threads", type=int, default=2)
    p.add_argument("-dev", "--device", help="our side's ggml device (llama.cpp's tool runs on the CPU)")
    p.add_argument("--atol", type=float, default=ATOL)
    p.add_argument("--rtol", type=float, default=RTOL)
    p.add_argument("--out", help="write the result (summaries, no values) as JSON here")
    p.add_argument("--rows", type=int, metavar="K",
                   help="batch invariance instead of llama.cpp: our one-row pass against row 0 of a K-row pass, "
                        "bit for bit, naming the first op that differs")
    args = p.parse_args(argv)
    if not Path(args.model).is_file():
        p.error(f"no such model file: {args.model}")
    if args.rows is not None and args.rows < 2:
        p.error("--rows must be 2 or more")
    try:
        if args.rows:
            result = row_parity(args.model, args.prompt, args.rows, args.threads, device=args.device)
        else:
            result = parity(args.model, args.prompt, args.threads, args.atol, args.rtol, device=args.device)
    except (FileNotFoundError, RuntimeError, ValueError) as e:  # DflashError and ConfigError among them
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(row_summary(result) if args.rows else summary(result))
    if args.out:
        Path(args.out).write_text(to_json(result))
    return 1 if result["first_divergence"] else 0


if __name__ == "__main__":
    sys.exit(main())
