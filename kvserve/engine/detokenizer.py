"""Incremental detokenization with stop strings: token ids in, safe text deltas out.

One :class:`IncrementalDetokenizer` per request. The engine feeds it the tokens
each step produced and streams the returned deltas; at the end it calls
:meth:`~IncrementalDetokenizer.flush` for the held-back tail. Rules the deltas keep:

* **No broken characters.** Byte-level tokens may split one UTF-8 character
  (an emoji, a CJK character) across several tokens; decoding the first part gives
  U+FFFD. As vLLM's ``detokenize_incrementally``, a window of token ids
  ``[prefix_offset, len)`` is decoded and compared with the already emitted part
  ``[prefix_offset, read_offset)``; text that ends in U+FFFD is held back until a
  later token completes it, and the offsets only advance past complete text:

      ids:  ... | prefix_offset ........ read_offset ....... len(ids)
                  \\___ decoded before ___/\\__ new, emitted when safe __/

  The window starts with the last few prompt tokens, so the first output token
  decodes with its real left context (a SentencePiece leading space survives). If
  that prompt tail ends inside a character, it is not used: the output text is then
  the output tokens' own decoding.
* **Nothing past a stop string.** A stop string may span several tokens. The text is
  searched after every update; the first occurrence (leftmost; among stop strings
  starting at the same place, the first listed) finishes the request: the text
  is cut before it (or after it with ``include_stop_str_in_output``), ``stop_reason``
  is the stop string and ``finished_by_stop`` becomes True. To never emit text that a
  later token turns into a stop string, the longest tail of the text that is a
  proper prefix of some stop string (at most ``len(longest stop) - 1`` characters) is
  held back until it is resolved; :meth:`flush` releases it.
* ``''.join(deltas) == output_text``; with no stop string hit and after
  :meth:`flush`, that is ``tokenizer.decode(output_ids, skip_special_tokens=...,
  clean_up_tokenization_spaces=False)`` (no space clean-up: it would make decoding
  depend on the next token).

As in vLLM, stop strings are not looked for until ``params.min_tokens`` tokens have
been generated, and a stop string lying wholly in text produced before then is
never reported.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from kvserve.request import SamplingParams

# How many prompt tokens give the first output token its left context (as vLLM).
_PROMPT_CONTEXT_TOKENS = 5
# Drop decoded ids older than the window once this many pile up.
_TRIM_THRESHOLD = 256
_REPLACEMENT_CHAR = "\ufffd"


class Tokenizer(Protocol):
    """The one tokenizer method the detokenizer uses (any HF tokenizer has it)."""

    def decode(
        self,
        token_ids: list[int],
        skip_special_tokens: bool = ...,
        clean_up_tokenization_spaces: bool | None = ...,
    ) -> str: ...


class IncrementalDetokenizer:
    """Streams the text of one request's output tokens, stopping at stop strings.

    Callers must keep these rules:
    - Pass every output token exactly once, in order, to :meth:`update` (any number
      per call). Tokens passed after the request finished by a stop string are
      ignored (their text is past the stop).
    - When the request finishes for another reason (EOS, stop token, length, abort),
      call :meth:`flush` once and send its text too; after :meth:`flush`,
      :meth:`update` raises ``RuntimeError``. Calling :meth:`flush` after a stop
      string returns ``""``.
    """

    def __init__(
        self, tokenizer: Tokenizer, prompt_token_ids: list[int], params: SamplingParams
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = params.skip_special_tokens
        self._backend_decode = _backend_decoder(tokenizer)
        self.stop = list(params.stop)
        self.include_stop_str_in_output = params.include_stop_str_in_output
        self.min_tokens = params.min_tokens
        self._max_stop_len = max((len(s) for s in self.stop), default=0)

        context = list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:])
        if context and self._decode(context).endswith(_REPLACEMENT_CHAR):
            context = []
        self._ids: list[int] = context  # decode window source: prompt tail + outputs
        self._prefix_offset = 0
        self._read_offset = len(context)

        self._num_output_tokens = 0
        self._text = ""  # decoded text; cut at the stop string once one is found
        self._num_emitted = 0  # characters of _text returned so far
        self._num_checked = 0  # characters of _text already searched for stop strings
        self._stop_reason: str | None = None
        self._flushed = False

    # -- public state -----------------------------------------------------------------

    @property
    def output_text(self) -> str:
        """Everything returned by :meth:`update` and :meth:`flush` so far, joined."""
        return self._text[: self._num_emitted]

    @property
    def finished_by_stop(self) -> bool:
        """True once a stop string was found; the request must then be finished."""
        return self._stop_reason is not None

    @property
    def stop_reason(self) -> str | None:
        """The stop string that finished the request, or None."""
        return self._stop_reason

    @property
    def num_output_tokens(self) -> int:
        """Output tokens passed to :meth:`update` so far (including ignored ones)."""
        return self._num_output_tokens

    # -- streaming --------------------------------------------------------------------

    def update(self, new_token_ids: list[int], stop_terminated: bool = False) -> str:
        """Add the step's new output tokens; return the text safe to emit now.

        ``stop_terminated=True`` says the last id is the EOS or a stop token that
        finished the request: as in vLLM, its text is left out unless
        ``include_stop_str_in_output`` (it would be visible with
        ``skip_special_tokens=False``). The caller still calls :meth:`flush` then.
        """
        if self._flushed:
            raise RuntimeError(
                "IncrementalDetokenizer.update() called after flush(): flush() ends the "
                "stream; create a new detokenizer for a new request"
            )
        self._num_output_tokens += len(new_token_ids)
        if self.finished_by_stop:
            return ""
        ids = list(new_token_ids)
        if stop_terminated and ids and not self.include_stop_str_in_output:
            ids.pop()
        self._ids.extend(ids)
        return self._advance(final=False)

    def flush(self) -> str:
        """Release the held-back tail at the end of the request.

        Emits what was held back for a possible stop string and any trailing
        incomplete character (as U+FFFD, exactly as a full decode shows it).
        """
        if self._flushed:
            return ""
        text = "" if self.finished_by_stop else self._advance(final=True)
        self._flushed = True
        return text

    # -- internals --------------------------------------------------------------------

    def _decode(self, ids: list[int]) -> str:
        if self._backend_decode is not None:
            return self._backend_decode(ids, skip_special_tokens=self.skip_special_tokens)
        return self.tokenizer.decode(
            ids,
            skip_special_tokens=self.skip_special_tokens,
            clean_up_tokenization_spaces=False,
        )

    def _advance(self, *, final: bool) -> str:
        """Decode what is new, look for stop strings, return the emittable delta."""
        self._text += self._decode_new(final=final)
        if self.stop and self._stop_reason is None and self._num_output_tokens >= self.min_tokens:
            self._check_stop()
        self._num_checked = len(self._text)
        if self.finished_by_stop or final:
            emit_to = len(self._text)
        else:
            emit_to = len(self._text) - self._num_held_back()
        emit_to = max(emit_to, self._num_emitted)
        delta = self._text[self._num_emitted : emit_to]
        self._num_emitted = emit_to
        return delta

    def _decode_new(self, *, final: bool) -> str:
        """Text of the ids after ``read_offset``, or ``""`` while it ends mid-character."""
        if self._read_offset == len(self._ids):
            return ""
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset :])
        if not final and (
            len(new_text) <= len(prefix_text) or new_text.endswith(_REPLACEMENT_CHAR)
        ):
            # Nothing visible yet (a skipped special token) or an incomplete character.
            return ""
        delta = new_text[len(prefix_text) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        if self._prefix_offset > _TRIM_THRESHOLD:
            del self._ids[: self._prefix_offset]
            self._read_offset -= self._prefix_offset
            self._prefix_offset = 0
        return delta

    def _check_stop(self) -> None:
        """Find the first stop string that ends after ``_num_checked``; cut the text there."""
        best: tuple[int, str] | None = None
        for s in self.stop:
            # An occurrence ending inside the checked text was looked for before.
            i = self._text.find(s, max(0, self._num_checked - len(s) + 1))
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        if best is None:
            return
        i, s = best
        self._stop_reason = s
        self._text = self._text[: i + len(s) if self.include_stop_str_in_output else i]

    def _num_held_back(self) -> int:
        """Length of the longest tail of the text that is a proper prefix of a stop string."""
        longest = min(self._max_stop_len - 1, len(self._text) - self._num_emitted)
        for n in range(longest, 0, -1):
            tail = self._text[-n:]
            if any(len(s) > n and s.startswith(tail) for s in self.stop):
                return n
        return 0


def _backend_decoder(tokenizer: object) -> Callable[..., str] | None:
    """The Rust ``tokenizers.Tokenizer.decode`` behind a Hugging Face fast tokenizer,
    or None. Without space clean-up (which the detokenizer never asks for) the fast
    tokenizer's ``decode`` is exactly this call plus a Python layer that cost about
    a sixth of a 64-request step's bookkeeping (two decodes per token per request)."""
    backend = getattr(tokenizer, "_tokenizer", None)
    try:
        from tokenizers import Tokenizer as RustTokenizer
    except ImportError:  # pragma: no cover - transformers depends on tokenizers
        return None
    return backend.decode if isinstance(backend, RustTokenizer) else None
