"""dflash-train's command line (llama.cpp's spellings where it has them: -m, -o, -c, -t)."""
from __future__ import annotations

import argparse
import sys

from .options import (CorpusOptions, DrafterOptions, EvalOptions, FileOptions, ObjectiveOptions, RuntimeOptions,
                      ScheduleOptions, TrainOptions)
from .target import TrainError


def parser() -> argparse.ArgumentParser:
    """The flags, flat; their defaults are their option groups' (options.py)."""
    p = argparse.ArgumentParser(prog="dflash-train", description="Train a DFlash drafter for a target GGUF, "
                                "against the target as our runtime serves it.")
    p.add_argument("-m", "--model", required=True, help="the target GGUF")
    p.add_argument("--data", nargs="+", required=True, metavar="PATH",
                   help="text files, directories of them, JSONL chats ({\"messages\": [...]})")
    p.add_argument("-o", "--output", required=True, help="the drafter GGUF to write")
    p.add_argument("--seed", type=int, default=TrainOptions.seed)
    p.add_argument("--steps", type=int, help="step budget")
    p.add_argument("--max-minutes", type=float, help="time budget")
    p.add_argument("-t", "--threads", type=int, default=RuntimeOptions.threads)
    p.add_argument("--block-size", type=int, default=DrafterOptions.block_size,
                   help="drafter block (default %(default)s, z-lab's)")
    p.add_argument("--draft-layers", type=int, default=DrafterOptions.draft_layers)
    p.add_argument("--target-layer-ids", type=int, nargs="+", help="HF ids (default: z-lab's spread)")
    p.add_argument("--mask-token", help="id or token text (default: <|mask|>, an unused or the padding token)")
    p.add_argument("--gamma", type=float, help="loss weight exp(-(k-1)/gamma) (default: 7 at block 16)")
    p.add_argument("--lr", type=float, default=ScheduleOptions.lr)
    p.add_argument("-c", "--ctx-size", type=int, default=CorpusOptions.ctx_size, help="training window in tokens")
    p.add_argument("-b", "--batch", type=int, default=ScheduleOptions.batch, help="windows per step")
    p.add_argument("--anchors", type=int, default=ObjectiveOptions.anchors, help="anchor blocks per window")
    p.add_argument("--loss-vocab", type=int, default=ObjectiveOptions.loss_vocab,
                   help="take the loss over the data's N most frequent tokens (0: whole vocabulary)")
    p.add_argument("--draft-vocab", type=int, default=DrafterOptions.draft_vocab, metavar="N",
                   help="the file carries a kept set of N tokens (the data's commonest): our runtime drafts over those "
                        "rows of the head only, as --spec-draft-vocab N; llama.cpp ignores it (default 0: none)")
    p.add_argument("--top-k-labels", type=int, default=ObjectiveOptions.top_k_labels, metavar="K",
                   help="distill the target's top-K distribution (a KL loss) instead of its argmax (default 0: argmax)")
    p.add_argument("--checkpoint-every", type=float, default=FileOptions.checkpoint_every, metavar="MIN")
    p.add_argument("--resume", nargs="?", const="", metavar="CKPT", help="continue from OUTPUT.ckpt (or CKPT)")
    p.add_argument("--eval-every", type=float, default=EvalOptions.eval_every, metavar="MIN")
    p.add_argument("--eval-prompts", type=int, default=EvalOptions.eval_prompts, help="held-out documents")
    p.add_argument("--eval-tokens", type=int, default=EvalOptions.eval_tokens)
    p.add_argument("--regenerate", action="store_true",
                   help="train on the target's own greedy continuations of the data (z-lab's and SpecForge's way)")
    p.add_argument("--hf-out", metavar="DIR", help="also write z-lab's HF layout (PyPI dflash)")
    p.add_argument("--report", help="the JSON report (default: OUTPUT with .json)")
    p.add_argument("--device", help="our runtime's device for the target (default: the first)")
    p.add_argument("--train-device", default=RuntimeOptions.train_device,
                   help="torch's device for the drafter: cpu (default), cuda, cuda:N")
    p.add_argument("--outtype", choices=["f32", "f16"], default=FileOptions.outtype)
    p.add_argument("--no-progress", dest="progress", action="store_false")
    return p


def main(argv=None) -> int:
    opts = TrainOptions.from_flags(**vars(parser().parse_args(argv)))
    if opts.files.resume == "":
        opts.files.resume = opts.files.checkpoint_path
    from .loop import train

    try:
        train(opts)
    except TrainError as e:
        print(f"dflash-train: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"dflash-train: interrupted; checkpoint in {opts.files.checkpoint_path} (--resume)", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
