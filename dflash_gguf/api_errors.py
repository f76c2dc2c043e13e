"""The error a request handler raises for a request the server refuses."""
from __future__ import annotations

from typing import Optional


class BadRequest(Exception):
    """The request is refused with `status` (400 unless said otherwise); `param` names
    the field at fault, when one is."""

    def __init__(self, message: str, param: Optional[str] = None, status: int = 400):
        super().__init__(message)
        self.param = param
        self.status = status
