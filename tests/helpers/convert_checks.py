"""What the converter tests share: checkpoint copies with an edited config, libllama's
loader, and a conversion's one clear error line."""
from __future__ import annotations

import json
import os
from pathlib import Path
from dflash_gguf.convert.cli import main


def variant(src: Path, dst: Path, edit=None) -> Path:
    """A copy of a checkpoint directory (files symlinked) with config.json edited."""
    dst.mkdir()
    for f in Path(src).iterdir():
        if f.name != "config.json":
            os.symlink(f.resolve(), dst / f.name)
    cfg = json.loads((Path(src) / "config.json").read_text())
    if edit:
        edit(cfg)
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    return dst


def libllama_model(path: Path):
    """libllama's model loader (weights, no context). llama-cpp-python's `Llama` cannot open
    a dflash file at all, not even vocab-only: it always creates a context, and a dflash
    context needs its target's (`ctx_other`)."""
    import llama_cpp
    from llama_cpp._internals import LlamaModel

    return LlamaModel(path_model=str(path), params=llama_cpp.llama_model_default_params(), verbose=False)


def linked_copy(src: Path, dst: Path) -> Path:
    """A copy of a checkpoint directory whose files are symlinks (edit by replacing)."""
    dst.mkdir()
    for f in Path(src).iterdir():
        os.symlink(f.resolve(), dst / f.name)
    return dst


def edit_config(model: Path, edit) -> None:
    cfg = json.loads((model / "config.json").read_text())
    edit(cfg)
    (model / "config.json").unlink()
    (model / "config.json").write_text(json.dumps(cfg))


def convert(model: Path, out: Path, capsys, *extra) -> tuple[int, str]:
    rc = main([str(model), "--outfile", str(out), "--outtype", "f32", *extra])
    return rc, capsys.readouterr().err


def assert_one_clear_line(rc: int, err: str, out: Path, needle: str, code: int = 2) -> None:
    assert rc == code, err
    assert "Traceback" not in err
    errors = [ln for ln in err.splitlines() if ln.startswith("ERROR:")]
    assert len(errors) == 1, err
    assert needle in errors[0], errors[0]
    assert not out.exists() and not out.with_name(out.name + ".partial").exists()
