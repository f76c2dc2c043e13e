"""The drafter kinds as the C registry (csrc/models/drafters.def) gives them to Python:
llama.cpp's --spec-type names in their order, what each kind's file is, and the rule
that picks a file's kind, the same on both sides (a DSpark drafter is a dflash GGUF with
a Markov head)."""
from __future__ import annotations

import pytest

from dflash_gguf.engine import setup as config
from dflash_gguf.runtime.drafter import read_draft_metadata
from dflash_gguf.runtime.drafter_kinds import BY_SPEC_TYPE, DRAFTERS, listed, reading

from helpers.paths import ROOT

DEMO_DRAFT = str(ROOT / "dflash_gguf" / "data" / "demo-draft.gguf")


def test_the_registry_gives_llama_cpp_names_in_spec_type_order():
    assert config.DRAFTER_KINDS == ("draft-dflash", "draft-mtp", "draft-eagle3", "draft-dspark", "draft-simple")
    assert config.FILE_KINDS == {"draft-dflash": "dflash", "draft-eagle3": "eagle3", "draft-dspark": "dspark"}
    assert config.FILE_KIND_NAMES == {"dflash": "a DFlash drafter", "eagle3": "an EAGLE3 drafter",
                                      "dspark": "a DSpark drafter"}
    assert config.AUTOREGRESSIVE == ("mtp", "eagle3")
    assert list(config.TARGET_KINDS) == ["draft-mtp"] and BY_SPEC_TYPE["draft-mtp"].archs == ("qwen35", "qwen35moe")
    assert all(k.spec_type == f"draft-{k.name}" and k.help for k in DRAFTERS)


def test_a_marker_decides_between_kinds_of_one_architecture():
    assert reading("dflash", lambda: ("markov_w1.weight",)).name == "dspark"
    assert reading("dflash", lambda: ()).name == "dflash"
    assert reading("qwen35moe", pytest.fail).name == "mtp"  # no marker to look for: the tensors are not read
    assert reading("qwen3", pytest.fail) is None


def test_python_and_the_runtime_pick_the_same_kind(tmp_path):
    from dflash_gguf.tools.demo_dspark import make_dspark

    dspark = tmp_path / "dspark.gguf"
    make_dspark(dspark)
    for path, kind in ((DEMO_DRAFT, "dflash"), (str(dspark), "dspark")):
        assert config._gguf_arch_and_keys(path)[2] == kind == read_draft_metadata(path)["kind"]


def test_listed():
    assert (listed(["a"]), listed(["a", "b"]), listed(["a", "b", "c"], "and")) == ("a", "a or b", "a, b and c")
