"""Structured output: grammars and JSON schemas that constrain what a request generates.

The grammars are llguidance's (PyPI `llguidance`, the engine llama.cpp's `--llguidance`
build and vLLM's structured outputs use): it reads llama.cpp's GBNF, JSON schemas, Lark
and regular expressions, and computes a token mask over the model's own vocabulary in
tens of microseconds with a lexer over token bytes, which is what a speculative step
needs (a mask per verified row). xgrammar was the other candidate; it has no GBNF
reader compatible with llama.cpp's `grammars/` files and no tokenizer built from a GGUF
vocabulary, which llguidance has (`llguidance.llamacpp`).

A Constraint is what a request asks for (validated when it is made, before any model is
involved); a GrammarVocab is the model's vocabulary as llguidance sees it (built once
per tokenizer); a GrammarState follows one sequence through its tokens: the masks of the
rows a step verifies (each row's path after the tokens emitted so far: a chain row's
prefix, a tree node's ancestors), how far a draft stays inside the grammar, the tokens it
forces, and whether the grammar has ended."""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import List, Optional, Sequence

import numpy as np

from ..runtime.errors import ConfigError

GRAMMAR_KINDS = ("gbnf", "json_schema", "lark", "regex")
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True)
class Constraint:
    """A grammar of one of GRAMMAR_KINDS (`text`: GBNF, Lark or a regex; a JSON schema as
    JSON text), compiled to llguidance's grammar and checked on creation: a ValueError
    names the problem. `lazy_from` (a string): the grammar applies from the first
    occurrence of that text in the output on (the text itself matched by the grammar's
    start), as llama-server's tool-call grammars do; free text before it. `after` (a
    string): the grammar applies to what follows the first occurrence of that text (the
    end of a thinking block). `prefix`: text the grammar's start is taken to have matched
    already (a call's opening written at the end of the prompt)."""

    kind: str
    text: str
    lazy_from: Optional[str] = None
    prefix: str = ""
    after: Optional[str] = None

    def __post_init__(self):
        if self.lazy_from is not None and self.after is not None:
            raise ValueError("a constraint waits for its opening (lazy_from) or for a text before it (after), not both")
        if self.kind not in GRAMMAR_KINDS:
            raise ValueError(f"unknown grammar kind {self.kind!r}; choose one of {', '.join(GRAMMAR_KINDS)}")
        object.__setattr__(self, "grammar", _compile(self.kind, self.text))

    @classmethod
    def gbnf(cls, text: str) -> "Constraint":
        return cls("gbnf", text)

    @classmethod
    def json_schema(cls, schema) -> "Constraint":
        """From a schema given as a dict or as JSON text."""
        return cls("json_schema", schema if isinstance(schema, str) else json.dumps(schema))

    @classmethod
    def json_object(cls) -> "Constraint":
        """Any JSON object (OpenAI's response_format json_object)."""
        return cls.json_schema({"type": "object"})

    def state(self, vocab: "GrammarVocab", drafting: bool = True) -> "GrammarState":
        return GrammarState(vocab, self, drafting)


def _compile(kind: str, text: str) -> str:
    from llguidance import LLMatcher, grammar_from

    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"the {_name(kind)} is empty")
    if kind == "json_schema":
        try:
            schema = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"the JSON schema is not valid JSON: {e}") from None
        if not isinstance(schema, (dict, bool)):
            raise ValueError("the JSON schema must be a JSON object")
    try:
        if kind == "json_schema":
            # JSON as json.dumps writes it: whitespace only after its separators (a flexible
            # layout lets a model pad its output with whitespace until max_tokens); a schema's
            # own "x-guidance" options come after these defaults
            grammar = LLMatcher.grammar_from_json_schema(text, defaults=JSON_LAYOUT)
        else:
            grammar = grammar_from(kind, text)
    except ValueError as e:
        raise ValueError(f"invalid {_name(kind)}: {_one_line(str(e))}") from None
    error = LLMatcher.validate_grammar(grammar)
    if error:
        raise ValueError(f"invalid {_name(kind)}: {_one_line(error)}")
    return grammar


def _name(kind: str) -> str:
    return {"gbnf": "grammar", "json_schema": "JSON schema", "lark": "Lark grammar", "regex": "regex"}[kind]


def _one_line(message: str) -> str:
    return " ".join(message.split())


class GrammarVocab:
    """A tokenizer's vocabulary for llguidance: every token's bytes as llama.cpp gives them
    (control tokens apart: they never match grammar text), n_vocab rows (the target's,
    which may pad the tokenizer's), and the end-of-generation tokens, which a grammar
    allows only where it may end (as llama.cpp's grammar sampler does)."""

    def __init__(self, tokenizer, n_vocab: int):
        from llguidance.llamacpp import lltokenizer_from_vocab

        self.tokenizer = tokenizer
        self.n_vocab = int(n_vocab)
        self.words = (self.n_vocab + 31) // 32
        self.eog = sorted(tokenizer.eog_ids)
        self.lltokenizer = lltokenizer_from_vocab(tokenizer._llama._model.vocab, n_vocab=self.n_vocab,
                                                  eos_token=self.eog or None)


class GrammarState:
    """One sequence's place in its grammar, advanced by the tokens it emits (consume). The
    other calls look ahead from there and roll back, leaving it where it was. drafting:
    grammar-aware drafting (a chain cut before a draft the grammar rejects, forced text in
    place of guesses, trees of grammar-valid candidates); without it the drafts are
    verified as drafted, each row still masked by its own path (the benchmarks' other arm)."""

    def __init__(self, vocab: GrammarVocab, constraint: Constraint, drafting: bool = True):
        from llguidance import LLMatcher

        self.vocab, self.constraint, self.drafting = vocab, constraint, drafting
        self.matcher = LLMatcher(vocab.lltokenizer, constraint.grammar, log_level=0)
        if self.matcher.is_error():
            raise ValueError(f"invalid {_name(constraint.kind)}: {_one_line(self.matcher.get_error())}")
        self.lazy = constraint.lazy_from if constraint.after is None else constraint.after
        self._inclusive = constraint.after is None  # the opening is the grammar's own start
        self._text = b""  # output so far while a lazy grammar waits for its opening
        if constraint.prefix:
            self._start_with(constraint.prefix.encode())

    def _start_with(self, text: bytes) -> None:
        """The grammar consumes `text` first: as the tokenizer splits it (special tokens
        included), or else as llguidance's own tokenization does."""
        for tokens in (self.vocab.tokenizer.encode(text.decode("utf-8", "replace"), add_bos=False),
                       self.vocab.lltokenizer.tokenize_bytes(text)):
            n = self.matcher.try_consume_tokens([int(t) for t in tokens])
            if n == len(tokens):
                return
            if n:
                self.matcher.rollback(n)
        raise ValueError(f"the grammar does not accept its opening {text.decode('utf-8', 'replace')!r}")

    @property
    def active(self) -> bool:
        """The grammar constrains the next token (a lazy one: once its opening was emitted)."""
        return self.lazy is None and self.matcher is not None

    def opens(self, path: Sequence[int]) -> bool:
        """A lazy grammar waiting for its opening finds it within the tokens emitted so far
        and `path`. No verified row may have it in its path: the row's choice would be
        made unconstrained; only a step's last token (the target's own) may complete it."""
        if self.lazy is None or not path:
            return False
        return self.lazy.encode() in self._text + self.vocab.tokenizer.token_bytes([int(t) for t in path])

    @property
    def ended(self) -> bool:
        """The grammar is complete and allows nothing more (end of generation)."""
        return self.active and self.matcher.is_stopped()

    @property
    def waiting(self) -> bool:
        """A lazy grammar waits for its opening (the drafts must stop before it)."""
        return self.lazy is not None and self.matcher is not None

    def consume(self, tokens: Sequence[int]) -> None:
        """Tokens emitted. A lazy grammar watches the text for its opening and, once seen,
        consumes from there on."""
        tokens = [int(t) for t in tokens]
        if not tokens:
            return
        if self.lazy is not None:
            opening = self.lazy.encode()
            self._text += self.vocab.tokenizer.token_bytes(tokens)
            at = self._text.find(opening)
            if at < 0:
                self._text = self._text[len(self._text) - len(opening) + 1:]  # what may begin it
                return
            tail = self._text[at:] if self._inclusive else self._text[at + len(opening):]
            self._text, self.lazy = b"", None
            try:
                if tail:
                    self._start_with(tail)
            except ValueError:
                # the token that completed the opening ran on past what the grammar takes
                # (it was chosen while the grammar waited): the rest goes unconstrained
                self.matcher = None
            return
        if self.matcher is None:
            return
        for t in tokens:
            if self.matcher.is_stopped():
                break  # an end-of-generation token after the grammar's end
            if not self.matcher.consume_token(t):
                raise RuntimeError(f"grammar: token {t} was emitted outside it ({self.matcher.get_error()})")

    def valid_prefix(self, tokens: Sequence[int]) -> int:
        """How many of `tokens`, in order from here, the grammar accepts (while a lazy
        grammar waits: those before its opening)."""
        if self.lazy is not None:
            return next((i for i in range(len(tokens)) if self.opens(tokens[:i + 1])), len(tokens))
        if not self.active or not tokens:
            return len(tokens)
        return int(self.matcher.validate_tokens([int(t) for t in tokens]))

    def accepts(self, path: Sequence[int]) -> bool:
        """The grammar accepts the whole path from here."""
        return self.valid_prefix(path) == len(path)

    def forced_after(self, path: Sequence[int]) -> Optional[int]:
        """The token the grammar forces after `path` from here (None: none, or the path
        leaves the grammar)."""
        if not self.active:
            return None
        path = [int(t) for t in path]
        m = self.matcher
        n = m.try_consume_tokens(path) if path else 0
        ff = m.compute_ff_tokens() if n == len(path) and not m.is_stopped() else []
        if n:
            m.rollback(n)
        return int(ff[0]) if ff else None

    def draft_path(self, drafts: Sequence[int], forced: bool = True) -> List[int]:
        """The drafts a chain verifies after the tokens emitted: the drafter's block as far
        as the grammar accepts it (a draft it rejects could never be accepted: the block
        ends before it), and with `forced`, where the grammar forces text from a position
        on (a key, a bracket, a literal), its token there in place of the drafter's guess."""
        if not self.active:
            return [int(t) for t in drafts[:self.valid_prefix(drafts)]]
        m, out = self.matcher, []
        for d in drafts:
            if m.is_stopped():
                break
            tok = int(d)
            if forced:
                ff = m.compute_ff_tokens()
                if ff:
                    tok = int(ff[0])
            if m.try_consume_tokens([tok]) != 1:
                break
            out.append(tok)
        if out:
            m.rollback(len(out))
        return out

    def masks(self, paths: Sequence[Sequence[int]]) -> Optional[np.ndarray]:
        """Per path, the allowed-token bitmask of the row it leads to ([rows, words]
        uint32); None while the grammar is not active. A row whose path leaves the grammar
        can never be reached (its ancestors' choices obey their masks): it allows all."""
        if not self.active:
            return None
        from llguidance.numpy import fill_next_token_bitmask

        out = np.full((len(paths), self.vocab.words), -1, dtype=np.int32)
        m = self.matcher
        for i, path in enumerate(paths):
            path = [int(t) for t in path]
            n = m.try_consume_tokens(path) if path else 0
            if n == len(path):
                fill_next_token_bitmask(m, out, i)
            if n:
                m.rollback(n)
        return out.view(np.uint32)


def check_constraint(grammar: Optional[str] = None, json_schema=None):
    """The constraint a request or command line asks for: a GBNF grammar, or a JSON schema
    (a dict or its JSON text), not both; None for neither. ConfigError ("grammar" or
    "json_schema") names what is wrong with it."""
    if grammar is not None and json_schema is not None:
        raise ConfigError("grammar", "give a grammar or a JSON schema, not both")
    try:
        if grammar is not None:
            return Constraint.gbnf(grammar)
        if json_schema is not None:
            return Constraint.json_schema(json_schema)
    except ValueError as e:
        raise ConfigError("grammar" if grammar is not None else "json_schema", str(e)) from None
    return None
