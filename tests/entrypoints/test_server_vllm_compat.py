"""vLLM compatibility of the HTTP layer on a fake model runner (no weights): /docs
from the package, /v1/models/{id}, vllm: metric names, the ignored-fields header,
guided_* mapped onto structured_outputs, --generation-config defaults, --seed,
--max-logprobs; and ``kvserve serve``'s vLLM flags (parsing only)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from support.fake_runner import fake_engine
from support.server_helpers import serve_thread

from kvserve.engine.async_engine import AsyncEngine
from kvserve.engine.vllm_compat import generation_defaults, translate_vllm_options
from kvserve.entrypoints.cli import build_parser, main
from kvserve.entrypoints.openai_server import build_app


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[str, Any]]:
    from kvserve.model.loader import load_tokenizer

    core, _ = fake_engine(load_tokenizer("smollm2-135m-instruct"))
    engine = AsyncEngine(core)
    app = build_app(
        engine,
        served_model_name="smol",
        sampling_defaults={"temperature": 0.0},
        max_logprobs=5,
        default_seed=7,
    )
    with serve_thread(app) as url:
        yield url, engine


def test_docs_served_from_the_package(server: tuple[str, Any]) -> None:
    url, _ = server
    page = httpx.get(url + "/docs")
    assert page.status_code == 200 and "SwaggerUIBundle" in page.text
    assert "http" not in page.text.split("<body>")[1].replace("/openapi.json", "")  # no CDN
    js = httpx.get(url + "/docs/assets/swagger-ui-bundle.js")
    assert js.status_code == 200 and len(js.content) > 100_000
    assert httpx.get(url + "/docs/assets/../../etc/passwd").status_code == 404


def test_model_by_id(server: tuple[str, Any]) -> None:
    url, _ = server
    card = httpx.get(url + "/v1/models/smol").json()
    assert card["id"] == "smol" and card["object"] == "model"
    missing = httpx.get(url + "/v1/models/gpt-4")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"


def test_metrics_also_under_vllm_names(server: tuple[str, Any]) -> None:
    url, _ = server
    httpx.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}).raise_for_status()
    text = httpx.get(url + "/metrics").text
    kv = {ln.split(" ")[0] for ln in text.splitlines() if ln.startswith("kvserve:")}
    vl = {ln.split(" ")[0] for ln in text.splitlines() if ln.startswith("vllm:")}
    assert "vllm:num_requests_running" in {n.split("{")[0] for n in vl}
    assert {n.replace("kvserve:", "vllm:", 1) for n in kv} == vl


def test_ignored_fields_are_named(server: tuple[str, Any]) -> None:
    url, _ = server
    r = httpx.post(
        url + "/v1/chat/completions",
        json={
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 2,
            "foo": 1,
            "user": "me",
        },
    )
    assert r.status_code == 200
    assert r.headers["x-kvserve-ignored-fields"].split(",") == ["foo", "user"]
    plain = httpx.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2})
    assert "x-kvserve-ignored-fields" not in plain.headers


def test_guided_fields_map_to_structured_outputs(server: tuple[str, Any]) -> None:
    url, engine = server
    seen: list[Any] = []
    original = engine.make_request

    def spy(ids: list[int], params: Any, **kw: Any) -> Any:
        seen.append(params)
        return original(ids, params, **kw)

    engine.make_request = spy
    try:
        for field, value, kind in [
            ("guided_choice", ["a", "b"], "choice"),
            ("guided_regex", "[0-9]+", "regex"),
            ("guided_json", {"type": "object"}, "json"),
        ]:
            r = httpx.post(
                url + "/v1/completions", json={"prompt": "x", "max_tokens": 2, field: value}
            )
            assert r.status_code == 200, r.text
            assert seen[-1].structured_outputs.kind == kind
            assert "x-kvserve-ignored-fields" not in r.headers
        both = httpx.post(
            url + "/v1/completions",
            json={
                "prompt": "x",
                "max_tokens": 2,
                "guided_regex": "a+",
                "structured_outputs": {"choice": ["b"]},
            },
        )
        assert both.status_code == 200 and seen[-1].structured_outputs.kind == "choice"
        assert both.headers["x-kvserve-ignored-fields"] == "guided_regex"
        bad = httpx.post(
            url + "/v1/completions", json={"prompt": "x", "max_tokens": 2, "guided_regex": "("}
        )
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "guided_regex"
        # generation-config default (temperature 0) and --seed fill what the request leaves out
        httpx.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 2})
        assert seen[-1].temperature == 0.0 and seen[-1].seed is not None
        httpx.post(
            url + "/v1/completions",
            json={"prompt": "x", "max_tokens": 2, "seed": 3, "temperature": 0.5},
        )
        assert (seen[-1].temperature, seen[-1].seed) == (0.5, 3)
    finally:
        engine.make_request = original


def test_max_logprobs(server: tuple[str, Any]) -> None:
    url, _ = server
    r = httpx.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 1, "logprobs": 6})
    assert r.status_code == 400 and "--max-logprobs 5" in r.json()["error"]["message"]


def test_generation_config(tmp_path: Path) -> None:
    (tmp_path / "generation_config.json").write_text(
        json.dumps(
            {
                "temperature": 0.6,
                "top_p": 0.9,
                "top_k": 20,
                "do_sample": True,
                "repetition_penalty": 1.1,
            }
        )
    )
    want = {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "repetition_penalty": 1.1}
    assert generation_defaults("auto", tmp_path) == want
    assert generation_defaults(str(tmp_path), None) == want
    assert generation_defaults("vllm", tmp_path) == {}
    with pytest.raises(ValueError, match="generation_config.json"):
        generation_defaults(str(tmp_path / "nope"), None)


def test_vllm_engine_options() -> None:
    opts, notices = translate_vllm_options(
        {
            "model": "m",
            "tensor_parallel_size": 1,
            "gpu_memory_utilization": 0.5,
            "enforce_eager": True,
            "trust_remote_code": True,
            "enable_chunked_prefill": False,
            "max_model_len": 2048,
        }
    )
    assert opts["kv_cache_memory_gib"] > 0 and opts["max_num_batched_tokens"] == 2048
    assert len(notices) == 5 and not {"tensor_parallel_size", "enforce_eager"} & set(opts)
    with pytest.raises(ValueError, match="--replicas 2"):
        translate_vllm_options({"tensor_parallel_size": 2})


def test_vllm_serve_line_parses() -> None:
    line = (
        "serve smollm2-135m-instruct --host 127.0.0.1 --port 8000 --seed 0 "
        "--generation-config auto --max-logprobs 20 --root-path /api --uvicorn-log-level warning "
        "--disable-log-requests --enable-chunked-prefill --tensor-parallel-size 1 "
        "--gpu-memory-utilization 0.9 --enforce-eager --trust-remote-code "
        "--enable-auto-tool-choice --tool-call-parser hermes --max-model-len 2048 "
        "--served-model-name smol --dtype auto"
    )
    args = build_parser().parse_args(line.split())
    assert args.model_tag == "smollm2-135m-instruct" and args.seed == 0
    assert args.tool_call_parser == "hermes" and args.tensor_parallel_size == 1
    assert args.enable_chunked_prefill is True and args.root_path == "/api"


def test_unknown_flag_prints_serve_usage_and_closest(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main(["serve", "--tensor-paralel-size", "1"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: kvserve serve") and "did you mean --tensor-parallel-size" in err
    assert main(["serve", "--tensor-parallel-size", "2"]) == 2
    assert "--replicas 2" in capsys.readouterr().err
