"""The one error type of the LoRA layer."""

from __future__ import annotations


class LoRAError(ValueError):
    """An adapter that cannot be loaded, found or unloaded as asked.

    ``status`` is the HTTP status a front end should answer with: 400 for a bad
    adapter or body, 404 for an unknown name, 409 for a name in use or no free slot.
    The message says what was wrong and how to fix it.
    """

    def __init__(self, message: str, *, status: int = 400) -> None:
        super().__init__(message)
        self.status = status
