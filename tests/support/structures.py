"""Hostile structured-output constraints of any size, for the hardening tests."""

from __future__ import annotations

from typing import Any


def chain_grammar(n: int) -> str:
    """``n`` chained grammar rules (a native stack overflow at 3,000 without limits)."""
    rules = "\n".join(f'r{i}: "tok{i}" r{i + 1} | "end{i}"' for i in range(n))
    return f'start: r0\n{rules}\nr{n}: "z"'


def deep_schema(depth: int) -> dict[str, Any]:
    """A JSON schema of objects nested ``depth`` deep."""
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema
