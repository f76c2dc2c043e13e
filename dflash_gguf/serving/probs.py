"""A job's token log-probabilities (GenerationStats.logprobs: the target's, which
speculation does not change) in llama-server's shape: per token its id, text, bytes,
logprob and top_logprobs (its most likely alternatives, each with id, token, bytes and
logprob). OpenAI's chat and completion replies carry them as choice.logprobs.content,
llama-server's /completion as completion_probabilities.

Entries follow the reply's text: a piece of text brings the entries of the tokens that
begin within the text given so far (so that a streamed chunk carries its own tokens'),
and the end brings the rest, less the tokens of a stop string cut from the reply."""
from __future__ import annotations

import math
from bisect import bisect_left
from typing import Dict, List

import numpy as np

from ..decoding.logprobs import TokenProb
from ..runtime.tokenizer import _complete_prefix

LOWEST = float(-np.finfo(np.float32).max)  # stands for a -inf, as llama-server's (JSON has no infinities)


def _logprob(value: float) -> float:
    return value if math.isfinite(value) else LOWEST


class TokenPieces:
    """Each token's bytes and its text (the bytes up to an incomplete UTF-8 character, as
    llama-server cuts them), kept once asked."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._bytes: Dict[int, bytes] = {}

    def bytes_of(self, token: int) -> bytes:
        data = self._bytes.get(token)
        if data is None:
            data = self._bytes[token] = self.tokenizer.token_bytes([token])
        return data

    def piece(self, token: int) -> dict:
        data = self.bytes_of(token)
        return {"id": token, "token": data[:_complete_prefix(data)].decode("utf-8", errors="replace"),
                "bytes": list(data)}

    def entry(self, token: int, logprob: float) -> dict:
        return {**self.piece(token), "logprob": _logprob(logprob)}

    def prob_entry(self, token: int, prob: float) -> dict:
        return {**self.piece(token), "prob": prob}

    def token_json(self, lp) -> dict:
        """One emitted token's entry with its alternatives (a TokenProb's: probabilities
        after the sampler, as llama-server's post_sampling_probs names them)."""
        if isinstance(lp, TokenProb):
            return {**self.prob_entry(lp.token, lp.prob), "top_probs": [self.prob_entry(t, p) for t, p in lp.top]}
        return {**self.entry(lp.token, lp.logprob), "top_logprobs": [self.entry(t, v) for t, v in lp.top]}


class JobProbs:
    """The entries of a job's tokens as its reply's text comes: take(piece) after each
    piece, rest() once the job is done."""

    def __init__(self, pieces: TokenPieces, job):
        self.pieces, self.job = pieces, job
        self.covered = 0  # bytes of text given so far
        self.sent = 0  # entries given so far
        self._ends: List[int] = []  # each token's end offset in the text, as far as worked out

    def _begun(self) -> int:
        """How many of the job's tokens begin within the text given so far."""
        tokens, ends = self.job.tokens, self._ends
        while len(ends) < len(tokens) and (ends[-1] if ends else 0) < self.covered:
            ends.append((ends[-1] if ends else 0) + len(self.pieces.bytes_of(tokens[len(ends)])))
        # token i begins at ends[i - 1] (the first at 0)
        return min(len(ends), (self.covered > 0) + bisect_left(ends, self.covered))

    def _upto(self, n: int) -> List[dict]:
        entries = self.job.stats.logprobs[self.sent:n]
        self.sent = max(self.sent, n)
        return [self.pieces.token_json(lp) for lp in entries]

    def take(self, piece: str) -> List[dict]:
        """The entries of the tokens that begin within the text given so far, this piece's."""
        self.covered += len(piece.encode("utf-8"))
        return self._upto(self._begun())

    def rest(self) -> List[dict]:
        """The entries not given yet, once the job is done; a reply cut at a stop string
        leaves out the tokens that begin past its text."""
        if self.job.stats.stop_reason == "stop string":
            return self._upto(self._begun())
        return self._upto(len(self.job.stats.logprobs))

    def all(self, text: str) -> List[dict]:
        """Every entry of a finished job whose reply is `text`."""
        return self.take(text) + self.rest()
