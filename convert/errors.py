"""The error type the command line reports as a message, without a traceback."""
from __future__ import annotations


class ConversionError(Exception):
    """A problem with the user's input (paths, checkpoint, options); exit code 2."""
