"""Work for tests/runtime/test_target.py that runs in a child process.

Quantized GGUFs exercise CPU kernels (weight repacking, AMX) that have crashed on some
machines; a crash there must fail one test, not end the session. Each function here runs
in a child interpreter running this file, via `run_isolated`, takes JSON-able arguments and returns a JSON-able result.
No torch import: a child starts in about a second.
"""
from __future__ import annotations

import ctypes
import importlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

_HERE = Path(__file__).resolve().parent


class ChildCrashed(RuntimeError):
    pass


def run_isolated(func: str, *args, deny_amx: bool = False, timeout: float = 300) -> object:
    """Run target_workers.<func>(*args) (or, for "module:func", that function of
    helpers.<module>, another of tests/helpers/) in a fresh interpreter and return its result.

    deny_amx: refuse the process AMX tile permission before anything loads ggml, so ggml
    does not offer its AMX buffer type (see deny_amx_permission). DFLASH_TEST_DENY_AMX=1
    in the environment denies it to every child (to tell an AMX crash from others)."""
    deny_amx = deny_amx or os.environ.get("DFLASH_TEST_DENY_AMX") == "1"
    payload = json.dumps({"func": func, "args": args, "deny_amx": deny_amx})
    res = subprocess.run([sys.executable, str(_HERE / "target_workers.py"), payload], capture_output=True, text=True,
                         cwd=_HERE.parent, timeout=timeout)
    if res.returncode != 0:
        how = (f"killed by signal {signal.Signals(-res.returncode).name}" if res.returncode < 0
               else f"exit code {res.returncode}")
        raise ChildCrashed(f"{func} {how}:\n{res.stderr[-3000:]}")
    marker = "@@RESULT@@"
    line = next(ln for ln in res.stdout.splitlines() if ln.startswith(marker))
    return json.loads(line[len(marker):])


def _child(payload: str) -> None:
    req = json.loads(payload)
    if req["deny_amx"]:
        deny_amx_permission()
    module, _, name = req["func"].rpartition(":")  # "module:func" for another helper module's work
    func = getattr(importlib.import_module(f"helpers.{module}"), name) if module else globals()[name]
    out = func(*req["args"])
    print("@@RESULT@@" + json.dumps(out), flush=True)


def deny_amx_permission() -> None:
    """Install a seccomp filter that fails arch_prctl(ARCH_REQ_XCOMP_PERM) with EPERM.

    ggml's CPU backend asks for AMX tile permission before it offers the AMX buffer type;
    refused, it falls back to its other kernels (weight repacking where available). With
    AMX compiled in (llama-cpp-python 0.3.36 built natively on an AMX CPU),
    ggml_backend_amx_mul_mat dies with SIGSEGV for matrix products of more than one row
    (ldtilecfg of a tile config with garbage in its colsb/rows bytes), in llama.cpp itself
    as well; scripts/setup.sh now builds without AMX, and this keeps the oracle usable on
    a build that has it. Linux x86-64 only; elsewhere a no-op.
    """
    if sys.platform != "linux" or os.uname().machine != "x86_64":
        return

    class SockFilter(ctypes.Structure):
        _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8), ("jf", ctypes.c_uint8),
                    ("k", ctypes.c_uint32)]

    class SockFprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_uint16), ("filter", ctypes.POINTER(SockFilter))]

    BPF_LD_W_ABS, BPF_JEQ_K, BPF_RET_K = 0x20, 0x15, 0x06
    AUDIT_ARCH_X86_64, NR_ARCH_PRCTL, ARCH_REQ_XCOMP_PERM = 0xC000003E, 158, 0x1023
    RET_ALLOW, RET_EPERM = 0x7FFF0000, 0x00050000 | 1
    prog = [
        SockFilter(BPF_LD_W_ABS, 0, 0, 4),                       # seccomp_data.arch
        SockFilter(BPF_JEQ_K, 0, 5, AUDIT_ARCH_X86_64),
        SockFilter(BPF_LD_W_ABS, 0, 0, 0),                       # seccomp_data.nr
        SockFilter(BPF_JEQ_K, 0, 3, NR_ARCH_PRCTL),
        SockFilter(BPF_LD_W_ABS, 0, 0, 16),                      # args[0], low word
        SockFilter(BPF_JEQ_K, 0, 1, ARCH_REQ_XCOMP_PERM),
        SockFilter(BPF_RET_K, 0, 0, RET_EPERM),
        SockFilter(BPF_RET_K, 0, 0, RET_ALLOW),
    ]
    arr = (SockFilter * len(prog))(*prog)
    fprog = SockFprog(len(prog), arr)
    libc = ctypes.CDLL(None, use_errno=True)
    PR_SET_NO_NEW_PRIVS, PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 38, 22, 2
    if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0 or \
            libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(fprog), 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "cannot install the seccomp filter that denies AMX")


# ---- llama.cpp -----------------------------------------------------------------------------

def open_llama(path: str, n_ctx: int, n_threads: int = 2, extra_bufts: bool = True, n_batch: int = 64):
    """llama-cpp-python set up like our runtime: f16 KV cache, flash attention, all logits.
    extra_bufts=False turns off weight repacking (llama.cpp's --no-repack)."""
    import llama_cpp.llama_cpp as C
    from llama_cpp import Llama

    orig = C.llama_model_default_params

    def params():
        p = orig()
        p.use_extra_bufts = extra_bufts
        return p

    C.llama_model_default_params = params
    try:
        return Llama(path, n_ctx=n_ctx, n_batch=n_batch, n_ubatch=n_batch, logits_all=True, flash_attn=True,
                     type_k=1, type_v=1, n_threads=n_threads, verbose=False)
    finally:
        C.llama_model_default_params = orig


def _top2_gap(row) -> float:
    import numpy as np

    a, b = np.partition(np.asarray(row, np.float32), -2)[-2:]
    return float(abs(a - b))


def llama_greedy(path: str, prompts: list, n_new: int, n_ctx: int = 128) -> list:
    """Greedy continuations: per prompt {"tokens": [...], "gaps": [top-2 gap per step]}."""
    import numpy as np

    llm = open_llama(path, n_ctx)
    out = []
    for prompt in prompts:
        llm.reset()
        llm.eval(prompt)
        toks, gaps = [], []
        for _ in range(n_new):
            row = llm.scores[llm.n_tokens - 1]
            tok = int(np.argmax(row))
            toks.append(tok)
            gaps.append(_top2_gap(row))
            llm.eval([tok])
        out.append({"tokens": toks, "gaps": gaps})
    return out


# ---- our runtime -----------------------------------------------------------------------------

def ours_greedy(path: str, prompts: list, n_new: int, n_ctx: int = 128) -> list:
    from dflash_gguf.runtime.target import LOGITS_LAST, Target, TargetConfig

    out = []
    with Target(path, TargetConfig(n_ctx=n_ctx, n_ubatch=64, kv_type="f16", n_threads=2)) as t:
        for prompt in prompts:
            t.reset()
            t.prefill(prompt, LOGITS_LAST)
            toks, gaps = [], []
            for _ in range(n_new):
                tok = int(t.choices(0, 1)[0])
                toks.append(tok)
                gaps.append(_top2_gap(t.logits(0, 1)[0]))
                t.decode([tok], LOGITS_LAST)
            out.append({"tokens": toks, "gaps": gaps})
    return out


def ours_verify_vs_sequential(path: str, n_prefix: int, max_k: int, kv_type: str = "f32") -> dict:
    """For every chain length k in 1..max_k: max |verify row - the row single-token decoding
    gives|, and, after commit(j) for j in {0, k//2, k}, the same for decoding two more tokens.
    The reference is what plain greedy decoding does: the prefix prefilled, then one token
    per call."""
    import numpy as np

    from dflash_gguf.runtime.target import LOGITS_LAST, LOGITS_NONE, Target, TargetConfig

    cfg = TargetConfig(n_ctx=128, n_ubatch=64, n_verify=max_k, kv_type=kv_type, n_threads=2)
    rng = np.random.default_rng(70)
    out = {"rows": {}, "after_commit": {}, "argmax_equal": True, "greedy_equal": True}
    with Target(path, cfg) as t:
        prefix = rng.integers(0, t.n_vocab, size=n_prefix).tolist()
        cands = rng.integers(0, t.n_vocab, size=max_k).tolist()
        tail = rng.integers(0, t.n_vocab, size=2).tolist()

        def one_by_one(toks):
            rows = []
            for tok in toks:
                t.decode([tok], LOGITS_LAST)
                rows.append(t.logits(0, 1)[0])
            return np.stack(rows)

        t.prefill(prefix, LOGITS_NONE)
        seq = one_by_one(cands)
        after_ref = {}
        for j in range(max_k + 1):
            t.reset()
            t.prefill(prefix, LOGITS_NONE)
            if j:
                one_by_one(cands[:j])
            after_ref[j] = one_by_one(tail)
        for k in range(1, max_k + 1):
            for j in sorted({0, k // 2, k}):
                t.reset()
                t.prefill(prefix, LOGITS_NONE)
                t.verify(cands[:k])
                rows = t.logits(0, k)
                out["rows"][k] = max(out["rows"].get(k, 0.0), float(np.abs(rows - seq[:k]).max()))
                out["argmax_equal"] &= list(t.choices(0, k)) == list(np.argmax(rows, axis=1))
                out["greedy_equal"] &= list(t.choices(0, k)) == list(np.argmax(seq[:k], axis=1))
                t.commit(j)
                after = one_by_one(tail)
                key = f"{k}/{j}"
                out["after_commit"][key] = float(np.abs(after - after_ref[j]).max())
    return out


def _devices(endpoint):
    """The device list, after adding the RPC server at endpoint (None: local devices only)."""
    from dflash_gguf.runtime.devices import add_rpc_server, list_devices

    if endpoint:
        add_rpc_server(endpoint)
    return list_devices()


def offload_trace(endpoint, target_path: str, draft_path: str, placements: list, n_new: int = 48) -> dict:
    """For each placement {"device", "n_gpu_layers"[, "weight_buffer_mib"]}: the target's
    logits over a prefill, a chain verify and commit, a tree verify and path commit, and a
    decode after it, plus greedy plain, chain and tree generations of n_new tokens with the
    drafter on the same device. weight_buffer_mib caps the weight buffers of that load
    (DFLASH_WEIGHT_BUFFER_MIB)."""
    from dflash_gguf.runtime.drafter import Draft, DraftConfig, read_draft_metadata
    from helpers.loops import greedy_generate, speculative_generate, tree_generate
    from dflash_gguf.runtime.target import LOGITS_ALL, Target, TargetConfig

    devices = _devices(endpoint)
    layers = read_draft_metadata(draft_path)["target_layers"]
    prompt = [(7 * i + 3) % 200 for i in range(37)]
    out = {"devices": devices, "runs": []}
    for place in placements:
        os.environ.pop("DFLASH_WEIGHT_BUFFER_MIB", None)
        if "weight_buffer_mib" in place:
            os.environ["DFLASH_WEIGHT_BUFFER_MIB"] = str(place["weight_buffer_mib"])
        cfg = TargetConfig(n_ctx=256, n_ubatch=16, n_verify=16, kv_type="f32", feature_layers=layers,
                           device=place["device"], n_gpu_layers=place["n_gpu_layers"])
        with Target(target_path, cfg) as t, Draft(draft_path, t, DraftConfig(kv_type="f32", top_k=4)) as d:
            run = {"info": t.info(), "logits": []}
            t.prefill(prompt, LOGITS_ALL)
            run["logits"].append(t.logits(0, len(prompt) % 16).tolist())
            t.verify([5, 9, 11, 13])
            run["logits"].append(t.logits(0, 4).tolist())
            t.commit(2)
            t.verify_tree([17, 19, 23, 29, 31], [-1, 0, 0, 1, 2])
            run["logits"].append(t.logits(0, 5).tolist())
            t.commit_path([0, 2, 4])
            t.decode([37], LOGITS_ALL)
            run["logits"].append(t.logits(0, 1).tolist())
            t.reset()
            run["plain"] = greedy_generate(t, prompt, n_new)[0]
            t.reset()
            d.reset()
            run["chain"] = speculative_generate(t, d, prompt, n_new)[0]
            t.reset()
            d.reset()
            run["tree"] = tree_generate(t, d, prompt, n_new, budget=8)[0]
            out["runs"].append(run)
    return out


def checkpoint_trace(endpoint: str, target_path: str, draft_path: str, placement: dict, prompt: list, other: list,
                     cut: int, n_tokens: int, device_budget: int) -> dict:
    """On a target placed per {"device", "n_gpu_layers"} (its drafter on the same
    device): a cold chain generation after `prompt`, then the same after restoring the
    end of a chain of checkpoints of prompt[:cut] (one at cut // 2, one at cut on top of
    it) kept by a PrefixCheckpoints store with `device_budget` bytes of device memory,
    once `other` has been generated from. Reports what the store and the checkpoints
    hold where."""
    from dflash_gguf.runtime.checkpoints import PrefixCheckpoints, measure
    from dflash_gguf.runtime.devices import add_rpc_server
    from dflash_gguf.runtime.drafter import Draft, DraftConfig, read_draft_metadata
    from dflash_gguf.decoding.requests import GenerationStats, Placement, Request, collect
    from helpers.loops import prefill_prompt, speculative_steps
    from dflash_gguf.runtime.target import Target, TargetConfig

    add_rpc_server(endpoint)
    layers = read_draft_metadata(draft_path)["target_layers"]
    cfg = TargetConfig(n_ctx=512, n_ubatch=16, n_verify=16, n_threads=1, feature_layers=layers,
                       device=placement["device"], n_gpu_layers=placement["n_gpu_layers"])
    with Target(target_path, cfg) as t, Draft(draft_path, t, DraftConfig(window=placement.get("window", 0))) as d:
        def generate(tokens, reused=0):
            stats = GenerationStats()
            out = collect(speculative_steps(t, d, Request(tokens, n_tokens), stats, where=Placement(reused=reused)))
            return {"tokens": out, "accepted": stats.accepted_lengths, "reused": stats.reused_tokens}

        cold = generate(prompt)
        t.reset()
        d.reset()
        store = PrefixCheckpoints(1 << 30, every=cut // 2, device_budget_bytes=device_budget)
        measured = []
        prefill_prompt(t, prompt[:cut // 2], 0, d)
        measured.append(measure(t, d))
        store.save(prompt[:cut // 2], t, d)
        prefill_prompt(t, prompt[:cut], cut // 2, d)
        measured.append(measure(t, d, store.checkpoints()[0]))
        store.save(prompt[:cut], t, d)
        generate(other)
        end = store.lookup(prompt, cut, True)
        end.restore(t, d)
        kept = [{"n_past": c.n_past, "parent": c.parent_n_past, "device": c.device_bytes, "host": c.host_bytes}
                for c in store.checkpoints()]
        return {"info": t.info(), "cold": cold, "warm": generate(prompt, reused=cut), "kept": kept,
                "measured": measured, "store": {"device": store.device_nbytes, "host": store.host_nbytes}}


def greedy_on_devices(endpoint, target_path: str, draft_path: str, devices: list, prompts: list, n_new: int,
                      budget: int) -> dict:
    """Per device: plain, chain, chain cut by a p-min and tree greedy continuations of
    each prompt (matrices in file layout, f32 caches; the cut chain's drafter ranks inside
    its proposes, top_k 1), the last prompt row's logits, the device's default p-min, and
    ("<device> chain top_k") the top_k an Engine's chain drafter gets there."""
    from dflash_gguf.runtime.drafter import Draft, DraftConfig, read_draft_metadata
    from dflash_gguf.engine.engine import Engine
    from dflash_gguf.speculation.drafting import default_p_min
    from helpers.loops import greedy_generate, speculative_generate, tree_generate
    from dflash_gguf.runtime.target import LOGITS_LAST, Target, TargetConfig

    _devices(endpoint)
    meta = read_draft_metadata(draft_path)
    layers = meta["target_layers"]
    # an MTP drafter (draft_path: the target's own file) through the engine is --spec-type draft-mtp
    engine_drafter = {"spec_type": "draft-mtp"} if meta["kind"] == "mtp" else {"draft": draft_path}
    out = {}
    for dev in devices:
        cfg = TargetConfig(n_ctx=512, n_verify=budget + 1, kv_type="f32", feature_layers=layers, device=dev,
                           repack=False)
        with Target(target_path, cfg) as t, Draft(draft_path, t, DraftConfig(kv_type="f32", top_k=8)) as d, \
                Draft(draft_path, t, DraftConfig(kv_type="f32", top_k=1)) as d1:  # ranks inside its proposes
            runs = []
            for prompt in prompts:
                t.reset()
                t.prefill(prompt, LOGITS_LAST)
                logits = t.logits(0, 1)[0].tolist()
                t.reset()
                plain = greedy_generate(t, prompt, n_new)[0]
                t.reset()
                d.reset()
                chain = speculative_generate(t, d, prompt, n_new)[0]
                t.reset()
                d1.reset()
                cut = speculative_generate(t, d1, prompt, n_new, p_min=0.3)[0]
                t.reset()
                d.reset()
                tree = tree_generate(t, d, prompt, n_new, budget=budget)[0]
                runs.append({"plain": plain, "chain": chain, "cut": cut, "tree": tree, "logits": logits,
                             "default_p_min": default_p_min(t)})
            out[dev] = runs
        with Engine(target_path, n_ctx=256, device=dev, **engine_drafter) as engine:
            out[dev + " chain top_k"] = engine.draft.top_k
    return out


def engine_plain_greedy(endpoint, target_path: str, devices: list, prompt: str, n_new: int) -> dict:
    """Per device: the prompt's token ids and plain greedy continuation through the Engine
    with its defaults (f16 caches, the fused one-call decode), the path dflash-run takes."""
    from dflash_gguf.engine.engine import Engine

    _devices(endpoint)
    out = {}
    for dev in devices:
        with Engine(target_path, None, n_ctx=512, device=dev) as eng:
            out[dev] = {"prompt": list(eng.encode(prompt)),
                        "tokens": [int(t) for t in eng.generate(prompt, max_tokens=n_new, stop_tokens=()).tokens]}
    return out


def engine_modes_greedy(endpoint, target_path: str, draft_path: str, device: str, prompt: str, n_new: int) -> dict:
    """On one device, through the Engine with its defaults (f16 caches, graphs as
    shipped): plain, chain and tree greedy tokens of the demo pair."""
    from dflash_gguf.engine.engine import Engine

    _devices(endpoint)
    out = {}
    for mode, options in (("plain", {}), ("chain", {"draft": draft_path}), ("tree", {"draft": draft_path,
                                                                                   "tree_budget": 8})):
        draft = options.pop("draft", None)
        with Engine(target_path, draft, n_ctx=512, device=device, **options) as eng:
            out[mode] = [int(t) for t in eng.generate(prompt, max_tokens=n_new, stop_tokens=()).tokens]
    return out


def top2_gap_after(endpoint, target_path: str, device: str, tokens: list) -> float:
    """The gap between the two largest logits of the next token after `tokens`."""
    from dflash_gguf.runtime.target import LOGITS_LAST, Target, TargetConfig

    _devices(endpoint)
    with Target(target_path, TargetConfig(n_ctx=512, kv_type="f32", device=device, repack=False)) as t:
        t.prefill(tokens, LOGITS_LAST)
        return _top2_gap(t.logits(0, 1)[0])


def placement_trace(endpoint, target_path: str, draft_path: str, device: str) -> dict:
    """The scheduler's placement of every kind of graph a decode runs, target and
    drafter on `device` with every layer offloaded; sampled verifies and proposes too."""
    import numpy as np

    from dflash_gguf.runtime.drafter import Draft, DraftConfig, read_draft_metadata
    from dflash_gguf.decoding.sampling import SamplingParams
    from dflash_gguf.runtime.target import LOGITS_ALL, LOGITS_LAST, Target, TargetConfig

    _devices(endpoint)
    layers = read_draft_metadata(draft_path)["target_layers"]
    prompt = [(7 * i + 3) % 200 for i in range(37)]
    cfg = TargetConfig(n_ctx=256, n_ubatch=64, n_verify=16, kv_type="f16", feature_layers=layers, device=device)
    out = {}
    with Target(target_path, cfg) as t, Draft(draft_path, t, DraftConfig(top_k=8)) as d:
        t.prefill(prompt, LOGITS_LAST)
        out["target prefill"] = t.placement()
        d.append()
        out["drafter context append"] = d.placement()
        block = d.propose(int(t.choices(0, 1)[0]))
        out["drafter propose"] = d.placement()
        t.verify(block[:4])
        out["target chain verify"] = t.placement()
        t.commit(2)
        d.append()  # the drafter takes each call's kept positions before the next call replaces them
        t.verify_tree([17, 19, 23, 29, 31], [-1, 0, 0, 1, 2])
        out["target tree verify (+ chain commit)"] = t.placement()
        t.commit_path([0, 2, 4])
        d.append()
        t.decode([37], LOGITS_ALL)
        out["target decode (+ tree commit)"] = t.placement()
        d.append()
        # sampling on the device: top-k with penalties, no truncation, and drafted samples
        rng = np.random.default_rng(0)
        t.set_sampling(SamplingParams(0.7, 20, 0.9, presence_penalty=1.0).native())
        t.set_uniforms(rng.random(4, dtype=np.float32))
        t.set_penalties(np.array([[3, 5], [3, 7], [5, 9], [1, 2]], dtype=np.int32), np.ones((4, 2), dtype=np.float32))
        t.verify(block[:4])
        out["target sampled chain verify (top-k, penalties)"] = t.placement()
        t.commit(1)
        d.append()
        t.set_sampling(SamplingParams(1.0).native())
        t.set_uniforms(rng.random(5, dtype=np.float32))
        t.verify_tree([17, 19, 23, 29, 31], [-1, 0, 0, 1, 2])
        out["target sampled tree verify (no truncation)"] = t.placement()
        t.commit_path([0, 1])
        d.set_sampling(SamplingParams(0.7, 20).native(penalties=False))
        d.set_uniforms(rng.random(d.block_size - 1, dtype=np.float32))
        d.propose(41)
        out["drafter sampled propose"] = d.placement()
        # a grammar's masks: greedy (looked up at the rows' largest logits), then sampled as
        # short exception lists (rows keeping a few tokens, rows banning a few) and as masks
        # that take the dense path
        for name, mask, params in (("greedy", _mask_words(t.n_vocab, "lists"), SamplingParams()),
                                   ("sparse lists", _mask_words(t.n_vocab, "lists"), SamplingParams(1.0, 20)),
                                   ("dense", _mask_words(t.n_vocab, "dense"), SamplingParams(1.0, 20))):
            t.set_sampling(params.native())
            if params.temperature:
                t.set_uniforms(rng.random(4, dtype=np.float32))
            t.set_masks(mask)
            t.verify(block[:4])
            out[f"target masked chain verify ({name})"] = t.placement()
            t.commit(1)
    return out


def _mask_words(n_vocab: int, kind: str):
    """Allowed-token bitmasks of 4 rows: "lists" (rows 0 and 2 allow 3 tokens, rows 1 and 3
    all but 3, which the sampler applies as exception lists) or "dense" (every other
    nibble)."""
    import numpy as np

    words = (n_vocab + 31) // 32
    if kind == "dense":
        return np.full((4, words), 0x0F0F0F0F, dtype=np.uint32)
    allowed = np.ones((4, n_vocab), dtype=bool)
    allowed[[0, 2]] = False
    for r in range(4):
        allowed[r, [(r * 101 + 7 * j) % n_vocab for j in range(3)]] = r % 2 == 0
    padded = np.zeros((4, words * 32), dtype=bool)
    padded[:, :n_vocab] = allowed
    return np.packbits(padded.reshape(4, -1, 32)[:, :, ::-1], axis=2).view(">u4").astype(np.uint32)[..., 0]


def masked_on_devices(endpoint, target_path: str, devices: list, prompt: list) -> dict:
    """Per device and mask kind (see _mask_words): whether a sampled masked verify's logits
    are -inf exactly where its masks disallow and the free logits elsewhere (masked in
    place), or the free logits (the masks looked up at the rows' largest logits), and its
    choices the masked distribution's draws; whether a greedy one's choices are the masked
    argmax of the free logits (and its choices)."""
    import numpy as np

    from dflash_gguf.decoding.sampling import SamplingParams, distribution, draw
    from dflash_gguf.runtime.target import LOGITS_LAST, Target, TargetConfig

    _devices(endpoint)
    out = {}
    for device in devices:
        out[device] = {}
        with Target(target_path, TargetConfig(n_ctx=256, kv_type="f32", device=device, repack=False)) as t:
            for kind in ("lists", "dense"):
                mask = _mask_words(t.n_vocab, kind)
                bits = np.unpackbits(mask.astype(">u4").view(np.uint8), axis=1).reshape(4, -1, 32)[:, :, ::-1]
                allowed = bits.reshape(4, -1)[:, :t.n_vocab].astype(bool)
                runs = []
                greedy, sampled = SamplingParams(), SamplingParams(1.0, 20)
                for masks, params in ((None, greedy), (mask, greedy), (mask, sampled)):
                    t.reset()
                    t.set_sampling(SamplingParams().native())
                    t.prefill(prompt, LOGITS_LAST)
                    t.set_sampling(params.native())
                    if params.temperature:
                        t.set_uniforms(np.full(4, 0.5, dtype=np.float32))
                    if masks is not None:
                        t.set_masks(masks)
                    t.verify([11, 13, 17, 19])
                    runs.append((t.logits(0, 4), t.choices(0, 4).tolist()))
                (free, _), (_, choices), (masked, drawn) = runs
                in_place = np.all(np.isneginf(masked[~allowed])) and np.array_equal(masked[allowed], free[allowed])
                p = distribution(np.where(allowed, free, -np.inf), sampled)
                ranked = np.argsort(-p, axis=1, kind="stable")  # the device draws in the order of likelihood
                want = [int(ranked[r][draw(p[r, ranked[r]], 0.5)]) for r in range(4)]
                exact = bool((in_place or np.array_equal(masked, free)) and drawn == want
                             and choices == np.argmax(np.where(allowed, free, -np.inf), axis=1).tolist())
                out[device][kind] = {"exact": exact, "choices": choices}
    return out


def sampled_on_devices(endpoint, target_path: str, draft_path: str, devices: list, prompts: list, n_new: int,
                       budget: int) -> dict:
    """Per device and prompt: sampled continuations (seeded) in every mode: plain, the
    chain by either accept rule, the tree; at T 0.8 / top-k 20 / top-p 0.95 with a
    presence penalty, and at T 1 with no truncation."""
    from dataclasses import replace

    from dflash_gguf.runtime.drafter import Draft, DraftConfig, read_draft_metadata
    from dflash_gguf.decoding.sampling import SamplingParams
    from helpers.loops import greedy_generate, speculative_generate, tree_generate
    from dflash_gguf.runtime.target import Target, TargetConfig

    _devices(endpoint)
    layers = read_draft_metadata(draft_path)["target_layers"]
    settings = {"qwen+presence": SamplingParams(0.8, 20, 0.95, presence_penalty=0.5), "full": SamplingParams(1.0)}
    out = {}
    for dev in devices:
        cfg = TargetConfig(n_ctx=512, n_verify=budget + 1, kv_type="f32", feature_layers=layers, device=dev,
                           repack=False)
        with Target(target_path, cfg) as t, Draft(draft_path, t, DraftConfig(kv_type="f32", top_k=8)) as d:
            runs = []
            for k, prompt in enumerate(prompts):
                for name, params in settings.items():
                    params = replace(params, seed=k)
                    runs.append({
                        "setting": name,
                        "plain": greedy_generate(t, prompt, n_new, sampling=params)[0],
                        "chain": speculative_generate(t, d, prompt, n_new, sampling=params)[0],
                        "reject": speculative_generate(t, d, prompt, n_new, sampling=params, chain_rule="reject")[0],
                        "tree": tree_generate(t, d, prompt, n_new, budget=budget, sampling=params)[0],
                    })
            out[dev] = runs
    return out


def shape_model_steps(endpoint, path: str, device: str) -> dict:
    """A weightless published-shape model (convert.shape_model.write_header_only) on
    `device`: its memory plan, a short prefill, a chain verify and a decode, with the
    placement of each graph."""
    import numpy as np

    from dflash_gguf.engine.memory import plan_memory
    from dflash_gguf.runtime.target import LOGITS_LAST, Target, TargetConfig

    _devices(endpoint)
    cfg = TargetConfig(n_ctx=256, n_ubatch=8, n_verify=8, kv_type="f16", device=device)
    out = {"plan": plan_memory(path, None, cfg).to_json()}
    with Target(path, cfg) as t:
        out["info"] = t.info()
        t.prefill([1, 2, 3, 4, 5], LOGITS_LAST)
        out["prefill"] = t.placement()
        t.verify([6, 7, 8, 9])
        out["verify"] = t.placement()
        out["finite"] = bool(np.isfinite(t.logits(0, 4)).all())
        t.commit(4)
        t.decode([10], LOGITS_LAST)
        out["decode"] = t.placement()
        out["finite"] = out["finite"] and bool(np.isfinite(t.logits(0, 1)).all())
    return out


if __name__ == "__main__":  # the child of run_isolated
    # run as a file, which puts tests/helpers/ first on sys.path: tests/ goes there instead,
    # for the helpers' imports (helpers.loops, helpers.<module> of a "module:func")
    sys.path[0] = str(_HERE.parent)
    _child(sys.argv[1])
