"""A grammar-compile worker process (``python -m kvserve.structured.compile_worker``).

Started by :class:`kvserve.structured.compile_pool.CompilePool`. Its argument is
the path of a JSON file ``{"tokenizer": <HF tokenizer.json text>, "n_vocab",
"eos"}``; it builds the llguidance tokenizer once, then reads jobs from stdin and
writes answers to stdout, each a 4-byte big-endian length then UTF-8 JSON:

    job     {"kind": "json"|"regex"|"choice"|"grammar"|"json_object", "value": ...}
    answer  {"ok": true}  the constraint compiled and its matcher took a first token
            {"ok": false, "error": "why (the client's 400 message)"}

Each job runs on a thread whose stack is ``KVSERVE_COMPILE_STACK_BYTES`` (smaller
than the server's own compile thread: what passes here passes there), and the
address space is capped at ``KVSERVE_COMPILE_MEMORY_BYTES``. A native crash (stack
overflow, abort) or a runaway ends this process only; the parent answers 400 and
starts a fresh worker. Imports llguidance, ``structured.compiler`` and
``kvserve.child_process`` only (no torch).
"""

from __future__ import annotations

import json
import os
import sys
import threading
from typing import Any

from kvserve.child_process import serve_frames

DEFAULT_STACK_BYTES = 64 << 20


def compile_check(tokenizer: Any, kind: str, value: Any) -> str:
    """ "" when the constraint compiles and its matcher accepts a first token, else
    the error text. Blocking; may crash the process on hostile input."""
    from llguidance import LLMatcher

    from kvserve.structured.compiler import grammar_text
    from kvserve.structured.params import StructuredOutputsParams

    if kind == "choice":
        value = tuple(value)
    params = StructuredOutputsParams(**{kind: value})
    try:
        grammar = grammar_text(params)
    except (ValueError, TypeError) as e:
        return str(e)
    error = LLMatcher.validate_grammar(grammar, tokenizer)
    if error:
        return str(error)
    matcher = LLMatcher(tokenizer, grammar, log_level=0)
    if matcher.is_error():
        return str(matcher.get_error())
    mask = matcher.compute_bitmask()
    if matcher.is_error():
        return str(matcher.get_error())
    for i, byte in enumerate(mask):
        if byte:
            token = i * 8 + (byte & -byte).bit_length() - 1
            matcher.consume_token(token)
            if matcher.is_error():
                return str(matcher.get_error())
            break
    return ""


def _answer(tokenizer: Any, job: dict[str, Any], stack_bytes: int) -> dict[str, Any]:
    result: dict[str, Any] = {"ok": False, "error": "the compile did not run"}

    def work() -> None:
        nonlocal result
        try:
            error = compile_check(tokenizer, str(job["kind"]), job.get("value"))
        except MemoryError:
            error = "it needs more memory than this server allows a grammar"
        except RecursionError:
            error = "it nests too deeply"
        except Exception as e:  # noqa: BLE001 (reported to the client as its 400)
            error = str(e) or type(e).__name__
        result = {"ok": True} if not error else {"ok": False, "error": error}

    old = threading.stack_size(stack_bytes)
    try:
        thread = threading.Thread(target=work, name="kvserve-compile")
        thread.start()
    finally:
        threading.stack_size(old)
    thread.join()
    return result


def main() -> int:
    limit = int(os.environ.get("KVSERVE_COMPILE_MEMORY_BYTES", "0") or 0)
    stack_bytes = int(os.environ.get("KVSERVE_COMPILE_STACK_BYTES", "0") or DEFAULT_STACK_BYTES)
    from llguidance import LLTokenizer

    with open(sys.argv[1], encoding="utf-8") as f:
        spec = json.load(f)
    tokenizer = LLTokenizer(spec["tokenizer"], n_vocab=spec["n_vocab"], eos_token=spec["eos"])
    if limit > 0:
        import resource

        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    return serve_frames(
        lambda body: json.dumps(_answer(tokenizer, json.loads(body), stack_bytes)).encode("utf-8")
    )


if __name__ == "__main__":
    sys.exit(main())
