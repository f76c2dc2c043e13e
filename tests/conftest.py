"""Session-wide fixtures: tiny checkpoints and their GGUF conversions, built once, and
the fixtures many modules share (`pair`, `rpc_endpoint`).

The test modules are grouped by layer: tests/convert (HF checkpoints to GGUF, re-typing,
hostile files), tests/runtime (targets, memory, sampling, grammars, devices, parity),
tests/drafters (every drafter kind, chains, trees, training), tests/serving (dflash-run,
dflash-server, chat formats) and tests/bench (dflash-bench, results files). The helpers
they share are the package tests/helpers (`from helpers.parity import first_divergence`,
`from helpers import gguf_fuzz`), imported from tests/, which pytest puts on sys.path for
this file (its default import mode, prepend: tests/ has no __init__.py); a test module
imports helpers only, never another test module. The published models' tests carry the
`real` marker (pytest -m real), the device tests the `device` marker.

tests/helpers/fixtures.py (torch, transformers) is imported by the fixtures that use it,
not here: the device tests (tests/runtime/test_devices.py) run where neither is
installed, such as the lent GPU machine (scripts/cuda/test.sh)."""
from __future__ import annotations

import os
from pathlib import Path

import pytest


def pytest_configure(config):
    from helpers.demo_hf import unpack

    unpack()
    # what `auto` learnt stays out of the user's cache, and no test starts from what an
    # earlier one learnt (tests/drafters/test_draft_simple.py turns it on where it is the subject)
    os.environ["DFLASH_AUTO_MEMORY"] = "off"


def pytest_addoption(parser):
    parser.addoption("--device-under-test", default=None,
                     help="ggml device for the tests marked `device` (default: $DFLASH_TEST_DEVICE, else RPC: "
                          "a local ggml RPC server serving the CPU backend)")
    parser.addoption("--full", action="store_true",
                     help="also run the cases of the heavy matrices marked `full` (CI leaves them out)")
    parser.addoption("--fuzz-count", type=int, default=64,
                     help="mutants of the GGUF fuzz run in tests/convert/test_fuzz_gguf.py (default 64)")
    parser.addoption("--fuzz-seed", type=int, default=14, help="seed of that run (default 14)")
    parser.addoption("--fuzz-only", type=int, action="append",
                     help="run only this mutant of --fuzz-seed (repeatable): a failure's replay")


def pytest_collection_modifyitems(config, items):
    if config.getoption("--full"):
        return
    kept = [item for item in items if item.get_closest_marker("full") is None]
    if len(kept) < len(items):
        config.hook.pytest_deselected(items=[item for item in items if item.get_closest_marker("full")])
        items[:] = kept


@pytest.fixture(scope="session")
def qwen35_dir(tmp_path_factory):
    """qwen35_dir(shape_name) -> checkpoint directory for a QWEN35_SHAPES entry."""
    from helpers.fixtures import QWEN35_SHAPES, make_qwen35

    root = tmp_path_factory.mktemp("qwen35")
    built: dict[str, Path] = {}

    def get(shape: str) -> Path:
        if shape not in built:
            built[shape] = make_qwen35(root / shape, **QWEN35_SHAPES[shape])
        return built[shape]

    return get


@pytest.fixture(scope="session")
def convert_model(tmp_path_factory):
    """convert_model(model_dir, outtype, *extra_args) -> GGUF path, converted once per session
    with dflash_gguf.convert.cli.main."""
    from dflash_gguf.convert.cli import main

    root = tmp_path_factory.mktemp("gguf")
    done: dict[tuple, Path] = {}

    def convert(model_dir: Path, outtype: str = "f32", *extra: str) -> Path:
        key = (str(model_dir), outtype, extra)
        if key not in done:
            out = root / f"{Path(model_dir).name}-{outtype}-{len(done)}.gguf"
            rc = main([str(model_dir), "--outfile", str(out), "--outtype", outtype, *extra])
            assert rc == 0, f"conversion of {model_dir} to {outtype} failed with exit code {rc}"
            done[key] = out
        return done[key]

    return convert


@pytest.fixture(scope="session")
def llama_cpp_oracle():
    """() -> one LlamaCppConverter for the whole session, started on first use (torch and
    transformers are imported once). Skips when the llama.cpp sources are missing (fails
    under CI=true)."""
    from helpers.fixtures import LlamaCppConverter, llama_cpp_source, missing_oracle

    if llama_cpp_source() is None:
        missing_oracle("llama.cpp's sources (the llama-cpp-python sdist)")
    started: list[LlamaCppConverter] = []

    def get() -> LlamaCppConverter:
        if not started:
            started.append(LlamaCppConverter())
        return started[0]

    yield get
    for oracle in started:
        oracle.close()


@pytest.fixture(scope="session")
def llama_cpp_convert(tmp_path_factory, llama_cpp_oracle):
    """llama_cpp_convert(model_dir, outtype) -> GGUF written by llama.cpp's own converter.

    Skips when the llama.cpp sources are missing (fails under CI=true).
    """
    root = tmp_path_factory.mktemp("llama_cpp_gguf")
    done: dict[tuple, Path] = {}

    def convert(model_dir: Path, outtype: str = "f32", pre: str = "qwen35") -> Path:
        key = (str(model_dir), outtype, pre)
        if key not in done:
            out = root / f"{Path(model_dir).name}-{outtype}-{len(done)}.gguf"
            done[key] = llama_cpp_oracle().convert(model_dir, out, outtype, pre=pre)
        return done[key]

    return convert


@pytest.fixture(scope="session")
def llama_cpp_convert_dflash(tmp_path_factory, llama_cpp_oracle):
    """llama_cpp_convert_dflash(draft_dir, target_dir, outtype) -> drafter GGUF written by
    llama.cpp's own converter (tokenizer from the target, pre-tokenizer qwen35)."""
    root = tmp_path_factory.mktemp("llama_cpp_dflash_gguf")
    done: dict[tuple, Path] = {}

    def convert(draft_dir: Path, target_dir: Path, outtype: str = "f32") -> Path:
        key = (str(draft_dir), str(target_dir), outtype)
        if key not in done:
            out = root / f"{Path(draft_dir).name}-{outtype}-{len(done)}.gguf"
            done[key] = llama_cpp_oracle().convert(draft_dir, out, outtype, pre="qwen35",
                                                   extra_args=("--target-model-dir", str(target_dir)))
        return done[key]

    return convert


@pytest.fixture(scope="session")
def published_template():
    """published_template(name) -> the source of models/templates/<name>.jinja, a chat
    template as its model publishes it, from the pinned llama.cpp sources."""
    from helpers.fixtures import llama_cpp_source, missing_oracle

    src = llama_cpp_source()
    if src is None:
        missing_oracle("llama.cpp's sources (the llama-cpp-python sdist)")
    return lambda name: (src / "models" / "templates" / f"{name}.jinja").read_text(encoding="utf-8")


@pytest.fixture(scope="session")
def real_path():
    """real_path(name) -> the published file: skipped when not fetched, fetched (and any
    failure raised) under CI=true."""
    import os

    from dflash_gguf.tools import real_models

    def get(name: str):
        if os.environ.get("CI", "").lower() == "true":
            return real_models.path(name)
        found = real_models.cached(name)
        if found is None:
            pytest.skip(f"{name} is not fetched: run `python -m dflash_gguf.tools.real_models {name}`")
        return found

    return get


@pytest.fixture(scope="module")
def pair(tmp_path_factory, convert_model):
    """The tiny random Qwen3.5 target and its DFlash drafter (blocks of
    decoding_checks.BLOCK), as checkpoints and GGUFs (the drafter through llama.cpp's
    converter). A module that needs another pair defines its own `pair`."""
    from helpers.decoding_checks import BLOCK
    from helpers.draft_fixtures import convert_dflash_llama_cpp, make_dflash
    from helpers.fixtures import make_qwen35

    root = tmp_path_factory.mktemp("pair")
    target_dir = make_qwen35(root / "target", hidden=128, layers=4, seed=3)
    draft_dir = make_dflash(root / "draft", target_dir, target_layer_ids=(0, 2), block_size=BLOCK, seed=4)
    return {
        "target_dir": target_dir,
        "draft_dir": draft_dir,
        "target": convert_model(target_dir, "f32"),
        "draft": convert_dflash_llama_cpp(draft_dir, target_dir, root / "draft-f32.gguf"),
    }


@pytest.fixture(scope="module")
def rpc_endpoint():
    """host:port of a ggml RPC server serving the CPU backend (rpc_local)."""
    from helpers.rpc_local import local_rpc_server

    yield from local_rpc_server()
