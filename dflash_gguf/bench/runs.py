"""What one benchmark run is: one prompt generated once by one engine in one mode, with
the numbers every table is made of."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import List, Optional, Union

from ..decoding.sampling import SamplingParams

OURS_PLAIN = ("ours", "plain")  # the row every other row's output is compared with


@dataclass(frozen=True)
class Sampling:
    """Greedy (temperature 0) or sampled with these settings (llama.cpp's flag names)."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int = 0
    constraint: Optional[object] = None  # a constraints.Constraint every run's output must match

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def label(self) -> str:
        if self.greedy:
            return "greedy"
        return (f"temp {self.temperature:g}, top-k {self.top_k}, top-p {self.top_p:g}, min-p {self.min_p:g}, "
                f"seed {self.seed} + rep")

    def seed_at(self, rep: int) -> int:
        """Repetition `rep`'s seed, the same in both engines: a sampled text's AL varies a
        lot from draw to draw, and repetitions that drew the same text would only repeat it."""
        return self.seed + rep

    def params(self, rep: int) -> Optional[SamplingParams]:
        """Our engine's settings for repetition `rep` (None: greedy and unconstrained)."""
        if self.greedy:
            return SamplingParams(constraint=self.constraint) if self.constraint is not None else None
        return SamplingParams(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p, min_p=self.min_p,
                              seed=self.seed_at(rep), constraint=self.constraint)


@dataclass(frozen=True)
class Cell:
    """The table row a run belongs to, and what its mode is."""

    engine: str                # "ours" or "llama.cpp"
    mode: str                  # ours: plain, chain, tree 8, auto; llama.cpp: the tool and its setting
    sampling: str              # Sampling.label
    speculative: bool = False  # the row drafts (ours: chain, tree, auto; llama.cpp: DFlash)
    default: bool = False      # the engine's default setting (no sweep flag given)

    @property
    def key(self) -> tuple:
        return self.engine, self.mode, self.sampling


_CELL_KEYS = [f.name for f in fields(Cell)]


@dataclass
class Run:
    """One generation. `tokens` and `decode_s` cover the timed decode steps only (the
    prefill, which yields the first token, is apart); `passes` counts the target's passes
    over them, so tokens / passes is the acceptance length (AL) and 1 for plain decoding."""

    cell: Cell
    rep: int
    prompt: str          # the prompt's name ("" for llama-bench's random tokens)
    prompt_tokens: int
    tokens: int
    decode_s: float
    passes: int
    prefill_s: Optional[float] = None
    # the generated text, and (ours) tokens; read from a slim results file, their digests
    # (slim.py: compare them through slim.text_key and slim.ids_key)
    text: Union[str, dict, None] = None
    token_ids: Union[List[int], dict, None] = None
    extra: dict = field(default_factory=dict)
    round: int = 0                        # a repetition's pass over the prompts (more until it decodes long enough)
    load_1m: Optional[float] = None       # the 1-minute load average when its cell started
    loaded: bool = False                  # that load was above the threshold (method.LoadGate)

    def to_json(self) -> dict:
        """A results file's record: flat, the cell's row keys first and its mode's flags last."""
        own = asdict(self)
        cell = own.pop("cell")
        return {"engine": cell["engine"], "mode": cell["mode"], "sampling": cell["sampling"], **own,
                "speculative": cell["speculative"], "default": cell["default"]}

    @classmethod
    def from_json(cls, record: dict) -> Run:
        """A run from a results file's record (to_json's)."""
        own = {k: v for k, v in record.items() if k not in _CELL_KEYS}
        return cls(Cell(**{k: record[k] for k in _CELL_KEYS if k in record}), **own)
