"""dflash-train's options, in groups by what they decide: the data, the drafter's shape,
the loss, the schedule, the held-out measurement, the files and where it runs. Each
group's fields are the CLI's flags (same names, same defaults); TrainOptions.from_flags
takes them flat, as the CLI gives them, and puts each in its group."""
from __future__ import annotations

from dataclasses import dataclass, field, fields, is_dataclass
from typing import Optional, Sequence, get_type_hints


@dataclass
class CorpusOptions:
    """What it trains on: text files, directories of them, JSONL chats, cut into windows."""

    data: Sequence[str]
    ctx_size: int = 512  # training window, tokens
    regenerate: bool = False  # train on the target's own greedy continuations of the data


@dataclass
class DrafterOptions:
    """The drafter's shape and what its file carries."""

    block_size: int = 16
    draft_layers: int = 2
    target_layer_ids: Optional[Sequence[int]] = None  # HF ids; None: z-lab's spread
    mask_token: Optional[str] = None  # id or token text; None: chosen from the vocabulary
    draft_vocab: int = 0  # > 0: the file carries a kept set of that many tokens (the data's commonest)


@dataclass
class ObjectiveOptions:
    """A step's loss: its anchor blocks, their position weights and its labels."""

    anchors: int = 32  # anchor blocks per window
    gamma: Optional[float] = None  # None: SpecForge's for the block size
    loss_vocab: int = 32768  # large vocabularies: loss over the data's most frequent tokens
    top_k_labels: int = 0  # > 0: distill the target's top-k distribution (KL) instead of its argmax


@dataclass
class ScheduleOptions:
    """How long it trains, and the steps' size and learning rate."""

    steps: Optional[int] = None  # None: until max_minutes
    max_minutes: Optional[float] = None
    batch: int = 4  # windows per step
    lr: float = 6e-4


@dataclass
class EvalOptions:
    """The held-out acceptance measurement while it trains."""

    eval_every: float = 10.0  # minutes; 0: only at the start and the end
    eval_prompts: int = 8
    eval_tokens: int = 64


@dataclass
class FileOptions:
    """What it writes, and the checkpoint it keeps and may resume from."""

    output: str
    hf_out: Optional[str] = None
    report: Optional[str] = None  # None: OUTPUT with .json
    outtype: str = "f32"
    checkpoint_every: float = 10.0  # minutes
    resume: Optional[str] = None

    @property
    def checkpoint_path(self) -> str:
        return self.output + ".ckpt"


@dataclass
class RuntimeOptions:
    """Where it runs, and whether it shows its progress."""

    threads: int = 0  # 0: torch's and the runtime's default
    device: Optional[str] = None  # our runtime's device for the target
    train_device: str = "cpu"  # torch's device for the drafter ("cuda", "cuda:1"); `device` places the target
    progress: bool = True


@dataclass
class TrainOptions:
    """dflash-train's options: the target, the seed of every draw, and the groups."""

    model: str
    corpus: CorpusOptions
    files: FileOptions
    seed: int = 0
    drafter: DrafterOptions = field(default_factory=DrafterOptions)
    objective: ObjectiveOptions = field(default_factory=ObjectiveOptions)
    schedule: ScheduleOptions = field(default_factory=ScheduleOptions)
    evaluation: EvalOptions = field(default_factory=EvalOptions)
    runtime: RuntimeOptions = field(default_factory=RuntimeOptions)

    @classmethod
    def from_flags(cls, **flags) -> TrainOptions:
        """The options from the CLI's flags by name (model="t.gguf", data=[...],
        output="d.gguf", steps=2000, ...): each to its group, the rest to the defaults.
        An unknown name, or no data or output, is a TypeError, as for any dataclass."""
        groups = {}
        for name, kind in get_type_hints(cls).items():
            if is_dataclass(kind):
                own = {f.name for f in fields(kind)} & flags.keys()
                groups[name] = kind(**{k: flags.pop(k) for k in own})
        return cls(**groups, **flags)
