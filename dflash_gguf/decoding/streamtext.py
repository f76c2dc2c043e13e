"""What a parser of streamed text holds back: text that may be the start of a marker it
looks for (a stop string, a thinking tag, a tool call's opening, a harmony header) is not
passed on until the next text decides it."""
from __future__ import annotations

from typing import Sequence


def partial_marker(text: str, markers: Sequence[str]) -> int:
    """Length of the longest tail of `text` that is a proper prefix of one of `markers`."""
    best = 0
    for marker in markers:
        for n in range(min(len(marker) - 1, len(text)), best, -1):
            if text.endswith(marker[:n]):
                best = n
                break
    return best
