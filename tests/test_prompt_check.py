"""kvserve.prompt_check: the one prompt rule names the field and the fix."""

from __future__ import annotations

import pytest

from kvserve.prompt_check import check_prompt
from kvserve.request import RequestError


def test_check_prompt_names_the_field_and_the_fix() -> None:
    check_prompt([1, 2], 6, max_model_len=8, vocab_size=10)
    with pytest.raises(RequestError, match="empty") as e:
        check_prompt([], None, max_model_len=8)
    assert e.value.param == "prompt"
    with pytest.raises(RequestError, match=r"\[0, 10\)"):
        check_prompt([1, 10], None, max_model_len=8, vocab_size=10)
    with pytest.raises(RequestError, match="at most 7 tokens") as e:
        check_prompt(list(range(8)), None, max_model_len=8)
    assert e.value.code == "context_length_exceeded"
    with pytest.raises(RequestError, match="lower max_tokens to at most 6") as e:
        check_prompt([1, 2], 7, max_model_len=8)
    assert e.value.param == "max_tokens"
