"""The target's log-probabilities at each emitted token (OpenAI's logprobs/top_logprobs,
llama-server's n_probs): read from the rows that chose the tokens, whichever call ran
them (a decode, a chain's or a tree's verify rows), and computed on the host alike.

Speculation does not change them: a verify's row computes bit for bit what a one-row
decode of the same position computes (docs/exactness.md), so the logits a row reads back
are plain decoding's, and so is every number derived from them here. They are the raw
model's (the log-softmax of the logits), before temperature, penalties or truncation."""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Sequence, Tuple

import numpy as np


@dataclass(frozen=True)
class TokenLogprob:
    """One emitted token's log-probability and the `top` most likely tokens of its row,
    most likely first (ties: the lower token id first), as (token, log-probability)."""

    token: int
    logprob: float
    top: Tuple[Tuple[int, float], ...] = ()


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """A row's log-probabilities, in float32, the same arithmetic for every row."""
    x = logits.astype(np.float32, copy=False)
    m = np.max(x)
    return x - (m + np.log(np.sum(np.exp(x - m), dtype=np.float32)))


def row_logprobs(logits: np.ndarray, token: int, k: int, head=None) -> TokenLogprob:
    """The TokenLogprob of `token` in one row of logits over the head's tokens (`head`:
    the token id of each column of a cut head; None: column = token id)."""
    lp = log_softmax(logits)
    column = token if head is None else int(np.flatnonzero(head == token)[0])
    top: Tuple[Tuple[int, float], ...] = ()
    if k > 0:
        k = min(k, lp.shape[0])
        # the k largest, by value then by column: every column above the k-th value, then
        # the lowest columns equal to it (so that ties cut the same way every time)
        kth = np.partition(lp, lp.shape[0] - k)[lp.shape[0] - k]
        above = np.flatnonzero(lp > kth)
        best = np.concatenate([above, np.flatnonzero(lp == kth)[:k - len(above)]])
        best = best[np.lexsort((best, -lp[best]))]
        ids = best if head is None else head[best]
        top = tuple((int(t), float(lp[c])) for t, c in zip(ids, best))
    return TokenLogprob(int(token), float(lp[column]), top)


def token_logprobs(target, rows: Sequence[int], tokens: Sequence[int], k: int) -> List[TokenLogprob]:
    """The TokenLogprob of tokens[i] at row rows[i] of the target's last call."""
    head = target.head_tokens
    return [row_logprobs(target.logits(r, 1)[0], t, k, head) for r, t in zip(rows, tokens)]
