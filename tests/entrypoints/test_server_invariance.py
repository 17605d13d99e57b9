"""Through the server: a greedy request's tokens and logprobs (and a seeded sample)
are the same alone and among concurrent clients (docs/determinism.md)."""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
from support.server_helpers import ServerProcess

MODEL = "smollm2-135m-instruct"


def _ask(client: openai.OpenAI, prompt: list[int], seed: int | None) -> tuple:
    if seed is None:
        r = client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=6, temperature=0, logprobs=2
        )
    else:
        r = client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=6, temperature=0.9, seed=seed
        )
    c = r.choices[0]
    lp = c.logprobs
    return (
        c.text,
        None if lp is None else tuple(lp.token_logprobs or ()),
        None if lp is None else tuple(tuple(sorted(d.items())) for d in (lp.top_logprobs or ())),
    )


@pytest.mark.slow
def test_concurrent_clients_get_the_alone_answer(kvserve_server: ServerProcess) -> None:
    client = openai.OpenAI(
        base_url=kvserve_server.base_url + "/v1", api_key=kvserve_server.api_key, max_retries=0
    )
    rng = random.Random(11)
    prefix = [rng.randrange(100, 30000) for _ in range(40)]
    prompts = [
        (prefix if i % 2 else []) + [rng.randrange(100, 30000) for _ in range(10 + 25 * i)]
        for i in range(6)
    ]
    seeds = [None, None, 7, None, 8, None]
    alone = [_ask(client, p, s) for p, s in zip(prompts, seeds, strict=True)]
    with ThreadPoolExecutor(max_workers=len(prompts)) as pool:
        together = list(pool.map(lambda ps: _ask(client, *ps), zip(prompts, seeds, strict=True)))
    assert together == alone
