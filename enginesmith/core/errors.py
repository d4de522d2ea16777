"""User-facing errors.

A `UserError` is a mistake the user can fix (bad path, bad value, tampered engine). The CLI prints
it as one line, ``error: <what> (fix: <how>)``, and exits with its code; it never shows a traceback.
"""

from __future__ import annotations

# Exit codes: 0 ok, 1 internal error, 2 bad usage/input, 3 engine directory invalid, 130 interrupted,
# 143 terminated (SIGTERM).
EXIT_USAGE = 2
EXIT_ENGINE = 3
EXIT_INTERRUPTED = 130
EXIT_TERMINATED = 143   # SIGTERM, cleaned up like Ctrl-C


class UserError(Exception):
    """A problem with the user's input, with the fix in one line."""

    exit_code = EXIT_USAGE

    def __init__(self, what: str, fix: str = "") -> None:
        super().__init__(what)
        self.what = what
        self.fix = fix

    def __str__(self) -> str:
        return f"{self.what} (fix: {self.fix})" if self.fix else self.what


class EngineError(UserError):
    """The engine directory is missing, incomplete, altered or built for something else."""

    exit_code = EXIT_ENGINE
