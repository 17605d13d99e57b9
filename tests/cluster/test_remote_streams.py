"""The ingress's side of a multi-sample request (``n``/``best_of``) on replicas: one
call to one replica, its deltas handed to one stream per sample; failures and aborts
reach every sample. A fake Serve handle stands in for the replica (no cluster)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("ray")

from ray.exceptions import RayError  # noqa: E402

from kvserve.cluster.protocol import Accepted, EngineFacts, Refused, RoutedRequest  # noqa: E402
from kvserve.cluster.remote_engine import RemoteEngine  # noqa: E402
from kvserve.engine.async_engine import RequestFailedError  # noqa: E402
from kvserve.engine.outputs import RequestDelta  # noqa: E402
from kvserve.entrypoints.serving_streams import merge  # noqa: E402
from kvserve.request import FinishReason, Request, RequestError, SamplingParams  # noqa: E402

FACTS = EngineFacts(
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


class _Died(RayError):
    pass


class _Gen:
    """A replica's ``generate`` call: yields ``items``; an exception item is raised."""

    def __init__(self, items: list[Any]) -> None:
        self._items: Iterator[Any] = iter(items)
        self.num_read = 0
        self.num_cancels = 0

    async def __anext__(self) -> Any:
        await asyncio.sleep(0)
        item = next(self._items, StopAsyncIteration())
        if isinstance(item, BaseException):
            raise item
        self.num_read += 1
        return item

    def cancel(self) -> None:
        self.num_cancels += 1


class _Handle:
    def __init__(self, items: list[Any]) -> None:
        self.gen = _Gen(items)
        self.sent: list[RoutedRequest] = []
        self.generate = self

    def options(self, **_: Any) -> _Handle:
        return self

    def remote(self, routed: RoutedRequest) -> _Gen:
        self.sent.append(routed)
        return self.gen


def _delta(sample: int, text: str, finished: bool = False) -> RequestDelta:
    return RequestDelta(
        "r", [1], text, finish_reason=FinishReason.LENGTH if finished else None, sample_index=sample
    )


def _engine(items: list[Any]) -> tuple[RemoteEngine, _Handle]:
    handle = _Handle(items)
    return RemoteEngine(handle, None, FACTS, tokenizer=None), handle


def _request(n: int, best_of: int | None = None) -> Request:
    return Request("r", list(range(40)), SamplingParams(max_tokens=3, n=n, best_of=best_of))


def test_samples_go_to_one_replica_whole_and_come_back_per_sample() -> None:
    items: list[Any] = [Accepted("rep-1")]
    for step in range(3):  # interleaved, as the replica's merge yields them
        for sample in (2, 0, 1):
            items.append(_delta(sample, f"{sample}{step}", finished=step == 2))
    remote, handle = _engine(items)

    async def run() -> dict[int, str]:
        streams = await remote.submit_samples(_request(2, best_of=3))
        out = {0: "", 1: "", 2: ""}
        async for i, delta in merge(list(streams)):
            assert delta.sample_index == i
            out[i] += delta.new_text
        assert all(s.finished for s in streams)
        return out

    assert asyncio.run(run()) == {0: "000102", 1: "101112", 2: "202122"}
    (routed,) = handle.sent  # one call for every sample
    assert routed.request.sampling_params.num_samples == 3  # unsplit: the replica forks
    assert routed.num_seqs == 3
    # the prompt's 40 tokens once, 3 tokens per sample: ceil(49 / 16)
    assert routed.num_blocks_needed == 4
    assert handle.gen.num_cancels == 0  # every sample finished: nothing to cancel


def test_streams_read_in_any_order() -> None:
    """Draining sample 1 first buffers sample 0's deltas instead of losing them."""
    items = [Accepted("rep-1"), _delta(0, "a"), _delta(1, "b", True), _delta(0, "c", True)]
    remote, _ = _engine(items)

    async def run() -> list[str]:
        s0, s1 = await remote.submit_samples(_request(2))
        texts = [d.new_text async for d in s1]
        texts += [d.new_text async for d in s0]
        return texts

    assert asyncio.run(run()) == ["b", "a", "c"]


def test_a_dead_replica_fails_every_sample_naming_it() -> None:
    remote, handle = _engine([Accepted("rep-7"), _delta(0, "a"), _Died()])

    async def run() -> list[str]:
        streams = await remote.submit_samples(_request(2))
        errors = []
        for stream in streams:
            with pytest.raises(RequestFailedError) as info:
                async for _ in stream:
                    pass
            errors.append(str(info.value))
            assert stream.finished
        return errors

    errors = asyncio.run(run())
    assert all("rep-7" in e and "failed while serving" in e for e in errors)


def test_a_stream_ending_early_fails_the_unfinished_samples() -> None:
    remote, _ = _engine([Accepted("rep-1"), _delta(0, "a", True)])

    async def run() -> None:
        s0, s1 = await remote.submit_samples(_request(2))
        assert [d.new_text async for d in s0] == ["a"]
        with pytest.raises(RequestFailedError, match="ended this request's stream"):
            await s1.__anext__()

    asyncio.run(run())


def test_the_call_is_cancelled_once_every_sample_is_aborted_or_done() -> None:
    items = [Accepted("rep-1"), _delta(1, "x", True), _delta(0, "a"), _delta(0, "b")]
    remote, handle = _engine(items)

    async def run() -> None:
        s0, s1 = await remote.submit_samples(_request(2))
        assert (await s1.__anext__()).finished
        s0.abort()
        s0.abort()  # idempotent
        s1.abort()  # finished already: nothing

    asyncio.run(run())
    assert handle.gen.num_cancels == 1


def test_an_aborted_sample_drops_its_deltas_while_others_go_on() -> None:
    items = [Accepted("rep-1"), _delta(0, "a"), _delta(0, "b"), _delta(1, "x", True)]
    items.append(_delta(0, "c", True))
    remote, handle = _engine(items)

    async def run() -> list[str]:
        s0, s1 = await remote.submit_samples(_request(2))
        s0.abort()
        assert handle.gen.num_cancels == 0  # sample 1 still runs
        return [d.new_text async for d in s1]

    assert asyncio.run(run()) == ["x"]


def test_submit_keeps_the_first_sample_and_aborts_the_rest() -> None:
    remote, handle = _engine([Accepted("rep-1"), _delta(1, "x"), _delta(0, "a", True)])

    async def run() -> list[str]:
        stream = await remote.submit(_request(2))
        return [d.new_text async for d in stream]

    assert asyncio.run(run()) == ["a"]
    assert handle.gen.num_cancels == 1  # sample 1 aborted, sample 0 done


def test_a_refusal_is_raised_before_any_stream() -> None:
    remote, _ = _engine([Refused("request", "too many", "n", "too_many_sequences")])

    async def run() -> None:
        with pytest.raises(RequestError) as info:
            await remote.submit_samples(_request(4))
        assert info.value.param == "n"

    asyncio.run(run())
