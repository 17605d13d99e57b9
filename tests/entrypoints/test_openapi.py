"""``/openapi.json`` documents every route's request body and responses, and the live
server keeps that document: schemathesis runs all its checks against it (no 5xx,
status codes, content types and headers as documented, responses matching their
schemas, schema-violating requests rejected, schema-valid requests accepted).

The server runs the real engine, scheduler, KV cache, grammar compiler and HTTP
layer on the fake model runner (no weights), so hundreds of generated requests take
seconds; the real model's answers are covered by the other entrypoint tests.

One check is narrowed, not dropped: some rules of a request cannot be written in
JSON Schema (prompt + max_tokens within max_model_len, best_of >= n,
min_tokens <= max_tokens, a regex, grammar or JSON schema that compiles). A schema-valid request refused for one of
those rules - and only those, recognised by the error's ``param`` and ``code`` - is
not counted against ``positive_data_acceptance``; any other 400 still is.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from support.fake_runner import fake_engine
from support.server_helpers import REPO, serve_thread

from kvserve.engine.async_engine import AsyncEngine
from kvserve.entrypoints.openai_server import build_app


@pytest.fixture(scope="module")
def live_url() -> Iterator[str]:
    from kvserve.model.loader import load_tokenizer

    core, _ = fake_engine(load_tokenizer("smollm2-135m-instruct"), max_model_len=512, step_s=0.0)
    with serve_thread(build_app(AsyncEngine(core))) as url:
        yield url


def test_openapi_documents_bodies_and_statuses(live_url: str) -> None:
    doc = httpx.get(live_url + "/openapi.json").json()
    for path in ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"):
        op = doc["paths"][path]["post"]
        ref = op["requestBody"]["content"]["application/json"]["schema"]["$ref"]
        body = doc["components"]["schemas"][ref.rsplit("/", 1)[1]]
        assert body["properties"], path
        assert {"200", "400", "401", "404", "503"} <= set(op["responses"]), path
    completion = doc["components"]["schemas"]["CompletionRequest"]["properties"]
    for field in ("n", "best_of", "echo", "logprobs", "prompt_logprobs", "logit_bias"):
        assert field in completion
    chat = doc["components"]["schemas"]["ChatCompletionRequest"]["properties"]
    assert "response_format" in chat and "structured_outputs" in chat
    # a request's samples run together: the document allows no more than the engine runs
    seqs = 8  # fake_engine's max_num_seqs
    for props in (completion, chat):
        assert props["n"]["maximum"] == seqs
    assert completion["best_of"]["maximum"] == seqs
    assert (
        "text/event-stream"
        in doc["paths"]["/v1/completions"]["post"]["responses"]["200"]["content"]
    )


def test_schemathesis_all_checks(live_url: str, tmp_path: Path) -> None:
    """``st run --checks all`` against the live server (positive and negative data,
    coverage and fuzzing phases), ``positive_data_acceptance`` narrowed as the module
    docstring says (``support/schemathesis_hooks.py``), and a response-time limit."""
    env = dict(os.environ)
    env["SCHEMATHESIS_HOOKS"] = "support.schemathesis_hooks"
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "tests"), env.get("PYTHONPATH", "")])
    cmd = [
        str(Path(sys.executable).with_name("st")),
        "run",
        live_url + "/openapi.json",
        "--checks",
        "all",
        "--exclude-checks",
        "positive_data_acceptance",
        "--max-examples",
        os.environ.get("KVSERVE_SCHEMATHESIS_EXAMPLES", "12"),
        "--seed",
        os.environ.get("KVSERVE_SCHEMATHESIS_SEED", "13"),
        "--workers",
        "1",
        # every answer, refusals included, well within a second on the fake runner
        "--max-response-time",
        os.environ.get("KVSERVE_SCHEMATHESIS_MAX_RESPONSE_S", "5"),
        "--report-dir",
        str(tmp_path),
    ]
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-6000:]
    assert "positive_data_acceptance_beyond_json_schema" in out or "passed" in out
