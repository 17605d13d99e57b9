"""The one validation of a request's content, used by every front that builds requests:
:meth:`EngineCore.make_request` (the server, ``LLM``, the simulator) and the
scale-out ingress (:class:`kvserve.cluster.remote_engine.RemoteEngine`).

    validate_request(prompt_token_ids, params, limits, grammar=...)
      prompt        non-empty, ids in [0, vocab_size), shorter than max_model_len
      max_tokens    prompt + max_tokens <= max_model_len (when set)
      n / best_of   at most max_num_seqs samples (they run together)
      logit_bias    every id in [0, vocab_size)
      allowed_token_ids, stop_token_ids  every id in [0, vocab_size)
      structured    compiles (GrammarCompiler.check): a bad or unsatisfiable
                    schema/regex/grammar is refused here, never inside a step;
                    with within_max_tokens (forced tool calls), max_tokens (or the
                    room left by the prompt) fits the shortest complete output

Rules a caller must keep: call it before queueing anything; it raises
:class:`~kvserve.request.RequestError` (a ValueError naming the field in ``param``,
with the fix in the message) and changes nothing. What depends on the engine's
state (queue room, KV cache size) is admission's, not validation's
(:mod:`kvserve.engine.request_limits`, :mod:`kvserve.sched.schedulable`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from kvserve.prompt_check import check_prompt
from kvserve.request import RequestError, SamplingParams
from kvserve.structured.params import StructuredOutputsParams


@dataclass(frozen=True)
class RequestLimits:
    """The engine facts a request is validated against."""

    max_model_len: int
    vocab_size: int
    max_num_seqs: int


class GrammarChecker(Protocol):
    """Compiles a constraint or raises RequestError (``GrammarCompiler``)."""

    def check(self, params: StructuredOutputsParams) -> None: ...

    def min_output_tokens(self, params: StructuredOutputsParams) -> int | None: ...


def validate_request(
    prompt_token_ids: list[int],
    params: SamplingParams,
    limits: RequestLimits,
    *,
    grammar: GrammarChecker | None,
) -> None:
    """Raise :class:`RequestError` if this request can never be served (see the
    module docstring). ``grammar``: None when this front cannot compile grammars, in
    which case a request with ``structured_outputs`` is refused (never passed on
    unchecked). Changes nothing."""
    check_prompt(
        prompt_token_ids,
        params.max_tokens,
        max_model_len=limits.max_model_len,
        vocab_size=limits.vocab_size,
    )
    samples = params.num_samples
    if samples > limits.max_num_seqs:
        raise RequestError(
            f"the request asks for {samples} samples (n/best_of) but max_num_seqs is "
            f"{limits.max_num_seqs}: lower n/best_of to at most {limits.max_num_seqs} or start "
            f"the engine with max_num_seqs >= {samples}",
            param="best_of" if params.best_of is not None and params.best_of > params.n else "n",
        )
    bad = [t for t in params.logit_bias or {} if not 0 <= t < limits.vocab_size]
    if bad:
        raise RequestError(
            f"logit_bias names token id {bad[0]}, outside the vocabulary: token ids must be "
            f"in [0, {limits.vocab_size})",
            param="logit_bias",
        )
    bad = [t for t in params.stop_token_ids if not 0 <= t < limits.vocab_size]
    if bad:
        raise RequestError(
            f"stop_token_ids names token id {bad[0]}, outside the vocabulary: token ids must "
            f"be in [0, {limits.vocab_size})",
            param="stop_token_ids",
        )
    outside = [t for t in params.allowed_token_ids or () if not 0 <= t < limits.vocab_size]
    if outside:
        raise RequestError(
            f"allowed_token_ids names token id {outside[0]}, outside the vocabulary: token "
            f"ids must be in [0, {limits.vocab_size})",
            param="allowed_token_ids",
        )
    if params.structured_outputs is None:
        return
    if grammar is None:
        raise RequestError(
            "structured outputs are not available on this server", param="structured_outputs"
        )
    try:
        grammar.check(params.structured_outputs)
    except RequestError:
        raise
    except Exception as e:  # e.g. a tokenizer the grammar library cannot read
        raise RequestError(
            f"structured outputs are not available for this model: {e}",
            param="structured_outputs",
        ) from None
    if params.structured_outputs.within_max_tokens:
        need = grammar.min_output_tokens(params.structured_outputs)
        if need is None:
            return
        room = limits.max_model_len - len(prompt_token_ids)
        if params.max_tokens is not None and params.max_tokens < need:
            raise RequestError(
                f"max_tokens={params.max_tokens} is too small for this output: the shortest "
                f"complete one (e.g. the forced tool call with minimal arguments) takes {need} "
                f"tokens; send max_tokens >= {need}, and more to leave its arguments room, "
                f"for example max_tokens = {need + max(need, 32)}",
                param="max_tokens",
            )
        if params.max_tokens is None and room < need:
            raise RequestError(
                f"the prompt leaves {room} tokens of max_model_len={limits.max_model_len} but "
                f"the shortest complete output (e.g. the forced tool call with minimal "
                f"arguments) takes {need}: shorten the prompt",
                param="messages",
            )
