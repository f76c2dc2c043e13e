"""The target's log-probabilities at each emitted token (OpenAI's logprobs/top_logprobs,
llama-server's n_probs): read from the rows that chose the tokens, whichever call ran
them (a decode, a chain's or a tree's verify rows), and computed on the host alike.

Speculation does not change them: a verify's row computes bit for bit what a one-row
decode of the same position computes (docs/exactness.md), so the logits a row reads back
are plain decoding's, and so is every number derived from them here. They are the
log-softmax of the model's own logits, as llama-server's are: before the request's logit
bias, penalties and grammar (the device writes those into the rows it chooses from, so the
step keeps a copy of the rows first: Target.raw_logits), and before temperature or
truncation.

Or after the sampler's rules (llama-server's post_sampling_probs): each token's
probability at its row once top-k, top-p, min-p and the temperature follow the bias and
the penalties (sampling.distribution, in float64 on the host from the same rows, so these
too are plain decoding's). A greedy row gives its token a probability of 1."""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Sequence, Tuple

import numpy as np

from .sampling import SamplingParams, distribution


@dataclass(frozen=True)
class TokenLogprob:
    """One emitted token's log-probability and the `top` most likely tokens of its row,
    most likely first (ties: the lower token id first), as (token, log-probability)."""

    token: int
    logprob: float
    top: Tuple[Tuple[int, float], ...] = ()


@dataclass(frozen=True)
class TokenProb:
    """One emitted token's probability after the sampler's rules, and the `top` tokens
    they leave most likely, most likely first (ties: the lower token id first; none of
    probability 0), as (token, probability)."""

    token: int
    prob: float
    top: Tuple[Tuple[int, float], ...] = ()


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """A row's log-probabilities, in float32, the same arithmetic for every row."""
    x = logits.astype(np.float32, copy=False)
    m = np.max(x)
    return x - (m + np.log(np.sum(np.exp(x - m), dtype=np.float32)))


def top_columns(values: np.ndarray, k: int) -> np.ndarray:
    """The columns of the k largest values, largest first."""
    k = min(k, values.shape[0])
    # every column above the k-th value, then the lowest columns equal to it (so that ties
    # cut the same way every time)
    kth = np.partition(values, values.shape[0] - k)[values.shape[0] - k]
    above = np.flatnonzero(values > kth)
    best = np.concatenate([above, np.flatnonzero(values == kth)[:k - len(above)]])
    return best[np.lexsort((best, -values[best]))]


def column_of(token: int, head) -> int:
    """The logit column of a token (head: a cut head's token ids, in its order; None:
    column = token id)."""
    return token if head is None else int(np.flatnonzero(head == token)[0])


def row_logprobs(logits: np.ndarray, token: int, k: int, head=None) -> TokenLogprob:
    """The TokenLogprob of `token` in one row of logits over the head's tokens (`head`:
    the token id of each column of a cut head; None: column = token id)."""
    lp = log_softmax(logits)
    top: Tuple[Tuple[int, float], ...] = ()
    if k > 0:
        best = top_columns(lp, k)
        ids = best if head is None else head[best]
        top = tuple((int(t), float(lp[c])) for t, c in zip(ids, best))
    return TokenLogprob(int(token), float(lp[column_of(token, head)]), top)


def token_logprobs(target, rows: Sequence[int], tokens: Sequence[int], k: int) -> List[TokenLogprob]:
    """The TokenLogprob of tokens[i] at row rows[i] of the target's last call."""
    head = target.head_tokens
    return [row_logprobs(target.raw_logits(r, 1)[0], t, k, head) for r, t in zip(rows, tokens)]


def over_vocabulary(logits: np.ndarray, head, n_vocab: int) -> np.ndarray:
    """A row's logits over the whole vocabulary (a cut head's: -inf past the tokens it keeps)."""
    if head is None:
        return np.asarray(logits, dtype=np.float64)
    x = np.full(n_vocab, -np.inf)
    x[np.asarray(head)] = logits
    return x


def row_probs(logits: np.ndarray, token: int, k: int, params: SamplingParams) -> TokenProb:
    """The TokenProb of `token` in one row of logits over the vocabulary (the bias and
    penalties applied), under the sampling rules that follow them in `params`."""
    if params.greedy:
        p = np.zeros(len(logits))
        p[token] = 1.0
    else:
        p = distribution(logits, params)[0]
    top: Tuple[Tuple[int, float], ...] = ()
    if k > 0:
        top = tuple((int(c), float(p[c])) for c in top_columns(p, k) if p[c] > 0)
    return TokenProb(int(token), float(p[token]), top)


def token_probs(target, rows: Sequence[int], tokens: Sequence[int], k: int,
                params: SamplingParams) -> List[TokenProb]:
    """The TokenProb of tokens[i] at row rows[i] of the target's last call."""
    head = None if target.head_tokens is None else np.asarray(target.head_tokens)
    return [row_probs(over_vocabulary(target.logits(r, 1)[0], head, target.n_vocab), t, k, params)
            for r, t in zip(rows, tokens)]
