"""Fixtures of the structured-output tests: the chat tokenizer and its grammar compiler."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from kvserve.structured.compiler import GrammarCompiler


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    from kvserve.model.loader import load_tokenizer

    return load_tokenizer("smollm2-135m-instruct")


@pytest.fixture(scope="module")
def compiler(tokenizer: Any) -> Iterator[GrammarCompiler]:
    c = GrammarCompiler(tokenizer, 49152, tokenizer.convert_tokens_to_ids("<|im_end|>"))
    yield c
    c.close()
