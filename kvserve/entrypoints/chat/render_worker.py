"""A chat-template render worker process (``python -m kvserve.entrypoints.chat.render_worker``).

Started by :class:`kvserve.entrypoints.chat.render_pool.RenderPool`. Reads jobs from
stdin and writes answers to stdout, each a 4-byte big-endian length then UTF-8 JSON:

    job     {"template", "variants": [messages, ...], "tools", "add_generation_prompt",
             "special_tokens", "kwargs", "max_chars"}
    answer  {"ok": true, "texts": [one rendered text per variant]}
            {"ok": false, "error": "why (the client's 400 message)"}

Its address space is capped (``KVSERVE_RENDER_MEMORY_BYTES``) so a template that
builds huge strings fails here with MemoryError instead of taking the server's
memory; its time is capped by the parent, which kills it past the deadline.
Imports jinja2, ``chat.template`` and ``kvserve.child_process`` only.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

from kvserve.child_process import serve_frames


def _answer(job: dict[str, Any]) -> dict[str, Any]:
    from kvserve.entrypoints.chat.template import TemplateError, render_job

    try:
        texts = render_job(job)
    except TemplateError as e:
        return {"ok": False, "error": str(e)}
    except MemoryError:
        return {"ok": False, "error": "the chat template ran out of memory while rendering"}
    return {"ok": True, "texts": texts}


def main() -> int:
    limit = int(os.environ.get("KVSERVE_RENDER_MEMORY_BYTES", "0") or 0)
    if limit > 0:
        import resource

        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    import kvserve.entrypoints.chat.template  # noqa: F401  (warm: jinja2 loaded before jobs)

    return serve_frames(_answer_frame)


def _answer_frame(body: bytes) -> bytes:
    try:
        answer = _answer(json.loads(body))
    except MemoryError:
        answer = {"ok": False, "error": "the chat template ran out of memory while rendering"}
    except Exception as e:  # a malformed job is the parent's bug; report, keep serving
        answer = {"ok": False, "error": f"render worker error: {type(e).__name__}: {e}"}
    return json.dumps(answer, ensure_ascii=False).encode("utf-8", "surrogatepass")


if __name__ == "__main__":
    sys.exit(main())
