#!/usr/bin/env python3
"""Record in drafter GGUFs the context they were trained on (<arch>.train_context_length),
which `--draft-window auto` takes as the drafter's window. dflash-train and
training/train_demo.py write the key themselves; this adds it to files made before they
did (the bundled demo drafters: 256-token windows), every other key and tensor as it was.

    .venv/bin/python training/stamp_train_window.py --window 256 \\
        dflash_gguf/data/demo-draft.gguf dflash_gguf/data/demo-draft-weak.gguf
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import gguf
from gguf.scripts.gguf_new_metadata import MetadataDetails, copy_with_new_metadata


def stamp(path: Path, window: int) -> None:
    reader = gguf.GGUFReader(path)
    arch = reader.fields["general.architecture"].contents()
    tmp = path.with_name(path.name + ".tmp")
    writer = gguf.GGUFWriter(tmp, arch=arch, endianess=reader.endianess)
    copy_with_new_metadata(reader, writer, {f"{arch}.train_context_length":
                                            MetadataDetails(gguf.GGUFValueType.UINT32, window)}, [])
    tmp.replace(path)  # whole or not at all


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--window", type=int, required=True, help="the training window in tokens")
    p.add_argument("files", nargs="+", type=Path)
    args = p.parse_args(argv)
    if args.window <= 0:
        p.error(f"--window {args.window}: a positive number of tokens")
    for path in args.files:
        stamp(path, args.window)
    return 0


if __name__ == "__main__":
    sys.exit(main())
