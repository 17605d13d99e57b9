"""``StructuredOutputsParams``: the one constraint a request puts on its output.

Plain data, no grammar library: the request, the scheduler and the front ends use it;
only :mod:`kvserve.structured.compiler` turns it into a grammar. The fields are
vLLM's ``structured_outputs`` (``json``, ``regex``, ``choice``, ``grammar``,
``json_object``); OpenAI's ``response_format`` maps onto ``json`` (json_schema) or
``json_object``. Exactly one must be set.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from kvserve.errors import RequestError

KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass(frozen=True)
class StructuredOutputsParams:
    """One constraint on the output text; validated on construction (shape only: a
    schema or regex that does not compile is refused later, by the compiler, with a
    :class:`RequestError` naming it).

    ``json``: a JSON schema (dict or JSON text); ``regex``: a regular expression the
    whole output matches; ``choice``: the output is one of these strings;
    ``grammar``: a Lark grammar (llguidance's dialect; GBNF is accepted too);
    ``json_object``: any JSON object.

    ``within_max_tokens`` (not a constraint, a rule about how it ends; forced tool
    calls set it): the output always completes to a string the constraint accepts
    within ``max_tokens``. Near the end of the budget the engine steers the output
    onto the shortest completion it knows (``kvserve.structured.budget``), e.g.
    closing a runaway JSON string; a ``max_tokens`` too small for even that is
    refused before anything is queued. Without it an output cut by ``max_tokens``
    ends where it was cut (``finish_reason: "length"``).
    """

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool = False
    within_max_tokens: bool = False

    def __post_init__(self) -> None:
        if self.choice is not None and not isinstance(self.choice, tuple):
            object.__setattr__(self, "choice", tuple(self.choice))
        set_ = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(set_) != 1:
            raise RequestError(
                f"structured_outputs sets {set_ or 'nothing'}: set exactly one of "
                f'{", ".join(KINDS)}; for example {{"choice": ["yes", "no"]}}',
                param="structured_outputs",
            )
        if isinstance(self.json, str):
            try:
                json.loads(self.json)
            except (ValueError, RecursionError) as e:
                raise RequestError(
                    f"structured_outputs.json is not valid JSON ({e}): send a JSON schema "
                    'object, for example {"type": "object"}',
                    param="structured_outputs.json",
                ) from None
        if self.json is not None and not isinstance(self.json, dict | str):
            raise RequestError(
                "structured_outputs.json must be a JSON schema object",
                param="structured_outputs.json",
            )
        if self.choice is not None and (
            not self.choice or any(not isinstance(c, str) or not c for c in self.choice)
        ):
            raise RequestError(
                "structured_outputs.choice must be a non-empty list of non-empty strings, for "
                'example ["yes", "no"]',
                param="structured_outputs.choice",
            )
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise RequestError(
                    f"structured_outputs.{name} must be a non-empty string",
                    param=f"structured_outputs.{name}",
                )

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    def key(self) -> tuple[str, str]:
        """A hashable key naming the grammar (the compiler's cache key)."""
        kind = self.kind
        value: Any = getattr(self, kind)
        if kind == "json" and isinstance(value, dict):
            value = json.dumps(value, sort_keys=True)
        elif kind == "choice":
            value = json.dumps(list(value))
        return kind, str(value)
