"""What a weightless speculation kind declares (a module of this folder: `KIND = Kind(...)`):
its `--spec-type` name, its options as a frozen dataclass whose fields say their flag
(llama.cpp's spelling), default, help and range, and the source that drafts for one
sequence. The command lines, the Engine's keywords, dflash-server and dflash-bench read
these declarations; nothing else names a weightless kind."""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Callable, List, Mapping, Optional, Sequence, Tuple

from ...runtime.errors import ConfigError


def option(default: int, flag: str, help: str, *, what: str, lo: int = 1, hi: Optional[int] = None,
           metavar: str = "N"):
    """A kind's integer option: its default, its flag (llama.cpp's spelling; the Engine's
    keyword is the flag's words joined by underscores), its help, what its errors call it
    and its range (hi None: no upper bound)."""
    return field(default=default, metadata={"flag": flag, "help": help, "what": what, "lo": lo, "hi": hi,
                                            "metavar": metavar})


def keyword(flag: str) -> str:
    """The Engine keyword of a flag: --spec-ngram-mod-n-min -> spec_ngram_mod_n_min."""
    return flag.lstrip("-").replace("-", "_")


def check_count(option_name: str, value, lo: int, hi: Optional[int] = None, what: str = "") -> int:
    """An integer option in lo..hi, else ConfigError(option_name, ...) (exit status 2 on a
    command line, with the option's flag in its place)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < lo or (hi is not None and value > hi):
        span = f"{lo}..{hi}" if hi is not None else f">= {lo}"
        raise ConfigError(option_name, f"{what or option_name.replace('_', ' ')} must be {span}, got {value!r}")
    return value


@dataclass(frozen=True)
class Options:
    """A kind's options (a frozen dataclass of option() fields), checked when made."""

    def __post_init__(self):
        for f in fields(self):
            m = f.metadata
            check_count(keyword(m["flag"]), getattr(self, f.name), m["lo"], m["hi"], m["what"])

    @classmethod
    def declared(cls) -> List[Tuple[str, str, Any]]:
        """(field, Engine keyword, its field) of each option, in declaration order."""
        return [(f.name, keyword(f.metadata["flag"]), f) for f in fields(cls)]

    @classmethod
    def of(cls, values: Mapping[str, Any]) -> "Options":
        """The options from Engine keywords (or argparse's dests, the same words), the
        defaults where left out."""
        return cls(**{name: values[kw] for name, kw, _ in cls.declared() if values.get(kw) is not None})


@dataclass(frozen=True)
class NoOptions(Options):
    """A kind without options of its own."""


@dataclass(frozen=True)
class Kind:
    """A weightless kind: its --spec-type `name` and `help` (in --spec-type's help), its
    `options` (an Options dataclass), and how it drafts:

      source    options -> a fresh source for one sequence, its state an explicit record:
                `draft(history, n_max) -> (drafts, run)` (the tokens it proposes after the
                history, the run of the match they were found by, which prices them:
                pricing.RunHazard) and `heard(drafts, kept)` (how many of its last draft
                the target kept); the chains of every such kind compete each step
                (ngram.NgramDrafts)
      corpora   suffix's instead: options -> the engine's shared corpora, whose drafts
                are trees (weightless.Weightless)

    and how dflash-bench sweeps it: `lookup`, the option swept as its lookup size, with
    `sweep_sizes`; `their_flags(size, n_max)`, llama-speculative-simple's flags for the
    same setting (None: llama.cpp has no such kind)."""

    name: str
    help: str
    options: type = NoOptions
    source: Optional[Callable[[Any], Any]] = None
    corpora: Optional[Callable[[Any], Any]] = None
    lookup: Optional[str] = None
    sweep_sizes: Sequence[int] = ()
    their_flags: Optional[Callable[[Optional[int], Optional[int]], List[str]]] = None

    def lookup_keyword(self) -> Optional[str]:
        """The Engine keyword of its lookup size (None: it has none)."""
        return next((kw for name, kw, _ in self.options.declared() if name == self.lookup), None)
