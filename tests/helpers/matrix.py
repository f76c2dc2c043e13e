"""The heavy matrices' split between CI and whole runs (`pytest --full`): CI keeps a
representative few cases of each, chosen where the matrix is defined, and every other case
carries the `full` marker, which tests/conftest.py deselects unless --full is given."""
from __future__ import annotations

from typing import Callable, Iterable, List, Sequence

import pytest


def ci_subset(cases: Iterable, kept: Callable[[object], bool], ids: Sequence[str] | None = None) -> List:
    """`cases` as pytest params: those `kept(case)` chooses run everywhere, the rest only
    under --full. `ids`: the cases' test ids, in order."""
    cases = list(cases)
    out = []
    for i, case in enumerate(cases):
        marks = () if kept(case) else (pytest.mark.full,)
        values = case if isinstance(case, tuple) else (case,)
        out.append(pytest.param(*values, marks=marks, id=ids[i] if ids else None))
    return out
