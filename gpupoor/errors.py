"""Errors meant for people. Anything raised as a UserError exits with code 2 and no traceback."""

from __future__ import annotations

EXIT_BAD_INPUT = 2
EXIT_DOES_NOT_FIT = 3  # gpupoor plan: the recipe is predicted not to fit the memory
EXIT_RESUMABLE = 75  # stopped early on purpose (signal, time limit); `gpupoor resume` continues


class UserError(Exception):
    """Bad input: a recipe, a data file, a run directory. The message says what, where and what to do."""

    def __init__(self, message: str, *, hint: str | None = None):
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        return self.message if not self.hint else f"{self.message}\n  hint: {self.hint}"
