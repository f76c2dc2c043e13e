"""dflash-train: a DFlash drafter for any supported target GGUF, trained against the
target as our runtime serves it (features and greedy labels from the GGUF itself) and
measured by our engine's acceptance while it trains.

    from dflash_gguf.train import TrainOptions, train
    report = train(TrainOptions.from_flags(model="target.gguf", data=["corpus/"], output="draft.gguf", steps=2000))

Modules: options (the CLI's flags, in groups), data (files, chats, windows), target
(features and labels by our runtime), recipe (layer ids, anchors, block mask, weighted
loss), model (the torch drafter), loop (steps, checkpoints, report), evaluate (held-out
AL), export (GGUF, HF layout).
Torch is imported only by train() (the `train` extra)."""
from .loop import train
from .options import TrainOptions
from .target import TrainError

__all__ = ["TrainError", "TrainOptions", "train"]
