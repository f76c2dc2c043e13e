"""convert-hf-to-gguf: convert a Hugging Face checkpoint directory to one GGUF file.

    convert-hf-to-gguf ./Qwen3.5-27B --outtype q4_k_m --outfile target.gguf
    convert-hf-to-gguf ./Qwen3.5-27B-DFlash --target-model-dir ./Qwen3.5-27B --outtype q8_0 --outfile draft.gguf
    convert-hf-to-gguf ./Qwen3.5-27B-EAGLE3 --target-model-dir ./Qwen3.5-27B --outtype q8_0 --outfile eagle3.gguf

Exit codes: 0 success, 2 bad input or options (a message, no traceback), 1 an unforeseen
failure (one line; DFLASH_DEBUG=1 shows the traceback), 130 interrupted. Only a complete
file ever appears under the output name.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from gguf import GGML_QUANT_VERSION, LlamaFileType, size_label

from .base import KV, string, u32
from .errors import ConversionError
from .hf import Checkpoint, load_config, quantization_method
from .quant import OUTTYPES, plan_types, tensor_bytes
from .registry import converter_for
from .vocab.load import load_vocab

log = logging.getLogger("dflash_gguf.convert")


class _StderrHandler(logging.Handler):
    """Writes to whatever sys.stderr is at the time (pytest swaps it per test)."""

    def emit(self, record: logging.LogRecord) -> None:
        print(self.format(record), file=sys.stderr)


def _setup_logging() -> None:
    if not any(isinstance(h, _StderrHandler) for h in log.handlers):
        handler = _StderrHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s: %(message)s"))
        log.addHandler(handler)
    log.setLevel(logging.INFO)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="convert-hf-to-gguf",
        description="Convert a Hugging Face safetensors checkpoint to GGUF (llama.cpp conventions).")
    p.add_argument("model_dir", type=Path, help="checkpoint directory (config.json, *.safetensors, tokenizer), "
                   "or a GGUF file to re-type to --outtype")
    p.add_argument("--outfile", type=Path,
                   help="output file (default: ./<model dir name>-<OUTTYPE>.gguf)")
    p.add_argument("--outtype", choices=list(OUTTYPES), default="f16",
                   help="tensor types: plain (f32, f16, bf16, q8_0, q4_0) or a llama.cpp mix "
                        "(q4_k_m, q5_k_m, q6_k; mxfp4_moe: experts MXFP4, other matrices q8_0); default f16. "
                        "A checkpoint's MXFP4 experts (gpt-oss) stay MXFP4 whatever the type")
    p.add_argument("--target-model-dir", type=Path, metavar="DIR",
                   help="for a drafter (DFlash, EAGLE3; required): the target model's checkpoint directory, "
                        "whose tokenizer the drafter uses and against which it is checked")
    p.add_argument("--pre", metavar="NAME",
                   help="llama.cpp pre-tokenizer name (tokenizer.ggml.pre); overrides detection")
    p.add_argument("--name", help="general.name (default: the model directory name)")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, metavar="N",
                   help="threads for reading and quantizing (default: all cores)")
    p.add_argument("--no-mtp", action="store_true",
                   help="leave out the multi-token-prediction layers (Qwen3.5/3.6 mtp.*), which are otherwise "
                        "kept as llama.cpp's nextn layers after the model's own")
    p.add_argument("--allow-requantize", action="store_true",
                   help="with a GGUF as input: re-type tensors that are already quantized (refused by default)")
    p.add_argument("--dry-run", action="store_true", help="print the tensor plan and write nothing")
    p.add_argument("--force", action="store_true", help="overwrite an existing output file")
    p.add_argument("--allow-nan", action="store_true",
                   help="write NaN/Inf weights instead of refusing the checkpoint (they are listed either way)")
    return p


def _fmt_bytes(n: float) -> str:
    if n < 1024:
        return f"{n:.0f} B"
    for unit in ("KiB", "MiB"):
        n /= 1024
        if n < 1024:
            return f"{n:.1f} {unit}"
    return f"{n / 1024:.1f} GiB"


def main(argv: list[str] | None = None) -> int:
    _setup_logging()
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as e:  # argparse: 2 on bad options, 0 after --help
        return e.code if isinstance(e.code, int) else 0
    try:
        return _run(args)
    except ConversionError as e:
        log.error("%s", e)
        return 2
    except KeyboardInterrupt:
        log.error("interrupted; no output file was written")
        return 130
    except Exception as e:  # noqa: BLE001 - a checkpoint we did not foresee: one line, not a traceback
        if os.environ.get("DFLASH_DEBUG"):
            raise
        log.error("conversion failed: %s: %s (set DFLASH_DEBUG=1 for the traceback)", type(e).__name__, e)
        return 1


def _run(args: argparse.Namespace) -> int:
    model_dir: Path = args.model_dir
    if model_dir.is_file() and model_dir.suffix == ".gguf":
        return _retype(args)
    config = load_config(model_dir)
    converter_cls = converter_for(config)
    quant = quantization_method(config)
    if quant is not None and quant not in converter_cls.quantizations:
        accepted = f" ({', '.join(converter_cls.quantizations)} as published)" if converter_cls.quantizations else ""
        raise ConversionError(f"config.json's quantization_config says the checkpoint is quantized with {quant!r}, "
                              f"which this converter does not read{accepted}; convert the bf16/f16/f32 weights")
    outfile: Path = args.outfile or Path(f"{model_dir.resolve().name}-{args.outtype.upper()}.gguf")
    if not args.dry_run:
        if outfile.exists() and not args.force:
            raise ConversionError(f"{str(outfile)!r} already exists; pass --force to overwrite it")
        if outfile.is_dir():
            raise ConversionError(f"{str(outfile)!r} is a directory")
        if not outfile.parent.resolve().is_dir():
            raise ConversionError(f"the output directory {str(outfile.parent)!r} does not exist")

    target_dir: Path | None = args.target_model_dir
    if converter_cls.needs_target:
        if target_dir is None:
            raise ConversionError(
                f"{model_dir} is a drafter ({', '.join(config.get('architectures') or [])}): it uses its target's "
                "tokenizer and embeddings, so pass --target-model-dir with the target model's checkpoint directory")
        if not target_dir.is_dir():
            raise ConversionError(f"--target-model-dir {str(target_dir)!r} is not a directory")
    elif target_dir is not None:
        raise ConversionError(f"--target-model-dir is for drafters; {model_dir} is a "
                              f"{converter_cls.gguf_arch} model, which converts on its own")

    checkpoint = Checkpoint(model_dir)
    mtp = {"no_mtp": args.no_mtp} if converter_cls.has_mtp else {}  # --no-mtp means nothing to the others
    converter = converter_cls(model_dir, config, checkpoint, target_dir=target_dir, **mtp)
    for what, count in converter.skipped().items():
        log.info("skipping %d tensor%s: %s", count, "" if count == 1 else "s", what)
    vocab_dir, vocab_config = converter.vocab_source()
    vocab = load_vocab(vocab_dir, vocab_config, converter.vocab_size, args.pre)
    converter.adjust_vocab(vocab)
    log.info("pre-tokenizer %r (from %s%s)", vocab.pre, vocab.pre_source,
             f", tokenizer of {vocab_dir}" if vocab_dir != model_dir else "")

    specs = converter.tensors()
    types = plan_types([(s.name, s.shape) for s in specs], args.outtype)
    types.update({s.name: s.fixed_type for s in specs if s.fixed_type is not None})
    plan = [(s, types[s.name]) for s in specs]
    n_params = sum(s.numel for s in specs)
    file_type = OUTTYPES[args.outtype][0]
    if quant == "mxfp4" and file_type in (LlamaFileType.ALL_F32, LlamaFileType.MOSTLY_F16, LlamaFileType.MOSTLY_BF16):
        file_type = LlamaFileType.MOSTLY_MXFP4_MOE  # llama.cpp's converter says so of a float file with MXFP4 experts
    kvs: list[KV] = [
        string("general.type", "model"),
        string("general.name", args.name or model_dir.resolve().name),
        string("general.size_label", size_label(n_params, 0, 0, 0)),
        *converter.metadata(),
        u32("general.file_type", int(file_type)),
        u32("general.quantization_version", GGML_QUANT_VERSION),
        *vocab.metadata(),
    ]
    total = sum(tensor_bytes(t, s.shape) for s, t in plan)

    if args.dry_run:
        _print_plan(plan, args.outtype, total, n_params, len(kvs))
        return 0

    from .writer import write_gguf

    log.info("writing %s: %d tensors, %s, %s", outfile, len(plan), _fmt_bytes(total), args.outtype)
    size = write_gguf(outfile, converter.gguf_arch, kvs, plan, checkpoint, threads=max(1, args.threads),
                      allow_nan=args.allow_nan)
    log.info("wrote %s (%s)", outfile, _fmt_bytes(size))
    return 0


def _retype(args: argparse.Namespace) -> int:
    """A GGUF in, the same model re-typed out (convert/retype.py)."""
    from .retype import retype

    if args.outfile is None:
        raise ConversionError("re-typing a GGUF needs --outfile")
    if args.outfile.exists() and not args.force:
        raise ConversionError(f"{str(args.outfile)!r} already exists; pass --force to overwrite it")
    if args.outfile.resolve() == args.model_dir.resolve():
        raise ConversionError("--outfile is the input file")
    size = retype(args.model_dir, args.outfile, args.outtype, allow_requantize=args.allow_requantize,
                  threads=max(1, args.threads))
    log.info("wrote %s (%s)", args.outfile, _fmt_bytes(size))
    return 0


def _print_plan(plan, outtype: str, total: int, n_params: int, n_kvs: int) -> None:
    rows = [(s.name, "{" + ", ".join(str(d) for d in reversed(s.shape)) + "}", t.name,
             _fmt_bytes(tensor_bytes(t, s.shape))) for s, t in plan]
    widths = [max(len(r[i]) for r in rows + [("tensor", "shape", "type", "size")]) for i in range(4)]
    line = "  ".join(f"{{:<{w}}}" for w in widths[:3]) + f"  {{:>{widths[3]}}}"
    print(line.format("tensor", "shape", "type", "size"))
    for r in rows:
        print(line.format(*r))
    counts: dict[str, int] = {}
    for _, t in plan:
        counts[t.name] = counts.get(t.name, 0) + 1
    mix = ", ".join(f"{k} x{v}" for k, v in sorted(counts.items()))
    print(f"total: {len(plan)} tensors, {n_params:,} parameters, {_fmt_bytes(total)} of tensor data "
          f"({outtype}: {mix}); {n_kvs} metadata keys")
