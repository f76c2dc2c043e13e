"""Errors of bad settings: an option out of its range (the C runtime's own failures are
native.DflashError)."""


class ConfigError(ValueError):
    """An option out of its range: `option` is its Engine keyword."""

    def __init__(self, option: str, message: str):
        super().__init__(message)
        self.option = option
