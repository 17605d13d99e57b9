"""The error a request that can never be served raises (its own module, at the
bottom of the import graph, so every layer can raise it without importing
``kvserve.request``)."""

from __future__ import annotations


class RequestError(ValueError):
    """A request that can never be served as sent. The message says what to change;
    ``param`` names the field at fault in engine terms (``"prompt"``, ``"max_tokens"``,
    a :class:`SamplingParams` field), so a front end can point at it without reading
    the text; ``code`` is OpenAI's error code for it."""

    def __init__(
        self, message: str, *, param: str | None = None, code: str = "invalid_value"
    ) -> None:
        super().__init__(message)
        self.param = param
        self.code = code
