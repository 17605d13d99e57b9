"""Workloads where speculative decoding's proposals pay, generated locally from a seed.

Each prompt carries text the answer is expected to copy from, as real requests do:

- ``spec-edit``: a passage of ``input_len`` words (templated English sentences) and
  "rewrite it with one name changed": the answer is mostly the passage again.
- ``spec-code``: Python functions and "rename a variable": the answer is the code.
- ``spec-json``: records with the same keys and "continue the list": keys and
  structure repeat in the output.
- ``spec-quote``: a multi-turn chat (``turns`` turns) in which every user turn asks
  to quote an earlier part of the conversation before answering.

``random`` (kvserve.bench.workloads) is the case where they do not pay. Lengths are
approximate (about one token per word; code and JSON punctuation add tokens).
"""

from __future__ import annotations

import random
from typing import Any

from kvserve.bench.sessions import Session, Turn

SPEC_KINDS = ("spec-edit", "spec-code", "spec-json", "spec-quote")

_NAMES = ["Alice", "Bob", "Carol", "David", "Erin", "Frank", "Grace", "Heidi", "Ivan", "Judy"]
_VERBS = ["found", "painted", "carried", "repaired", "sold", "bought", "cleaned", "opened"]
_ADJS = ["old", "small", "red", "heavy", "quiet", "bright", "wooden", "broken", "new"]
_NOUNS = ["box", "door", "boat", "lamp", "table", "window", "garden", "bicycle", "clock"]
_PLACES = ["market", "river", "station", "library", "harbor", "school", "village", "park"]
_PREPS = ["near", "behind", "beside", "inside", "past"]
_KEYS = ["id", "name", "city", "age", "email", "active", "score"]


def _sentence(rng: random.Random) -> str:
    return (
        f"{rng.choice(_NAMES)} {rng.choice(_VERBS)} the {rng.choice(_ADJS)} "
        f"{rng.choice(_NOUNS)} {rng.choice(_PREPS)} the {rng.choice(_PLACES)}."
    )


def _passage(rng: random.Random, num_words: int) -> str:
    out: list[str] = []
    words = 0
    while words < num_words:
        s = _sentence(rng)
        out.append(s)
        words += len(s.split())
    return " ".join(out)


def _code(rng: random.Random, num_words: int) -> tuple[str, str, str]:
    funcs: list[str] = []
    words = 0
    var = rng.choice(["total", "count", "value", "result"])
    while words < num_words:
        name = f"{rng.choice(['compute', 'update', 'load', 'check'])}_{rng.choice(_NOUNS)}"
        a, b = rng.sample(["x", "y", "items", "limit", "offset", "scale"], 2)
        body = (
            f"def {name}({a}, {b}):\n"
            f"    {var} = 0\n"
            f"    for item in {a}:\n"
            f"        if item > {b}:\n"
            f"            {var} += item * {rng.randint(2, 9)}\n"
            f"    return {var}\n"
        )
        funcs.append(body)
        words += len(body.split()) * 2
    new = var + "_sum"
    return "\n".join(funcs), var, new


def _json_records(rng: random.Random, num_words: int) -> str:
    recs: list[str] = []
    words = 0
    keys = rng.sample(_KEYS, 5)
    i = 0
    while words < num_words:
        vals = {
            "id": str(i + 1),
            "name": f'"{rng.choice(_NAMES)}"',
            "city": f'"{rng.choice(_PLACES)}"',
            "age": str(rng.randint(18, 90)),
            "email": f'"{rng.choice(_NAMES).lower()}@example.com"',
            "active": rng.choice(["true", "false"]),
            "score": str(rng.randint(0, 100)),
        }
        rec = "{" + ", ".join(f'"{k}": {vals[k]}' for k in keys) + "}"
        recs.append(rec)
        words += 3 * len(keys)
        i += 1
    return "[\n  " + ",\n  ".join(recs) + ","


def build_spec_sessions(
    kind: str, num_requests: int, input_len: int, output_len: int, turns: int, rng: random.Random
) -> list[Session]:
    """The sessions of one speculative-decoding workload (see the module docstring)."""
    sessions: list[Session] = []
    if kind == "spec-quote":
        for i in range(max(1, num_requests // turns)):
            ts = []
            for t in range(turns):
                if t == 0:
                    text = f"Here is a story. {_passage(rng, input_len)}\nRetell the story.\n"
                else:
                    text = "\nQuote your previous answer word for word, then add one sentence.\n"
                ts.append(Turn(text, input_len if t == 0 else 16, output_len))
            sessions.append(Session(i, "", 0, tuple(ts), prefix_group=i))
        return sessions
    for i in range(num_requests):
        if kind == "spec-edit":
            passage = _passage(rng, input_len)
            old, new = rng.sample(_NAMES, 2)
            text = (
                f"Rewrite the text below, replacing the name {old} with {new}. Change "
                f"nothing else.\n\nText:\n{passage}\n\nRewritten text:\n"
            )
        elif kind == "spec-code":
            code, old, new = _code(rng, input_len)
            text = (
                f"Rename the variable `{old}` to `{new}` in this Python code.\n\n"
                f"```python\n{code}```\n\nThe code with `{old}` renamed to `{new}`:\n"
                f"```python\n"
            )
        elif kind == "spec-json":
            text = (
                "Continue this JSON list with more records in exactly the same format.\n"
                + _json_records(rng, input_len)
                + "\n  "
            )
        else:
            raise ValueError(
                f"invalid workload {kind!r}: speculative workloads are {', '.join(SPEC_KINDS)}"
            )
        sessions.append(Session(i, "", 0, (Turn(text, input_len, output_len),)))
    return sessions


def first_turn_prompts(tok: Any, sessions: list[Session]) -> list[list[int]]:
    """Each session's first user turn through the tokenizer's chat template (with the
    generation prompt) as token ids, no special tokens added."""
    return [
        list(
            tok.encode(
                str(
                    tok.apply_chat_template(
                        [{"role": "user", "content": s.turns[0].user_text}],
                        add_generation_prompt=True,
                        tokenize=False,
                    )
                ),
                add_special_tokens=False,
            )
        )
        for s in sessions
    ]
