"""The one error shape and integer check for configuration values (the bottom of the
import graph: ``config`` and ``sched/buckets`` both use them)."""

from __future__ import annotations

from typing import TypeGuard


def config_error(name: str, value: object, rule: str, example: str) -> ValueError:
    """The one error shape for bad configuration: value, rule, valid example."""
    return ValueError(f"invalid {name}={value!r}: {rule} (for example: {example})")


def is_int(value: object) -> TypeGuard[int]:
    """An ``int`` that is not a ``bool``."""
    return isinstance(value, int) and not isinstance(value, bool)


def check_int(name: str, value: object, example: str, *, minimum: int = 1, why: str = "") -> None:
    """The one integer check: raise :func:`config_error` unless ``value`` is an int
    (not a bool) ``>= minimum``; ``why`` is appended to the rule."""
    if not is_int(value) or value < minimum:
        rule = "must be a positive integer" if minimum == 1 else f"must be an integer >= {minimum}"
        raise config_error(name, value, rule + why, example)
