"""Workload files for ``kvserve simulate``: parsing, validation, deterministic prompts.

A workload is a JSON object::

    {"requests": [
        {"id": "A", "arrival_step": 0, "prompt_len": 2048, "max_tokens": 16,
         "shared_prefix": {"id": "sys", "len": 1024},
         "mutate": [[5, 999]], "cache_salt": "t1"},
        {"id": "B", "prompt_token_ids": [1, 2, 3], "max_tokens": 4}
    ]}

Only ``id``, ``prompt_len`` (or ``prompt_token_ids``) and ``max_tokens`` are
required; ``arrival_step`` defaults to 0. Prompt tokens are deterministic:

    prompt = prefix_tokens(shared_prefix.id)[:len] + unique_tokens(id)[: prompt_len - len]
    then mutate: prompt[index] = value for each [index, value]

so requests naming the same shared prefix id share those tokens (and can hit the
prefix cache) while the rest of every prompt is its own. Unknown keys are refused so
a typo never silently changes a simulation.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvserve.config import is_int

VOCAB_SIZE = 32000  # generated token ids lie in [1, VOCAB_SIZE)

_KEYS = {
    "id",
    "arrival_step",
    "prompt_len",
    "prompt_token_ids",
    "max_tokens",
    "shared_prefix",
    "mutate",
    "cache_salt",
}
_EXAMPLE = '{"requests": [{"id": "A", "prompt_len": 2048, "max_tokens": 16}]}'


@dataclass(frozen=True)
class WorkloadRequest:
    """One simulated request, with its prompt already built."""

    req_id: str
    arrival_step: int
    prompt_token_ids: tuple[int, ...]
    max_tokens: int
    cache_salt: str | None = None

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)


def _stream(seed: str, n: int) -> list[int]:
    rng = random.Random(seed)  # str seeds are hashed with sha512: stable across processes
    return [1 + rng.randrange(VOCAB_SIZE - 1) for _ in range(n)]


def prefix_tokens(prefix_id: str, n: int) -> list[int]:
    """The first ``n`` tokens of shared prefix ``prefix_id`` (same in every request)."""
    return _stream(f"kvserve.sim.prefix:{prefix_id}", n)


def unique_tokens(req_id: str, n: int) -> list[int]:
    """``n`` tokens that belong to request ``req_id`` alone."""
    return _stream(f"kvserve.sim.request:{req_id}", n)


def _parse_request(i: int, item: object, source: str) -> WorkloadRequest:
    if not isinstance(item, dict):
        raise ValueError(f"{source}: requests[{i}] must be an object, got {item!r}")
    req_id = item.get("id")
    where = f"{source}: requests[{i}]" + (f" (id {req_id!r})" if req_id is not None else "")

    def bad(key: str, rule: str, example: str) -> ValueError:
        return ValueError(
            f"{where}: invalid {key}={item.get(key)!r}: {rule} (for example: {example})"
        )

    unknown = sorted(set(item) - _KEYS)
    if unknown:
        raise ValueError(
            f"{where}: unknown key(s) {', '.join(unknown)}; valid keys are {', '.join(sorted(_KEYS))}"
        )
    if not isinstance(req_id, str) or not req_id:
        raise bad("id", "must be a non-empty string", '"id": "A"')
    arrival = item.get("arrival_step", 0)
    if not is_int(arrival) or arrival < 0:
        raise bad("arrival_step", "must be an integer >= 0", '"arrival_step": 0')
    max_tokens = item.get("max_tokens")
    if not is_int(max_tokens) or max_tokens < 1:
        raise bad("max_tokens", "is required and must be a positive integer", '"max_tokens": 16')
    salt = item.get("cache_salt")
    if salt is not None and not isinstance(salt, str):
        raise bad("cache_salt", "must be a string", '"cache_salt": "tenant-a"')

    explicit = item.get("prompt_token_ids")
    prompt_len = item.get("prompt_len")
    if explicit is not None:
        if (
            not isinstance(explicit, list)
            or not explicit
            or not all(is_int(t) and t >= 0 for t in explicit)
        ):
            raise bad(
                "prompt_token_ids",
                "must be a non-empty list of integers >= 0",
                '"prompt_token_ids": [1, 2, 3]',
            )
        if prompt_len is not None and prompt_len != len(explicit):
            raise bad(
                "prompt_len",
                f"must equal len(prompt_token_ids) = {len(explicit)} or be left out",
                f'"prompt_len": {len(explicit)}',
            )
        if "shared_prefix" in item:
            raise ValueError(
                f"{where}: give either prompt_token_ids or shared_prefix, not both "
                '(for example: "prompt_len": 2048, "shared_prefix": {"id": "sys", "len": 1024})'
            )
        tokens = list(explicit)
    else:
        if not is_int(prompt_len) or prompt_len < 1:
            raise bad(
                "prompt_len",
                "is required (or prompt_token_ids) and must be a positive integer",
                '"prompt_len": 2048',
            )
        num_shared = 0
        tokens = []
        shared = item.get("shared_prefix")
        if shared is not None:
            if (
                not isinstance(shared, dict)
                or set(shared) != {"id", "len"}
                or not isinstance(shared["id"], str)
                or not shared["id"]
                or not is_int(shared["len"])
                or not 0 <= shared["len"] <= prompt_len
            ):
                raise bad(
                    "shared_prefix",
                    f'must be {{"id": <non-empty string>, "len": <integer from 0 to prompt_len={prompt_len}>}}',
                    '"shared_prefix": {"id": "sys", "len": 1024}',
                )
            num_shared = shared["len"]
            tokens = prefix_tokens(shared["id"], num_shared)
        tokens += unique_tokens(req_id, prompt_len - num_shared)

    mutate = item.get("mutate", [])
    if not isinstance(mutate, list):
        raise bad("mutate", "must be a list of [index, value] pairs", '"mutate": [[5, 999]]')
    for pair in mutate:
        if (
            not isinstance(pair, list)
            or len(pair) != 2
            or not all(is_int(v) for v in pair)
            or not 0 <= pair[0] < len(tokens)
            or pair[1] < 0
        ):
            raise bad(
                "mutate",
                f"every entry must be [index, value] with 0 <= index < {len(tokens)} and value >= 0, got {pair!r}",
                '"mutate": [[5, 999]]',
            )
        tokens[pair[0]] = pair[1]
    return WorkloadRequest(req_id, arrival, tuple(tokens), max_tokens, salt)


def parse_workload(data: Any, source: str = "workload") -> list[WorkloadRequest]:
    """Validate a decoded workload object; raise ValueError naming the request, the
    key, the rule and a valid example. Request order is kept."""
    if not isinstance(data, dict) or not isinstance(data.get("requests"), list):
        raise ValueError(f'{source}: must be an object with a "requests" list, e.g. {_EXAMPLE}')
    extra = sorted(set(data) - {"requests"})
    if extra:
        raise ValueError(
            f'{source}: unknown top-level key(s) {", ".join(extra)}; only "requests" is read'
        )
    if not data["requests"]:
        raise ValueError(f"{source}: the requests list is empty; add at least one, e.g. {_EXAMPLE}")
    requests = [_parse_request(i, item, source) for i, item in enumerate(data["requests"])]
    seen: set[str] = set()
    for r in requests:
        if r.req_id in seen:
            raise ValueError(f"{source}: request id {r.req_id!r} appears twice; ids must be unique")
        seen.add(r.req_id)
    return requests


def load_workload(path: str | Path) -> list[WorkloadRequest]:
    """Read and validate a workload file (``"-"`` reads standard input)."""
    import sys

    source = str(path)
    try:
        text = sys.stdin.read() if source == "-" else Path(path).read_text(encoding="utf-8")
    except OSError as e:
        raise ValueError(f"cannot read workload file {source!r}: {e.strerror or e}") from e
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(
            f"{source}: not valid JSON ({e.msg} at line {e.lineno}, column {e.colno}); "
            f"a workload looks like {_EXAMPLE}"
        ) from e
    return parse_workload(data, source)
