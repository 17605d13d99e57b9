"""Chat messages -> (prompt text, prompt token ids), the one way every front end does it.

:class:`ChatPromptBuilder` is used by the HTTP server (``/v1/chat/completions``,
``/tokenize`` with ``messages``) and by ``LLM.chat``. Its rules:

1. **The template is the operator's.** ``template`` (``--chat-template`` /
   ``LLM(chat_template=...)``, else the tokenizer's own) is used; a request's
   ``chat_template`` (top level or inside ``chat_template_kwargs``) is refused with
   :class:`ChatTemplateForbidden` unless the builder was made with
   ``trust_request_template=True`` (``--trust-request-chat-template``).
2. **Other ``chat_template_kwargs`` are data.** They become template variables, may
   not shadow a reserved name (``messages``, ``tools``, ``raise_exception``...) and
   may not contain special-token strings.
3. **Rendering is sandboxed and bounded** (``chat.template``; on the server in
   worker processes killed past their deadline, ``chat.render_pool``).
4. **User text never becomes control tokens.** When no message string contains a
   special-token string, the rendered prompt is tokenized whole (the same ids as
   ``apply_chat_template(..., tokenize=True)``). Otherwise the template is rendered
   twice: with the real messages, and with each such string replaced by a unique
   placeholder. If substituting the strings back into the placeholder rendering
   gives exactly the real rendering, the template's own text (between
   placeholders) is tokenized with special tokens and each string as plain text.
   If not (the template rewrote the content), the request is refused
   (:class:`ChatPromptError`) rather than guessed at.

``build`` blocks (rendering, tokenization): the server runs it in a worker thread.
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvserve.entrypoints.chat.template import (
    MAX_TEMPLATE_CHARS,
    TemplateError,
    render_job,
)
from kvserve.entrypoints.chat.tokenize import SafeTokenizer

RenderFn = Callable[[dict[str, Any]], list[str]]

TRUST_FLAG = "--trust-request-chat-template"


class ChatPromptError(ValueError):
    """These messages cannot become a prompt; ``param`` names the request field."""

    def __init__(self, message: str, *, param: str = "messages", code: str = "invalid_value"):
        super().__init__(message)
        self.param = param
        self.code = code


class ChatTemplateForbidden(ChatPromptError):
    """A request brought its own chat template and the server does not allow it."""


@dataclass
class ChatPrompt:
    text: str
    token_ids: list[int]
    #: True when some message text held special-token strings that were kept as text.
    split: bool = False


def render_in_process(job: dict[str, Any]) -> list[str]:
    """Render a job (see ``render_worker``) in this process and thread: sandboxed but
    not time-bounded (for the offline API, whose template is the caller's own)."""
    return render_job(job)


def _special_token_vars(tokenizer: Any) -> dict[str, str]:
    out: dict[str, str] = {}
    for key, value in (getattr(tokenizer, "special_tokens_map", None) or {}).items():
        if isinstance(value, str):
            out[key] = value
    return out


_PROBE_TOOL: dict[str, Any] = {
    "name": "kvserve_probe_tool_5b1e",
    "description": "probe",
    "parameters": {"type": "object", "properties": {}},
}


class ChatPromptBuilder:
    """See the module docstring. ``render`` runs render jobs (``RenderPool.render``
    on the server, :func:`render_in_process` offline); ``max_chars`` caps a rendered
    prompt."""

    def __init__(
        self,
        tokenizer: Any,
        *,
        template: str | None = None,
        render: RenderFn = render_in_process,
        trust_request_template: bool = False,
        max_chars: int = 64 * 1024 * 1024,
    ) -> None:
        self.tokenizer = tokenizer
        self.safe = SafeTokenizer(tokenizer)
        self.template: str | None = template or getattr(tokenizer, "chat_template", None)
        self.render = render
        self.trust_request_template = trust_request_template
        self.max_chars = max_chars
        self._special_vars = _special_token_vars(tokenizer)
        self._renders_tools: dict[str, bool] = {}

    def renders_tools(self, template: str | None = None) -> bool:
        """Whether ``template`` (default: the server's) puts request ``tools`` into
        the prompt: a probe tool's name must appear in a rendering with it. Cached
        per template; the server's own template only, or a trusted request's."""
        template = template or self.template
        if not template:
            return False
        known = self._renders_tools.get(template)
        if known is not None:
            return known
        job: dict[str, Any] = {
            "template": template,
            "tools": [{"type": "function", "function": _PROBE_TOOL}],
            "add_generation_prompt": True,
            "special_tokens": self._special_vars,
            "kwargs": {},
            "max_chars": self.max_chars,
            "variants": [[{"role": "user", "content": "hi"}]],
        }
        try:
            (text,) = self.render(job)
            found = _PROBE_TOOL["name"] in text
        except Exception:  # noqa: BLE001 (a template that fails with tools cannot render them)
            found = False
        if len(self._renders_tools) < 64:
            self._renders_tools[template] = found
        return found

    # ------------------------------------------------------------------ checks
    def choose_template(
        self, request_template: str | None, kwargs: dict[str, Any] | None
    ) -> tuple[str, dict[str, Any]]:
        """(template to use, the kwargs without ``chat_template``); raises
        :class:`ChatTemplateForbidden` / :class:`ChatPromptError`."""
        kwargs = dict(kwargs or {})
        from_kwargs = kwargs.pop("chat_template", None)
        asked = request_template if request_template is not None else from_kwargs
        where = "chat_template" if request_template is not None else "chat_template_kwargs"
        if asked is not None:
            if not self.trust_request_template:
                raise ChatTemplateForbidden(
                    "this server does not accept chat templates from requests: remove "
                    f"{where!r}{'.chat_template' if where == 'chat_template_kwargs' else ''} "
                    "(the server's operator sets the template with --chat-template; a server "
                    f"started with {TRUST_FLAG} accepts request templates)",
                    param=where,
                    code="chat_template_not_allowed",
                )
            if not isinstance(asked, str) or not asked or len(asked) > MAX_TEMPLATE_CHARS:
                raise ChatPromptError(
                    f"chat_template must be a non-empty Jinja template string of at most "
                    f"{MAX_TEMPLATE_CHARS} characters",
                    param=where,
                )
            return asked, kwargs
        if not self.template:
            raise ChatPromptError(
                "this model has no chat template: start the server with --chat-template "
                "FILE, or use /v1/completions with a prompt"
            )
        return self.template, kwargs

    def _check_kwargs(self, kwargs: dict[str, Any]) -> None:
        for key in kwargs:
            if not isinstance(key, str) or not key.isidentifier():
                raise ChatPromptError(
                    f"chat_template_kwargs key {str(key)[:40]!r} is not a name: use keys such "
                    'as "enable_thinking"',
                    param="chat_template_kwargs",
                )
        special = _first_special(self.safe, kwargs)
        if special is not None:
            raise ChatPromptError(
                f"chat_template_kwargs contains the special token {special!r}: template "
                "variables may not carry control tokens; remove it",
                param="chat_template_kwargs",
            )

    # ------------------------------------------------------------------ build
    def build(
        self,
        messages: list[dict[str, Any]],
        *,
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        tools_must_render: bool = False,
    ) -> ChatPrompt:
        """Render and tokenize (rules in the module docstring). Raises
        :class:`ChatPromptError` (its subclasses) or :class:`TemplateError`.
        ``tools_must_render`` (``tool_choice: "auto"``): refuse (param ``tools``) when
        the template would drop ``tools``, since the model could never call them."""
        template, kwargs = self.choose_template(chat_template, chat_template_kwargs)
        self._check_kwargs(kwargs)
        if tools and tools_must_render and not self.renders_tools(template):
            raise ChatPromptError(
                "this server's chat template has no tools section, so the model would never "
                "see the tools: the operator can start the server with --chat-template FILE "
                "naming a template that renders tools (docs/function-calling.md); or send "
                'tool_choice "required" or a named function (the output is then forced to '
                "a call)",
                param="tools",
                code="tools_not_rendered",
            )
        if tools is not None and _first_special(self.safe, tools) is not None:
            raise ChatPromptError(
                f"tools contain the special token {_first_special(self.safe, tools)!r}: "
                "remove it from the tool definitions",
                param="tools",
            )
        job: dict[str, Any] = {
            "template": template,
            "tools": tools,
            "add_generation_prompt": add_generation_prompt,
            "special_tokens": self._special_vars,
            "kwargs": kwargs,
            "max_chars": self.max_chars,
        }
        nonce = secrets.token_hex(8)
        originals: dict[str, str] = {}
        masked = _mask(messages, self.safe, nonce, originals)
        if not originals:
            job["variants"] = [messages]
            (text,) = self.render(job)
            return ChatPrompt(text, self.safe.encode_control(text))
        job["variants"] = [messages, masked]
        text, masked_text = self.render(job)
        pattern = re.compile("|".join(re.escape(p) for p in originals))
        if pattern.sub(lambda m: originals[m.group(0)], masked_text) != text:
            first = next(iter(originals.values()))
            raise ChatPromptError(
                f"a message contains the special token {self.safe.find_special(first)!r}, and "
                "this chat template transforms message text, so it cannot be kept as plain "
                "text: remove special-token strings from the messages"
            )
        ids: list[int] = []
        pos = 0
        for m in pattern.finditer(masked_text):
            if m.start() > pos:
                ids += self.safe.encode_control(masked_text[pos : m.start()])
            ids += self.safe.encode_plain(originals[m.group(0)])
            pos = m.end()
        if pos < len(masked_text):
            ids += self.safe.encode_control(masked_text[pos:])
        return ChatPrompt(text, ids, split=True)


def _mask(value: Any, safe: SafeTokenizer, nonce: str, originals: dict[str, str]) -> Any:
    """``value`` with every string that holds a special-token string replaced by a
    unique placeholder (recorded in ``originals``); other values unchanged."""
    if isinstance(value, str):
        if safe.find_special(value) is None:
            return value
        placeholder = f"\u27eakv{nonce}p{len(originals)}\u27eb"
        originals[placeholder] = value
        return placeholder
    if isinstance(value, list):
        return [_mask(v, safe, nonce, originals) for v in value]
    if isinstance(value, dict):
        return {k: _mask(v, safe, nonce, originals) for k, v in value.items()}
    return value


def _first_special(safe: SafeTokenizer, value: Any) -> str | None:
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, str):
            hit = safe.find_special(v)
            if hit is not None:
                return hit
        elif isinstance(v, dict):
            stack.extend(v.keys())
            stack.extend(v.values())
        elif isinstance(v, list):
            stack.extend(v)
    return None


__all__ = [
    "ChatPrompt",
    "ChatPromptBuilder",
    "ChatPromptError",
    "ChatTemplateForbidden",
    "TemplateError",
    "render_in_process",
]
