"""The engine says whether its greedy speculation is exact where it runs (runtime/
exactness.py): "yes" on this patched x86 CPU, "no (why)" for a backend without the
patches or one whose probe finds a column rounding apart, "unverified (why)" where the
probe passes on a backend the project has not proven; `--exact require` refuses to start
on anything but yes, `--exact off` does not ask. The answer is cached per build, device,
types and rows."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from dflash_gguf import Engine
from dflash_gguf.runtime import exactness
from dflash_gguf.runtime.exactness import Exactness, probe_columns, weight_types
from dflash_gguf.tools import llama_cpp_tree
from helpers.cli_run import run
from helpers.paths import ROOT
from helpers.rpc_local import local_rpc_server

DATA = ROOT / "dflash_gguf" / "data"
TARGET, DRAFT = str(DATA / "demo-target.gguf"), str(DATA / "demo-draft.gguf")


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    """Each test asks afresh (the answers go to a cache of its own)."""
    monkeypatch.setenv("DFLASH_CACHE", str(tmp_path / "cache"))


def test_the_patched_cpu_is_exact_and_says_which_patch():
    """The CPU backend names its patch and the patch set's key; the key is the one our
    library was built for (CMakeLists.txt) and the one the set-up's sources carry
    (scripts/llama_cpp_sources.sh, dflash_gguf.tools.llama_cpp_tree)."""
    key = llama_cpp_tree.patch_key()
    assert exactness.built_for() == key
    assert exactness.backend_patch("CPU") == f"dflash-gguf batch-invariant CPU kernels, patches {key}"
    assert exactness.import_problem() is None
    with Engine(TARGET, DRAFT, n_threads=2) as engine:
        assert engine.exact == Exactness("yes")
        assert str(engine.exact) == "yes"


@pytest.mark.parametrize("named", ["000000000000", None])
def test_a_ggml_patched_from_another_patch_set_is_not_exact(monkeypatch, named):
    """A ggml built from an older set-up's patches (or a hand-patched one whose name has no
    key) is not taken for this build's: the answer names both keys and the remedy, and the
    check made at import says so too."""
    name = "dflash-gguf batch-invariant CPU kernels" + (f", patches {named}" if named else "")
    monkeypatch.setattr(exactness, "backend_patch", lambda device: name)
    why = (f"CPU: ggml carries batch-invariance patch set {named or 'unkeyed'}, this dflash-gguf is built for "
           f"{exactness.built_for()} (run scripts/setup.sh, or reinstall the package)")
    assert exactness.import_problem() == why
    with Engine(TARGET, DRAFT, n_threads=2) as engine:
        assert engine.exact == Exactness("no", why)


def test_importing_the_package_over_its_own_ggml_warns_of_nothing(tmp_path):
    """The import check is quiet where the patch is there (warnings as errors)."""
    res = subprocess.run([sys.executable, "-W", "error", "-c", "import dflash_gguf.runtime.exactness"],
                         capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert res.returncode == 0, res.stderr


def test_the_probe_covers_the_models_types_and_the_rows_a_step_allows():
    from gguf import GGMLQuantizationType as Q

    # the demo target: Q8_0 matrices, and f32 2D weights (the recurrent layers' short convolution)
    assert weight_types(TARGET) == [Q.F32, Q.Q8_0]
    assert probe_columns(1) == []
    assert probe_columns(16) == [2, 3, 4, 5, 8, 9, 16]
    assert probe_columns(20) == [2, 3, 4, 5, 8, 9, 16, 17, 20]
    assert probe_columns(256)[-1] == 256


def test_a_type_the_probe_cannot_make_is_unverified_and_integers_are_left_out(tmp_path):
    """IQ2_XXS needs an importance matrix to quantize: the probe cannot make it, and the
    answer says so; an integer tensor (never a product's matrix) is not a weight type."""
    from gguf import GGMLQuantizationType as Q

    answer = exactness.device_exactness("CPU", [Q.Q8_0, Q.IQ2_XXS], 4)
    assert answer == Exactness("unverified", "CPU: IQ2_XXS weights are not probed")
    assert Q.I32 in exactness.INTEGER and Q.I32 not in exactness.PROBED


def test_a_stock_backend_is_not_exact_and_require_refuses_it(monkeypatch):
    """A ggml without the patches (a later `pip install -U llama-cpp-python`): its CPU
    backend names no patch, and the engine says so; --exact require refuses to load."""
    monkeypatch.setattr(exactness, "backend_patch", lambda device: None)
    assert exactness.import_problem() == "CPU: ggml without the batch-invariance patch"
    with Engine(TARGET, DRAFT, n_threads=2) as engine:
        assert engine.exact == Exactness("no", "CPU: ggml without the batch-invariance patch")
    from dflash_gguf.runtime.errors import ConfigError

    with pytest.raises(ConfigError, match=r"exact: no \(CPU: ggml without the batch-invariance patch\).*--device CPU"):
        Engine(TARGET, DRAFT, n_threads=2, exact="require")


def test_a_column_rounding_apart_is_named_with_its_type_and_columns(monkeypatch):
    """What the probe finds is what the answer says: the type and the column count."""
    monkeypatch.setattr(exactness, "matmul_invariance",
                        lambda t, w, x, **kw: (1 if len(x) >= 3 else 0, 0.5))
    with Engine(TARGET, DRAFT, n_threads=2) as engine:
        assert engine.exact.exact == "no"
        assert engine.exact.why.startswith("CPU: ") and engine.exact.why.endswith(" at 3 columns"), engine.exact


LAVAPIPE = "llvmpipe (LLVM 15.0.6, 256 bits)"


@pytest.mark.parametrize("step, why", [
    (exactness.Step("qwen2"), None),
    (exactness.Step("gemma3"), None),
    (exactness.Step("qwen35"), None),
    (exactness.Step("qwen2", ("q8_0", "q8_0")), "a tree row's attention over a q8_0/q8_0 cache takes ggml-vulkan's "
                                                "stock kernel; an f16 cache (-ctk f16 -ctv f16) is shown exact"),
    (exactness.Step("qwen2", ("f16", "q4_0")), "a tree row's attention over a f16/q4_0 cache takes ggml-vulkan's "
                                               "stock kernel; an f16 cache (-ctk f16 -ctv f16) is shown exact"),
    (exactness.Step("qwen35moe", experts=True), "expert products (mul_mat_id) keep ggml-vulkan's stock kernels"),
    (exactness.Step("llama"), "llama is not shown exact on lavapipe (shown: gemma3, qwen2, qwen35)"),
])
def test_lavapipe_is_proven_for_what_was_shown_there_and_says_what_was_not(step, why):
    """Vulkan on lavapipe is "yes" for the architectures whose modes were shown there, over
    an f16 cache without experts; anything else names what was not shown. The CPU on x86
    is proven for every step, a remote backend or another GPU for none."""
    assert exactness.unproven("Vulkan0", LAVAPIPE, False, step) == why
    assert exactness.unproven("CPU", "", False, step) is None
    assert exactness.unproven("RPC0", "", True, step) == "a remote backend"
    assert exactness.unproven("Vulkan0", "NVIDIA GeForce RTX 3090", False, step) == \
        "this backend's whole step is not yet proven (docs/exactness.md)"


def test_the_step_is_read_from_the_file():
    assert exactness.Step.of(TARGET) == exactness.Step("qwen35", ("f16", "f16"), False)
    assert exactness.Step.of(TARGET, "q8_0", "f16").kv_types == ("q8_0", "f16")


def test_plain_decoding_of_one_sequence_has_nothing_to_round_apart():
    with Engine(TARGET, n_threads=2) as engine:
        assert engine.exact == Exactness("yes", "one row a step: nothing to round apart")


def test_a_remote_backend_that_passes_the_probe_is_unverified(tmp_path):
    """An RPC server over this CPU: in a process of its own, since a registered RPC device
    outlives its server in the registry, and ggml's client aborts on a dead one."""
    code = ("import json, sys; from dflash_gguf.runtime.devices import add_rpc_server, list_devices; "
            "from dflash_gguf.runtime import exactness as e; add_rpc_server(sys.argv[1]); "
            "rpc = next(d['name'] for d in list_devices() if d['name'].startswith('RPC')); "
            "print(json.dumps([rpc, e.device_exactness(rpc, e.weight_types(sys.argv[2]), 16).as_dict()]))")
    for endpoint in local_rpc_server():
        res = subprocess.run([sys.executable, "-c", code, endpoint, TARGET], capture_output=True, text=True,
                             timeout=300, cwd=tmp_path)
        assert res.returncode == 0, res.stderr
        rpc, answer = json.loads(res.stdout.strip().splitlines()[-1])
        assert answer["exact"] == "unverified" and answer["why"].startswith(f"{rpc}: the matrix probe passes"), answer


def test_the_answer_is_cached_per_build_device_types_and_rows(monkeypatch):
    with Engine(TARGET, DRAFT, n_threads=2) as engine:
        types = weight_types(TARGET)
    cache = json.loads((exactness.cache_dir() / "exactness.json").read_text())
    assert list(cache.values()) == [{"exact": "yes", "why": ""}]
    asked = []
    monkeypatch.setattr(exactness, "probe", lambda *a, **k: asked.append(a))
    t0 = time.perf_counter()
    step = exactness.Step.of(TARGET)
    assert exactness.device_exactness("CPU", types, engine.target.n_verify, step=step) == Exactness("yes")
    assert time.perf_counter() - t0 < 0.5 and not asked  # read, not probed
    exactness.device_exactness("CPU", types, 7, step=step)  # other rows: asked again
    assert len(asked) == 1
    exactness.device_exactness("CPU", types, 7, step=exactness.Step.of(TARGET, "q8_0"))  # another cache: again
    assert len(asked) == 2


def test_off_does_not_ask_and_a_bad_mode_is_refused(monkeypatch):
    monkeypatch.setattr(exactness, "probe", lambda *a, **k: pytest.fail("--exact off asked"))
    with Engine(TARGET, DRAFT, n_threads=2, exact="off") as engine:
        assert engine.exact == Exactness("unverified", "not checked: --exact off")
    from dflash_gguf.runtime.errors import ConfigError

    with pytest.raises(ConfigError, match="exact must be one of report, require, off"):
        Engine(TARGET, DRAFT, n_threads=2, exact="maybe")


def test_dflash_run_reports_it_and_require_starts_where_it_holds():
    res = run("-n", "8", "--json", "--exact", "require")
    assert res.returncode == 0, res.stderr
    report = json.loads(res.stderr.strip().splitlines()[-1])
    assert report["exact"] == "yes"
    res = run("-n", "8", "--exact", "off")
    assert res.returncode == 0 and "exact     unverified (not checked: --exact off)" in res.stderr, res.stderr
    res = run("-n", "8", "--exact", "sometimes")
    assert res.returncode == 2 and "--exact" in res.stderr


@pytest.mark.device
def test_the_device_under_test_says_whether_it_is_exact(tmp_path):
    """On the device under test (scripts/test-vulkan.sh: lavapipe): ggml-vulkan with the
    project's patch 0003 is probed and passes, and lavapipe is shown exact for the demo's
    architecture over an f16 cache (the engine's default): yes; over a q8_0 cache a tree
    row's attention is stock: unverified, naming the cache. Under GGML_VK_BATCH_VARIANT
    (ggml's stock kernel choices) the backend names no patch, and the engine says no at
    once, without probing. A CUDA build with 0004 is probed and at best unverified."""
    device = os.environ.get("DFLASH_TEST_DEVICE")
    if not device:
        pytest.skip("no device under test (DFLASH_TEST_DEVICE)")
    with Engine(TARGET, DRAFT, device=device, n_threads=2) as engine:
        answer = engine.exact
    print(f"\n[exact on {device}: {answer}]")
    if device.startswith("Vulkan"):
        assert exactness.backend_patch(device) == \
            f"dflash-gguf batch-invariant Vulkan kernels, patches {llama_cpp_tree.patch_key()}"
        assert answer == Exactness("yes"), answer
        with Engine(TARGET, DRAFT, device=device, n_threads=2, kv_type="q8_0") as engine:
            answer = engine.exact
        assert answer.exact == "unverified" and "the matrix probe passes" in answer.why \
            and "q8_0/q8_0 cache" in answer.why, answer
        stock = subprocess.run([sys.executable, "-c", STOCK_ANSWER, device], capture_output=True, text=True,
                               env={**os.environ, "GGML_VK_BATCH_VARIANT": "1"}, cwd=tmp_path, timeout=600)
        assert stock.returncode == 0, stock.stderr
        assert stock.stdout.strip().splitlines()[-1] == f"no ({device}: ggml without the batch-invariance patch)"
    else:
        assert answer.exact in ("no", "unverified") and answer.why.startswith(device), answer


# the engine's answer in a process of its own (a backend reads its environment once)
STOCK_ANSWER = f"""
import sys
from dflash_gguf import Engine
with Engine({TARGET!r}, {DRAFT!r}, device=sys.argv[1], n_threads=2) as engine:
    print(engine.exact)
"""
