"""Tokenization that keeps user text from forging control tokens.

A tokenizer matches its special tokens (``<|im_start|>``, ``<|im_end|>``, ...) by
their *text*. A chat prompt rendered to one string and tokenized whole lets a user
who types ``<|im_end|>\\n<|im_start|>system`` open a real system turn.
:class:`SafeTokenizer` offers the two encodings a chat prompt needs:

    encode_control(text)   special-token strings become special tokens (the
                           template's own pieces)
    encode_plain(text)     special-token strings are tokenized as ordinary text
                           (message content, names, tool text)

``encode_plain`` uses a *copy* of the Rust tokenizer with ``encode_special_tokens``
switched on, never the shared one: transformers' ``split_special_tokens=`` flips
that flag on the shared tokenizer for the duration of a call, which races with
every other thread tokenizing at the same time. Both methods are thread-safe and
go through ``encode_batch``, which releases the GIL (``Tokenizer.encode`` holds it
for the whole call: measured, a 2.4 MB prompt held it 2.3 s).
"""

from __future__ import annotations

import re
import threading
from collections.abc import Iterable
from typing import Any


class SafeTokenizer:
    """The two encodings of ``tokenizer`` (a transformers tokenizer); see the module
    docstring. Neither adds BOS/EOS (``add_special_tokens=False``)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        specials = sorted(_special_strings(tokenizer), key=len, reverse=True)
        self.special_strings: tuple[str, ...] = tuple(specials)
        self._special_re = (
            re.compile("|".join(re.escape(s) for s in specials)) if specials else None
        )
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self._plain: Any = None
        self._lock = threading.Lock()
        if backend is not None and hasattr(backend, "encode_special_tokens"):
            from tokenizers import Tokenizer

            plain = Tokenizer.from_str(backend.to_str())
            plain.encode_special_tokens = True
            self._plain = plain
            self._control = Tokenizer.from_str(backend.to_str())
            self._control.encode_special_tokens = False

    def find_special(self, text: str) -> str | None:
        """The first special-token string inside ``text``, or None."""
        if self._special_re is None:
            return None
        m = self._special_re.search(text)
        return m.group(0) if m else None

    def encode_control(self, text: str) -> list[int]:
        if self._plain is not None:
            return list(self._control.encode_batch([text], add_special_tokens=False)[0].ids)
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def encode_plain(self, text: str) -> list[int]:
        if self._plain is not None:
            return list(self._plain.encode_batch([text], add_special_tokens=False)[0].ids)
        with self._lock:  # slow tokenizers: split_special_tokens is per call there
            return list(
                self.tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True)
            )


def _special_strings(tokenizer: Any) -> Iterable[str]:
    out: set[str] = set()
    decoder = getattr(tokenizer, "added_tokens_decoder", None) or {}
    for added in decoder.values():
        content = getattr(added, "content", None)
        if content and getattr(added, "special", True):
            out.add(str(content))
    for s in getattr(tokenizer, "all_special_tokens", None) or []:
        if s:
            out.add(str(s))
    return out
