"""Small HTTP extras of the OpenAI server: Swagger UI at ``/docs`` from the
``swagger-ui-bundle`` package (no CDN), metric name aliases (``vllm:`` names for
vLLM dashboards), and the list of request fields the server ignores (sent back in
the ``x-kvserve-ignored-fields`` header and logged once per field name)."""

from __future__ import annotations

import logging
import mimetypes
import re
from pathlib import Path
from typing import Any

from pydantic import BaseModel

logger = logging.getLogger("kvserve.entrypoints")

IGNORED_FIELDS_HEADER = "x-kvserve-ignored-fields"
# Fields kvserve accepts and knowingly does nothing with (OpenAI bookkeeping).
KNOWN_IGNORED = frozenset(
    {"user", "metadata", "store", "service_tier", "guided_decoding_backend", "truncation"}
)
_logged: set[str] = set()  # names already logged (bounded: clients choose them)
MAX_LOGGED_NAMES = 1024


def ignored_fields(req: BaseModel, prefix: str = "") -> list[str]:
    """The top-level fields of ``req`` the server does not act on: every field it
    does not know (pydantic extras) plus the known no-ops that were sent."""
    extra = sorted((req.model_extra or {}).keys())
    sent = req.model_fields_set
    known = sorted(name for name in KNOWN_IGNORED if name in sent)
    unused = getattr(req, "unused_fields", None)
    lost = unused() if callable(unused) else []
    # (pydantic counts extras as set too: each name once, in first-seen order)
    names = [prefix + n for n in dict.fromkeys(extra + known + lost)]
    for name in names:
        if name not in _logged and len(_logged) < MAX_LOGGED_NAMES:
            _logged.add(name)
            logger.info("ignoring request field %r (kvserve does not use it)", name)
    return names


MAX_HEADER_NAMES = 32


def ignored_header(names: list[str]) -> dict[str, str]:
    """The ``x-kvserve-ignored-fields`` header: names comma-separated, each in
    ASCII (``ascii()`` escapes, so any field name fits an HTTP header), at most
    :data:`MAX_HEADER_NAMES` then ``+N more``."""
    if not names:
        return {}
    shown = [ascii(n)[1:-1].replace(",", "\\x2c") for n in names[:MAX_HEADER_NAMES]]
    if len(names) > MAX_HEADER_NAMES:
        shown.append(f"+{len(names) - MAX_HEADER_NAMES} more")
    return {IGNORED_FIELDS_HEADER: ",".join(shown)}


# ---------------------------------------------------------------------- metrics
_NAME_LINE = re.compile(r"^(# (?:HELP|TYPE) )?kvserve:", re.M)


def alias_metrics(text: bytes, prefix: str | None) -> bytes:
    """The Prometheus text with every ``kvserve:`` family repeated under ``prefix``
    (e.g. ``vllm:``); unchanged for None or ``kvserve:``."""
    if not prefix or prefix == "kvserve:":
        return text
    body = text.decode()
    lines = body.splitlines()
    extra = [
        _NAME_LINE.sub(lambda m: (m.group(1) or "") + prefix, line)
        for line in lines
        if _NAME_LINE.match(line)
    ]
    return (body.rstrip("\n") + "\n" + "\n".join(extra) + "\n").encode()


def check_metrics_prefix(prefix: str) -> str:
    """A metric name prefix: letters, digits, ``_`` and ``:``, ending in ``:`` or
    ``_``; ValueError with an example otherwise."""
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_:]*[:_]", prefix):
        raise ValueError(
            f"invalid --metrics-prefix {prefix!r}: use a Prometheus name prefix ending in "
            "':' or '_', for example vllm: (or 'none' for kvserve: names only)"
        )
    return prefix


# ---------------------------------------------------------------------- /docs
def swagger_dir() -> Path | None:
    """The folder of Swagger UI's assets from the ``swagger-ui-bundle`` package."""
    try:
        import swagger_ui_bundle
    except ImportError:
        return None
    return Path(swagger_ui_bundle.swagger_ui_path)


def docs_html(openapi_url: str, assets_url: str) -> str:
    return f"""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>kvserve - Swagger UI</title>
<link rel="stylesheet" href="{assets_url}/swagger-ui.css">
</head>
<body>
<div id="swagger-ui"></div>
<script src="{assets_url}/swagger-ui-bundle.js"></script>
<script src="{assets_url}/swagger-ui-standalone-preset.js"></script>
<script>
window.ui = SwaggerUIBundle({{
  url: "{openapi_url}",
  dom_id: "#swagger-ui",
  presets: [SwaggerUIBundle.presets.apis, SwaggerUIStandalonePreset],
  layout: "BaseLayout"
}});
</script>
</body>
</html>
"""


ASSETS = (
    "swagger-ui.css",
    "swagger-ui-bundle.js",
    "swagger-ui-standalone-preset.js",
    "favicon-32x32.png",
)


def asset(name: str) -> tuple[bytes, str] | None:
    """(bytes, media type) of one Swagger UI asset; None for any other name."""
    folder = swagger_dir()
    if folder is None or name not in ASSETS:
        return None
    path = folder / name
    if not path.is_file():
        return None
    media = mimetypes.guess_type(name)[0] or "application/octet-stream"
    return path.read_bytes(), media


def model_card(served: str, root: str, created: int, max_model_len: int) -> dict[str, Any]:
    return {
        "id": served,
        "object": "model",
        "created": created,
        "owned_by": "kvserve",
        "root": root,
        "parent": None,
        "max_model_len": max_model_len,
    }
