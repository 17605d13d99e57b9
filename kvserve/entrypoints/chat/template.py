"""Chat templates: where they come from and how one is rendered (in a Jinja sandbox).

A chat template is *code*, and it belongs to the operator: the model's own template,
or ``kvserve serve --chat-template FILE|STRING`` / ``LLM(chat_template=...)``. A
request may only bring its own with ``--trust-request-chat-template`` (see
``kvserve.entrypoints.chat.prompt``).

Rendering (:func:`render_template`) runs in jinja2's ``ImmutableSandboxedEnvironment``
(no attribute escapes such as ``__class__``/``__globals__``, no mutation of the
messages, ``range`` capped), with the same options and helpers as Hugging Face's
``apply_chat_template`` (``trim_blocks``, ``lstrip_blocks``, ``loopcontrols``,
``raise_exception``, ``strftime_now``, a ``tojson`` that keeps non-ASCII, and a
``{% generation %}`` block that renders its body), so a model's template gives the
text transformers gives. The rendered text is capped at ``max_chars`` while it is
produced. Time is bounded by where this runs: the server renders in worker
*processes* (``render_pool``) that are killed past their deadline; this module
itself never blocks on anything but the template.

This module imports only jinja2 and the standard library: the render worker
processes import it and nothing heavier.
"""

from __future__ import annotations

import json
import os
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

# Names a template sees that ``chat_template_kwargs`` may not replace.
RESERVED_NAMES = frozenset(
    {
        "messages",
        "tools",
        "documents",
        "add_generation_prompt",
        "continue_final_message",
        "chat_template",
        "tokenize",
        "raise_exception",
        "strftime_now",
        "range",
        "namespace",
        "loop",
        "self",
        "cycler",
        "joiner",
        "lipsum",
        "dict",
    }
)

# The longest template text accepted (a file or a string); real ones are < 20 KB.
MAX_TEMPLATE_CHARS = 256 * 1024


class TemplateError(ValueError):
    """A template that cannot be used or that refused these inputs; the message says
    why (the server answers 400 with it)."""


class TemplateTimeoutError(TemplateError):
    """A render that ran past its deadline (the server answers 400; the worker that
    ran it was killed)."""


def load_chat_template(value: str | os.PathLike[str]) -> str:
    """``--chat-template FILE|STRING``: the text of ``value`` when it names a readable
    file, else ``value`` itself when it looks like a Jinja template (contains ``{{``
    or ``{%``). Raises :class:`TemplateError` (with the fix) otherwise, or when the
    template does not compile."""
    text: str | None = None
    candidate = Path(value)
    try:
        is_file = len(str(value)) < 4096 and candidate.is_file()
    except OSError:
        is_file = False
    if is_file:
        try:
            text = candidate.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise TemplateError(f"cannot read the chat template file {str(value)!r}: {e}") from e
    elif isinstance(value, str) and ("{{" in value or "{%" in value):
        text = value
    if text is None:
        raise TemplateError(
            f"--chat-template {str(value)[:80]!r} is neither a readable file nor a Jinja "
            "template string: pass a path to a .jinja file or the template text itself "
            "(for example \"{% for m in messages %}{{ m['content'] }}{% endfor %}\")"
        )
    check_template(text)
    return text


def check_template(text: str) -> None:
    """Raise :class:`TemplateError` unless ``text`` is a template of acceptable size
    that compiles in the sandbox."""
    if not isinstance(text, str) or not text:
        raise TemplateError("the chat template is empty: pass the Jinja text of a template")
    if len(text) > MAX_TEMPLATE_CHARS:
        raise TemplateError(
            f"the chat template has {len(text)} characters, more than {MAX_TEMPLATE_CHARS}: "
            "chat templates are a few KB; check that the right file was given"
        )
    try:
        _compile(text)
    except jinja2.TemplateSyntaxError as e:
        raise TemplateError(f"the chat template does not compile: {e} (line {e.lineno})") from e


class _GenerationBlock(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` (HF's assistant-mask marker):
    renders its body unchanged."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body, lineno=lineno)


def _raise_exception(message: str) -> None:
    raise TemplateError(f"the chat template refused these messages: {message}")


def _tojson(
    value: Any, ensure_ascii: bool = False, indent: int | None = None, **kwargs: Any
) -> str:
    if indent is not None and (not isinstance(indent, int) or not 0 <= indent <= 16):
        raise TemplateError("tojson indent must be an integer from 0 to 16")
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, sort_keys=False)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(str(fmt)[:64])


def _new_environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationBlock, jinja2.ext.loopcontrols],
        autoescape=False,
        cache_size=0,
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


_ENV: ImmutableSandboxedEnvironment | None = None
_COMPILED: dict[str, jinja2.Template] = {}
_MAX_COMPILED = 32


def _compile(text: str) -> jinja2.Template:
    global _ENV
    hit = _COMPILED.get(text)
    if hit is not None:
        return hit
    if _ENV is None:
        _ENV = _new_environment()
    template = _ENV.from_string(text)
    if len(_COMPILED) >= _MAX_COMPILED:
        _COMPILED.pop(next(iter(_COMPILED)))
    _COMPILED[text] = template
    return template


def render_template(
    template: str,
    messages: list[dict[str, Any]],
    /,
    *,
    tools: list[dict[str, Any]] | None = None,
    add_generation_prompt: bool = True,
    special_tokens: dict[str, str] | None = None,
    max_chars: int = 64 * 1024 * 1024,
    variables: dict[str, Any] | None = None,
    **kwargs: Any,
) -> str:
    """Render ``template`` over ``messages`` in the sandbox and return the text.

    ``tools`` is passed as the template's ``tools`` (None: undefined-free ``None``);
    ``special_tokens`` are HF's ``bos_token``/``eos_token``/... variables;
    ``variables`` (a request's ``chat_template_kwargs``: always pass client data
    here, never as ``**kwargs``, so it cannot set this function's own options) and
    ``kwargs`` are extra template variables (``enable_thinking``...) and may not use
    a :data:`RESERVED_NAMES` name. Raises :class:`TemplateError` for a template that
    does not compile, refuses the inputs (``raise_exception``, a sandbox violation,
    any error it raises) or renders more than ``max_chars`` characters."""
    kwargs = {**(variables or {}), **kwargs}
    bad = sorted(k for k in kwargs if k in RESERVED_NAMES or not str(k).isidentifier())
    if bad:
        raise TemplateError(
            f"chat_template_kwargs may not set {bad[0]!r}: it is reserved by the chat "
            "template (messages, tools and add_generation_prompt are request fields)"
        )
    compiled = _compile(template)
    names: dict[str, Any] = {
        **(special_tokens or {}),
        **kwargs,
        "messages": messages,
        "tools": tools,
        "add_generation_prompt": add_generation_prompt,
    }
    pieces: list[str] = []
    size = 0
    try:
        for piece in compiled.generate(**names):
            size += len(piece)
            if size > max_chars:
                raise TemplateError(
                    f"the chat template rendered more than {max_chars} characters for these "
                    "messages, more than the model's context can hold: shorten the messages"
                )
            pieces.append(piece)
    except TemplateError:
        raise
    except jinja2.exceptions.SecurityError as e:
        raise TemplateError(f"the chat template tried an operation the sandbox forbids: {e}") from e
    except RecursionError:
        raise TemplateError("the chat template recursed too deeply") from None
    except MemoryError:
        raise TemplateError("the chat template ran out of memory while rendering") from None
    except Exception as e:  # any error the template raises is about these inputs
        raise TemplateError(
            f"the chat template failed on these messages: {type(e).__name__}: {e}"
        ) from e
    return "".join(pieces)


def render_job(job: dict[str, Any]) -> list[str]:
    """One text per ``job["variants"]`` entry (a list of messages), by
    :func:`render_template` with the job's template, tools, generation prompt, special
    tokens, ``max_chars`` and extra variables (``kwargs``): the job of
    ``render_worker``. Raises what :func:`render_template` raises."""
    return [
        render_template(
            job["template"],
            messages,
            tools=job.get("tools"),
            add_generation_prompt=bool(job.get("add_generation_prompt", True)),
            special_tokens=job.get("special_tokens") or {},
            max_chars=int(job.get("max_chars", 64 * 1024 * 1024)),
            variables=job.get("kwargs") or {},
        )
        for messages in job["variants"]
    ]
