"""Sampling the target's distribution, on the device, and the speculative rules that keep
it exact.

A row's distribution, in llama.cpp's sampler order: the penalties change the logits of
the tokens in the row's window (the last repeat_last_n tokens before it), top_k keeps
the k largest logits, top_p then keeps the fewest most likely tokens whose probability
at temperature 1 reaches top_p, min_p drops those less than min_p times as likely as the
most likely, and only then does the temperature divide the logits of what is left.
(vLLM and transformers apply the temperature first, so that top_p and min_p see the
tempered probabilities; llama.cpp's order is kept here because llama.cpp is what users
of GGUF files compare against, and its speculative decoders sample so.) Temperature 0 is
the argmax, after the penalties.

The graphs choose each row's token themselves (csrc/dfl_sampler.c): the host hands them
one uniform per row from the request's seeded generator and, with penalties, each row's
token counts, and reads token ids back. `distribution` is the same rule in numpy: the
reference the tests compare against. A row whose kept set reaches past the candidates a
step ranks (top_k 0 with top_p or min_p) is drawn again on the device over its logits
ranked in full (Target.redraw): no vocabulary row crosses to the host.
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, fields
from typing import Callable, List, Optional, Sequence, Tuple

import numpy as np

from ..runtime.errors import ConfigError
from ..runtime.native import ffi, lib


@dataclass(frozen=True)
class SamplingRule:
    """One sampling setting, told once: its SamplingParams field (which the C runtime's
    dfl_sampling has under the same name when its graphs apply it), dflash-run's and
    dflash-server's flag and help, the bounds every caller is held to (each a test and
    the words "<field> must be ..." says when it fails), and whether it is one of the
    penalties (else it shapes the draws: what `auto` learns per setting)."""

    field: str
    flag: str
    help: str
    bounds: Tuple[Tuple[Callable[[float], bool], str], ...] = ()
    penalty: bool = False


def _at_least(lo, note: str = "") -> tuple:
    return (lambda v: v >= lo), f">= {lo}{note}"


def _at_most(hi) -> tuple:
    return (lambda v: v <= hi), f"<= {hi}"


# in their flags' order (the seed's flag comes after the draws' rules)
RULES = (
    SamplingRule("temperature", "--temp", "sampling temperature; 0 = greedy (default)", (_at_least(0),)),
    SamplingRule("top_k", "--top-k", "sample among the k most likely tokens (0: all)", (_at_least(0),)),
    SamplingRule("top_p", "--top-p", "nucleus sampling mass (default 1.0)",
                 (((lambda v: 0 < v <= 1), "> 0 and <= 1"),)),
    SamplingRule("min_p", "--min-p", "drop tokens below min-p x the most likely (default 0)",
                 (_at_least(0), ((lambda v: v < 1), "below 1"))),
    SamplingRule("repeat_penalty", "--repeat-penalty",
                 "penalize tokens seen in the last --repeat-last-n: a positive logit is divided by it, "
                 "a negative one multiplied (1.0 = off, default)", (((lambda v: v > 0), "> 0 (1: off)"),), True),
    SamplingRule("presence_penalty", "--presence-penalty",
                 "subtract this from the logit of every token seen in the last --repeat-last-n "
                 "(-2..2; 0 = off, default)", (_at_least(-2), _at_most(2)), True),
    SamplingRule("frequency_penalty", "--frequency-penalty",
                 "subtract this times its count from the logit of every token seen in the last "
                 "--repeat-last-n (-2..2; 0 = off, default)", (_at_least(-2), _at_most(2)), True),
    SamplingRule("repeat_last_n", "--repeat-last-n",
                 "tokens the penalties look back over, the prompt's included (default 64; -1: the whole "
                 "context; 0: no penalties)", (_at_least(-1, " (-1: the whole context, 0: no penalties)"),), True),
)


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: Optional[int] = None
    # llama.cpp's penalties over the last repeat_last_n tokens (the prompt's included;
    # -1: the whole context, 0: none): a seen token's logit is divided by repeat_penalty
    # when positive and multiplied when not, less frequency_penalty times its count and
    # presence_penalty once
    repeat_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repeat_last_n: int = 64
    # a grammar or JSON schema the output must match (constraints.Constraint)
    constraint: Optional[object] = None
    # llama.cpp's logit_bias: {token id: bias} (or (id, bias) pairs, a token's biases
    # summed), added to the target's logits before the penalties in every row it chooses;
    # -inf: never. Held as sorted (id, bias) pairs.
    logit_bias: Optional[object] = None

    def __post_init__(self):
        object.__setattr__(self, "logit_bias", _bias_pairs(self.logit_bias))
        check_sampling(self)

    @classmethod
    def default(cls, name: str):
        """A field's default (a flag's)."""
        return next(f.default for f in fields(cls) if f.name == name)

    @classmethod
    def integral(cls, name: str) -> bool:
        """Whether a field takes integers (else any finite number)."""
        return next(f.type for f in fields(cls) if f.name == name) == "int"

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def biased(self) -> bool:
        return bool(self.logit_bias)

    @property
    def penalized(self) -> bool:
        return self.repeat_last_n != 0 and (self.repeat_penalty != 1 or self.frequency_penalty != 0
                                            or self.presence_penalty != 0)

    def native(self, penalties: bool = True):
        """dfl_sampling for these settings (without the penalties: a drafter's)."""
        s = ffi.new("dfl_sampling *")
        lib.dfl_sampling_default(s)
        for rule in RULES:
            if rule.field in _NATIVE and (not rule.penalty or penalties and self.penalized):
                setattr(s, rule.field, getattr(self, rule.field))
        return s


def _bias_pairs(bias) -> Optional[Tuple[Tuple[int, float], ...]]:
    """A logit bias as sorted (token id, bias) pairs of distinct ids, each id's biases summed
    (llama.cpp adds each entry in turn), those of 0 left out; None when it biases nothing."""
    if bias is None:
        return None
    items = bias.items() if isinstance(bias, dict) else bias
    total: dict = {}
    try:
        for tok, b in items:
            if isinstance(tok, bool) or not isinstance(tok, numbers.Integral) or tok < 0:
                raise ConfigError("logit_bias", f"logit_bias: token ids must be integers >= 0, got {tok!r}")
            if isinstance(b, bool) or not isinstance(b, numbers.Real) or math.isnan(b) or b == math.inf:
                raise ConfigError("logit_bias", f"logit_bias: token {tok}'s bias must be a number or -inf, got {b!r}")
            total[int(tok)] = total.get(int(tok), 0.0) + float(b)
    except (TypeError, ValueError):
        raise ConfigError("logit_bias", "logit_bias must be {token id: bias} or (token id, bias) pairs") from None
    pairs = tuple(sorted((t, b) for t, b in total.items() if b != 0))
    return pairs or None


# the settings the C runtime's graphs apply (the others, the penalties' window, are the host's)
_NATIVE = {name for name, _ in ffi.typeof("dfl_sampling").fields}


def check_sampling(params: SamplingParams) -> None:
    """A SamplingParams' values, checked once for every caller (the Python API,
    dflash-run's flags, a server request's fields): ConfigError names the field (its
    message reads "<field> must be ..."; the command line puts its flag in the field's
    place, the server quotes it)."""
    for rule in RULES:
        value = getattr(params, rule.field)
        if params.integral(rule.field):
            if isinstance(value, bool) or not isinstance(value, numbers.Integral):
                raise ConfigError(rule.field, f"{rule.field} must be an integer, got {value!r}")
        elif isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ConfigError(rule.field, f"{rule.field} must be a finite number, got {value!r}")
    for rule in RULES:
        value = getattr(params, rule.field)
        for holds, words in rule.bounds:
            if not holds(value):
                raise ConfigError(rule.field, f"{rule.field} must be {words}, got {value}")
    if params.constraint is not None and not hasattr(params.constraint, "grammar"):
        raise ConfigError("constraint", f"constraint must be a constraints.Constraint, "
                                        f"got {type(params.constraint).__name__}")


GREEDY = SamplingParams()


def penalize(logits: np.ndarray, tokens: Sequence[int], params: SamplingParams) -> np.ndarray:
    """A logits row after llama.cpp's penalties for the window `tokens` (float64)."""
    x = np.array(logits, dtype=np.float64)
    if not params.penalized or len(tokens) == 0:
        return x
    seen, counts = np.unique(np.asarray(tokens), return_counts=True)
    v = x[seen]
    v = np.where(v <= 0, v * params.repeat_penalty, v / params.repeat_penalty)
    x[seen] = v - counts * params.frequency_penalty - params.presence_penalty
    return x


def distribution(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """Probabilities (float64) of each row of `logits` (penalties already applied) under
    `params` (not greedy), in llama.cpp's order."""
    x = np.atleast_2d(np.asarray(logits, dtype=np.float64))
    if 0 < params.top_k < x.shape[1]:
        kth = np.partition(x, -params.top_k, axis=1)[:, -params.top_k][:, None]
        x = np.where(x >= kth, x, -np.inf)
    z = x - x.max(axis=1, keepdims=True)
    p = np.exp(z)
    p /= p.sum(axis=1, keepdims=True)
    keep = p > 0
    if params.top_p < 1:
        order = np.argsort(-p, axis=1, kind="stable")
        sorted_p = np.take_along_axis(p, order, axis=1)
        keep_sorted = np.cumsum(sorted_p, axis=1) - sorted_p < params.top_p
        np.put_along_axis(keep, order, keep_sorted & np.take_along_axis(keep, order, axis=1), axis=1)
    if params.min_p > 0:
        keep &= p >= params.min_p * p.max(axis=1, keepdims=True)
    w = np.where(keep, np.exp(z / params.temperature), 0.0)
    return w / w.sum(axis=1, keepdims=True)


def draw(p: np.ndarray, u: float) -> int:
    """The inverse-CDF draw from the probability vector p with the uniform u."""
    return int(np.searchsorted(np.cumsum(p), u * p.sum(), side="right").clip(0, len(p) - 1))


class Sampler:
    """One request's sampling, host side: the settings it gives the target (and, for
    drafted samples, the drafter), the uniforms of its seeded generator, and the window
    of tokens its penalties count. `history` is every token so far, the prompt, then each
    token chosen: the sequence's own list (decoding.Tokens.text), read, never copied or
    written here. `grammar` (a constraints.GrammarState): the constraint it follows; each
    row's mask is its grammar state after its own path."""

    def __init__(self, params: Optional[SamplingParams] = None, history: Optional[List[int]] = None, grammar=None):
        self.params = params or GREEDY
        self.grammar = grammar
        self.rng = np.random.default_rng(self.params.seed)
        self.history = [] if history is None else history
        self._u = np.zeros(0, dtype=np.float32)
        self._ahead: list = []  # next_uniform's block, drawn ahead, last value first
        self._native = self.params.native()
        self._native_draft = self.params.native(penalties=False)

    @property
    def greedy(self) -> bool:
        return self.params.greedy

    @property
    def penalized(self) -> bool:
        return self.params.penalized

    @property
    def argmax_only(self) -> bool:
        """The target's argmax alone chooses: greedy, no penalties, no logit bias, no grammar."""
        return self.params.greedy and not self.params.penalized and not self.params.biased and self.grammar is None

    def apply(self, target, draft=None, drafted_samples: bool = False, seq: int = 0,
              raw_logits: bool = False) -> None:
        """Give the target (and the drafter) this request's settings for its sequence slot:
        the drafter samples its drafts only for the chain's rejection rule, else it drafts
        its argmax. raw_logits: the target keeps the rows' own logits as well (log-probabilities
        are over those, whatever the bias, penalties and grammar do to the rows)."""
        self._native.raw_logits = raw_logits
        target.set_sampling(self._native, seq=seq)
        if self.params.biased:  # the target's choices alone: the drafts are checked against them
            target.set_logit_bias(self.params.logit_bias, seq=seq)
        if draft is not None:
            draft.set_sampling(self._native_draft if drafted_samples else GREEDY.native(), seq=seq)

    def accept(self, tokens: Sequence[int]) -> None:
        """Tokens emitted (the history has them already): the grammar consumes them."""
        if self.grammar is not None:
            self.grammar.consume(tokens)

    @property
    def constrained(self) -> bool:
        """A grammar constrains the next token."""
        return self.grammar is not None and self.grammar.active

    @property
    def guided(self) -> bool:
        """A grammar decides how far drafts go: it constrains them, or it waits for its
        opening, which no verified row may see in its path (GrammarState.opens)."""
        g = self.grammar
        return g is not None and ((g.active and g.drafting) or g.waiting)

    @property
    def guide(self):
        """The grammar when it decides how far drafts go (guided), else None."""
        return self.grammar if self.guided else None

    def uniforms(self, n: int) -> np.ndarray:
        """The next n values of the generator's float32 stream: next_uniform's block first,
        so that a plain sequence draws the same values whichever step path it takes."""
        if not self._ahead:
            return self.rng.random(n, dtype=np.float32)
        k = min(n, len(self._ahead))
        head = np.array(self._ahead[:-k - 1:-1], dtype=np.float32)
        del self._ahead[-k:]
        return np.concatenate([head, self.rng.random(n - k, dtype=np.float32)])

    def prepare(self, target, n_rows: int, paths: Optional[Callable[[], Sequence[Sequence[int]]]] = None,
                seq: int = 0) -> None:
        """Stage what the target's next call needs to choose its n_rows rows: a uniform
        per row, and with penalties each row's counts over its window, the history
        followed by paths()[i], the tokens row i sees after it (a chain row's drafts so
        far, a tree node's ancestors below the root; called only with penalties or a
        grammar, which is when a chain reads its block back before the verify); with a
        grammar, each row's allowed tokens after the same path."""
        if not self.greedy:
            target.set_uniforms(self.draw_uniforms(n_rows), seq=seq)
        self.prepare_context(target, n_rows, paths, seq)

    def next_uniform(self) -> float:
        """One row's uniform, the value uniforms(1) would draw next: the generator's float32
        stream is the same drawn one at a time or in blocks, and a block costs the host
        about what one draw does (plain decoding, where nothing else draws from it)."""
        if not self._ahead:
            self._ahead = self.rng.random(32, dtype=np.float32).tolist()[::-1]
        return self._ahead.pop()

    def draw_uniforms(self, n_rows: int) -> np.ndarray:
        """The next rows' uniforms (kept for resolve's redraws)."""
        self._u = self.uniforms(n_rows)
        return self._u

    def prepare_context(self, target, n_rows: int, paths: Optional[Callable[[], Sequence[Sequence[int]]]] = None,
                        seq: int = 0) -> None:
        """prepare() less the uniforms: the rows' penalty counts and grammar masks."""
        if not (self.penalized or self.constrained):
            return
        rows = paths() if paths is not None else [[]] * n_rows
        if self.penalized:
            target.set_penalties(*self.window_counts(rows), seq=seq)
        if self.constrained:
            target.set_masks(self.grammar.masks(rows), seq=seq)

    def window_counts(self, paths: Sequence[Sequence[int]]) -> Tuple[np.ndarray, np.ndarray]:
        """Per row, the distinct tokens of its window and their counts, [rows, M] each,
        padded with unseen tokens of count 0 to a width that changes rarely (the graph's
        shape depends on it)."""
        last_n = self.params.repeat_last_n
        base = self.history if last_n < 0 else self.history[-last_n:] if last_n else []
        windows = []
        for path in paths:
            seq = base + [int(t) for t in path]
            windows.append(np.unique(np.asarray(seq[-last_n:] if last_n > 0 else seq, dtype=np.int64),
                                     return_counts=True))
        width = max([len(w[0]) for w in windows] + [1])
        width = 1 << max(3, (width - 1).bit_length())  # powers of two from 8
        tokens = np.empty((len(paths), width), dtype=np.int32)
        counts = np.zeros((len(paths), width), dtype=np.float32)
        for i, (seen, n) in enumerate(windows):
            pad = np.setdiff1d(np.arange(width + len(seen)), seen)[: width - len(seen)]
            tokens[i] = np.concatenate([seen, pad])
            counts[i, : len(seen)] = n
        return tokens, counts

    def choices(self, target, row0: int, n_rows: int, seq: int = 0) -> np.ndarray:
        """The target's choices for this request's rows row0.. of its last call; a row the
        step could not decide (-1: its kept set reaches past the candidates it ranked) is
        drawn again on the device over its whole vocabulary, with the same uniform."""
        return self.resolve(target, target.choices(row0, n_rows), row0, seq)

    def resolve(self, target, out: np.ndarray, row0: int, seq: int = 0) -> np.ndarray:
        """choices() of rows already read (out, this request's rows from row0)."""
        undecided = np.flatnonzero(out < 0)
        if len(undecided):
            out[undecided] = target.redraw(row0 + undecided, self._u[undecided], seq)
        return out

    def reject_accept(self, drafts: Sequence[int], q: Tuple[np.ndarray, np.ndarray],
                      p: Tuple[np.ndarray, np.ndarray], last: int) -> Tuple[int, int]:
        """Speculative rejection sampling of drafts[i] drawn from the drafter's q[i]
        (candidates, probabilities); p[i] is the target's distribution at that position
        as candidates and probabilities, and `last` the target's own draw after the last
        draft. Keep drafts[i] with probability min(1, p/q); at the first rejection draw
        from the normalised residual max(0, p - q) instead. Returns (drafts kept, the
        token that follows them), distributed exactly as the target's own sampling."""
        q_ids, q_p = q
        p_ids, p_p = p
        for i, tok in enumerate(drafts):
            pi = float(p_p[i][p_ids[i] == tok].sum())
            qi = float(q_p[i][q_ids[i] == tok].sum())
            if qi > 0 and self.rng.random() * qi < pi:
                continue
            q_at_p = (p_ids[i][:, None] == q_ids[i][None, :]) @ q_p[i]
            residual = np.maximum(p_p[i] - q_at_p, 0.0)
            weights = residual if residual.sum() > 0 else p_p[i]
            return i, int(p_ids[i][draw(weights, self.rng.random())])
        return len(drafts), int(last)
