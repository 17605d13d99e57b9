"""The scale-out ingress validates exactly as the engine does (one validation
function): a bad grammar or logit_bias is a RequestError at the ingress, before any
replica sees it (before, an invalid grammar reached the matcher inside a replica's
step and aborted every request of that step). No cluster needed."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("ray")

from kvserve.cluster.protocol import EngineFacts  # noqa: E402
from kvserve.cluster.remote_engine import RemoteEngine  # noqa: E402
from kvserve.request import RequestError, SamplingParams  # noqa: E402
from kvserve.structured.params import StructuredOutputsParams  # noqa: E402


class _Handle:
    def options(self, **_: Any) -> _Handle:
        return self


@pytest.fixture(scope="module")
def remote() -> RemoteEngine:
    from kvserve.model.loader import load_tokenizer

    tok = load_tokenizer("smollm2-135m-instruct")
    facts = EngineFacts(
        model_name="m",
        max_model_len=256,
        vocab_size=49152,
        max_num_seqs=8,
        eos_token_ids=(2,),
        model_fingerprint="f",
        block_size=16,
        hash_algo="sha256",
        enable_prefix_caching=True,
    )
    return RemoteEngine(_Handle(), None, facts, tok)


@pytest.mark.parametrize(
    ("params", "param"),
    [
        (SamplingParams(max_tokens=4, logit_bias={49152: 1.0}), "logit_bias"),
        (
            SamplingParams(
                max_tokens=4, structured_outputs=StructuredOutputsParams(grammar="start: (")
            ),
            "structured_outputs.grammar",
        ),
        (
            SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(regex="(")),
            "structured_outputs.regex",
        ),
        (SamplingParams(max_tokens=4, n=9), "n"),
        (SamplingParams(max_tokens=300), "max_tokens"),
    ],
)
def test_ingress_refuses_what_the_engine_refuses(
    remote: RemoteEngine, params: SamplingParams, param: str
) -> None:
    with pytest.raises(RequestError) as info:
        remote.make_request([5, 6, 7], params, request_id="r")
    assert info.value.param == param


def test_ingress_accepts_a_valid_grammar(remote: RemoteEngine) -> None:
    params = SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(regex="[ab]+"))
    request = remote.make_request(list(range(40)), params, request_id="r")
    assert len(request.block_hashes) == 2  # hashed at the ingress as before
