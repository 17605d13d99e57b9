"""The one rule for a prompt's tokens and length (:func:`check_prompt`), applied by
content validation (``kvserve.engine.validation.validate_request``) and again by the
scheduler's admission (``kvserve.sched.schedulable.check_schedulable``, for requests
built without it). It only reads its arguments, so any layer may call it.
"""

from __future__ import annotations

from kvserve.errors import RequestError


def check_prompt(
    prompt_token_ids: list[int],
    max_tokens: int | None,
    *,
    max_model_len: int,
    vocab_size: int | None = None,
) -> None:
    """The one rule for a request's tokens and length; raises :class:`RequestError`.

    The prompt must be non-empty and shorter than ``max_model_len`` (room for at
    least one output token), ``prompt + max_tokens <= max_model_len`` when
    ``max_tokens`` is set, and, when ``vocab_size`` is given, every token id an
    integer in ``[0, vocab_size)``.
    """
    n = len(prompt_token_ids)
    if n == 0:
        raise RequestError("the prompt is empty: send at least one token of text", param="prompt")
    if vocab_size is not None:
        bad = [t for t in prompt_token_ids if not isinstance(t, int) or not 0 <= t < vocab_size]
        if bad:
            raise RequestError(
                f"prompt token id {bad[0]!r} is out of range: token ids must be integers in "
                f"[0, {vocab_size})",
                param="prompt",
            )
    if n >= max_model_len:
        raise RequestError(
            f"the prompt has {n} tokens but max_model_len is {max_model_len}: shorten the prompt "
            f"to at most {max_model_len - 1} tokens or start the engine with a larger max_model_len",
            param="prompt",
            code="context_length_exceeded",
        )
    if max_tokens is not None and n + max_tokens > max_model_len:
        raise RequestError(
            f"the prompt has {n} tokens and max_tokens={max_tokens}, together "
            f"{n + max_tokens} exceeds max_model_len={max_model_len}: lower max_tokens to at most "
            f"{max_model_len - n} or shorten the prompt",
            param="max_tokens",
            code="context_length_exceeded",
        )
