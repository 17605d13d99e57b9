"""Bounds on the request-supplied structures a native grammar library walks.

llguidance parses Lark grammars, regexes and JSON schemas with recursive native
code: a deep enough structure overflows its stack and kills the whole server.
Everything a request can hand the compiler is therefore checked
here first, in pure Python with loops (no recursion), in time linear in its size:

    grammar   at most MAX_GRAMMAR_BYTES bytes, MAX_GRAMMAR_RULES rules,
              brackets nested at most MAX_NESTING deep
    regex     at most MAX_REGEX_BYTES bytes, groups/classes nested at most
              MAX_NESTING deep, every repetition count {n,m} at most MAX_REPEAT
    json      (a JSON schema, also a tool's ``parameters``) at most
              MAX_SCHEMA_BYTES bytes of JSON, MAX_SCHEMA_NODES containers and
              values, containers nested at most MAX_SCHEMA_DEPTH deep; every
              ``pattern`` / ``patternProperties`` key is checked as a regex
    choice    at most MAX_CHOICES strings, MAX_GRAMMAR_BYTES bytes in all

Rules a caller must keep: call :func:`check_structure` before the value reaches
native code; it raises :class:`RequestError` naming the field and the bound, and
changes nothing. A value inside the bounds can still fail to compile or be slow to:
the compiler runs it in a worker process with a time limit
(:mod:`kvserve.structured.compile_pool`).
"""

from __future__ import annotations

import json
import re
from typing import Any

from kvserve.errors import RequestError

MAX_GRAMMAR_BYTES = 256 * 1024
MAX_GRAMMAR_RULES = 1_000
MAX_NESTING = 64
MAX_REGEX_BYTES = 16 * 1024
MAX_REPEAT = 1_000
MAX_SCHEMA_BYTES = 512 * 1024
MAX_SCHEMA_NODES = 20_000
MAX_SCHEMA_DEPTH = 32
MAX_CHOICES = 1_000

_RULE = re.compile(r"^\s*[?!]?[A-Za-z_][\w.-]*(?:\.\d+)?\s*(?::|::=)", re.MULTILINE)
_REPEAT = re.compile(r"\{\s*(\d*)\s*(?:,\s*(\d*)\s*)?\}")


def _refuse(field: str, what: str, fix: str) -> RequestError:
    return RequestError(f"{field} is too large for this server: {what}; {fix}", param=field)


def _nesting(text: str, opens: str, closes: str) -> int:
    """Deepest bracket nesting in ``text`` (quotes and escapes are not parsed: an
    over-estimate, which is the safe side)."""
    depth = deepest = 0
    escaped = False
    for ch in text:
        if escaped:
            escaped = False
            continue
        if ch == "\\":
            escaped = True
        elif ch in opens:
            depth += 1
            deepest = max(deepest, depth)
        elif ch in closes and depth > 0:
            depth -= 1
    return deepest


def check_regex(regex: str, field: str) -> None:
    """Raise RequestError if ``regex`` is past the bounds of the module docstring."""
    size = len(regex.encode("utf-8", "surrogatepass"))
    if size > MAX_REGEX_BYTES:
        raise _refuse(field, f"{size} bytes (at most {MAX_REGEX_BYTES})", "send a shorter regex")
    depth = _nesting(regex, "([", ")]")
    if depth > MAX_NESTING:
        raise _refuse(
            field, f"groups nested {depth} deep (at most {MAX_NESTING})", "flatten the regex"
        )
    for low, high in _REPEAT.findall(regex):
        for count in (low, high):
            if count and (len(count) > 6 or int(count) > MAX_REPEAT):
                raise _refuse(
                    field,
                    f"a repetition count of {count} (at most {MAX_REPEAT})",
                    "use a smaller {n,m} or an unbounded * / +",
                )


def check_grammar(grammar: str, field: str) -> None:
    """Raise RequestError if the Lark/GBNF ``grammar`` is past the bounds."""
    size = len(grammar.encode("utf-8", "surrogatepass"))
    if size > MAX_GRAMMAR_BYTES:
        raise _refuse(
            field, f"{size} bytes (at most {MAX_GRAMMAR_BYTES})", "send a smaller grammar"
        )
    rules = len(_RULE.findall(grammar))
    if rules > MAX_GRAMMAR_RULES:
        raise _refuse(
            field,
            f"{rules} rules (at most {MAX_GRAMMAR_RULES})",
            "merge rules (a chain of rules is better written with repetition: item+)",
        )
    depth = _nesting(grammar, "([{", ")]}")
    if depth > MAX_NESTING:
        raise _refuse(
            field, f"brackets nested {depth} deep (at most {MAX_NESTING})", "flatten the grammar"
        )


def check_schema(schema: Any, field: str) -> None:
    """Raise RequestError if the JSON schema ``schema`` (a dict, or JSON text) is past
    the bounds; its ``pattern`` strings are checked as regexes."""
    if isinstance(schema, str):
        size = len(schema.encode("utf-8", "surrogatepass"))
        if size > MAX_SCHEMA_BYTES:
            raise _refuse(
                field, f"{size} bytes (at most {MAX_SCHEMA_BYTES})", "send a smaller schema"
            )
        try:
            schema = json.loads(schema)
        except RecursionError:
            raise _refuse(
                field, f"nested deeper than {MAX_SCHEMA_DEPTH}", "flatten the schema"
            ) from None
        except ValueError:
            return  # not JSON: StructuredOutputsParams reports it
    nodes = 0
    size = 0
    stack: list[tuple[Any, int]] = [(schema, 1)]
    while stack:
        value, depth = stack.pop()
        nodes += 1
        if nodes > MAX_SCHEMA_NODES:
            raise _refuse(field, f"more than {MAX_SCHEMA_NODES} values", "send a smaller schema")
        if isinstance(value, dict | list):
            if depth > MAX_SCHEMA_DEPTH:
                raise _refuse(
                    field,
                    f"objects/arrays nested more than {MAX_SCHEMA_DEPTH} deep",
                    "flatten the schema (a recursive structure is written with $ref)",
                )
            items = value.items() if isinstance(value, dict) else enumerate(value)
            for key, item in items:
                if isinstance(key, str):
                    size += len(key) + 3
                    if key == "pattern" and isinstance(item, str):
                        check_regex(item, f"{field}.pattern")
                    if key == "patternProperties" and isinstance(item, dict):
                        for pattern in item:
                            check_regex(str(pattern), f"{field}.patternProperties")
                stack.append((item, depth + 1))
        elif isinstance(value, str):
            size += len(value) + 2
        else:
            size += 8
        if size > MAX_SCHEMA_BYTES:
            raise _refuse(field, f"more than {MAX_SCHEMA_BYTES} bytes", "send a smaller schema")


def check_choices(choices: tuple[str, ...], field: str) -> None:
    """Raise RequestError if ``choices`` are past the bounds."""
    if len(choices) > MAX_CHOICES:
        raise _refuse(field, f"{len(choices)} choices (at most {MAX_CHOICES})", "send fewer")
    size = sum(len(c) for c in choices)
    if size > MAX_GRAMMAR_BYTES:
        raise _refuse(
            field, f"{size} characters in all (at most {MAX_GRAMMAR_BYTES})", "send shorter ones"
        )


def check_structure(kind: str, value: Any, field: str) -> None:
    """Dispatch on the constraint ``kind`` (``StructuredOutputsParams.kind``)."""
    if kind == "grammar" and isinstance(value, str):
        check_grammar(value, field)
    elif kind == "regex" and isinstance(value, str):
        check_regex(value, field)
    elif kind == "json" and value is not None:
        check_schema(value, field)
    elif kind == "choice" and value is not None:
        check_choices(tuple(value), field)
