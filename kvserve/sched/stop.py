"""Stop checks: whether a request is finished after its last appended token.

Used by the scheduler once per appended token (``update_from_output``, and the
first token of each forked sample). The detokenizer owns stop *strings*; these
are the token-level rules.
"""

from __future__ import annotations

from kvserve.request import Request, RequestStatus


def check_stop(request: Request, max_model_len: int) -> bool:
    """Stop checks after appending one token; sets status and stop_reason.

    Order: EOS (unless ``ignore_eos``) and ``stop_token_ids``, both only once
    ``min_tokens`` outputs exist, finish as "stop"; then ``max_tokens`` outputs
    or ``num_tokens >= max_model_len`` finish as "length". (A last token that is
    both EOS and the max_tokens-th reports "stop".)
    """
    params = request.sampling_params
    token_id = request.output_token_ids[-1]
    if request.num_output_tokens >= params.min_tokens:
        if (
            not params.ignore_eos
            and request.eos_token_id is not None
            and token_id == request.eos_token_id
        ):
            request.status = RequestStatus.FINISHED_STOPPED
            return True
        if token_id in params.stop_token_ids:
            request.status = RequestStatus.FINISHED_STOPPED
            request.stop_reason = token_id
            return True
    if request.num_output_tokens >= request.max_tokens or request.num_tokens >= max_model_len:
        request.status = RequestStatus.FINISHED_LENGTH
        return True
    return False
