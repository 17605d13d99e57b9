"""Greedy-output agreement between two engines: pure comparison logic (stdlib only).

``peers.py agree`` feeds llama.cpp's server and kvserve the same prompt token ids and
greedy-decodes a fixed number of tokens from each; this module turns the two lists of
generated ids into the figures it reports. A caller keeps two rules:

- ``reference`` and ``candidate`` hold one list of generated token ids per prompt, in the
  same prompt order, both as long as the engines were asked for (EOS ignored), so a length
  difference is itself a divergence (at the shorter length).
- Token ids are plain ``int``; nothing here decodes text.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass


def first_divergence(a: Sequence[int], b: Sequence[int]) -> int | None:
    """The first position where ``a`` and ``b`` differ, ``None`` when they are equal.

    One being a strict prefix of the other diverges at the shorter length."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    if len(a) != len(b):
        return min(len(a), len(b))
    return None


@dataclass(frozen=True)
class Agreement:
    """How closely ``candidate`` reproduced ``reference``'s greedy sequences.

    - ``exact``: sequences identical end to end (of ``sequences``).
    - ``mean_first_divergence``: mean position of the first differing token over the
      sequences that diverge (``None`` when none does).
    - ``mean_common_prefix``: mean length of the identical prefix over all sequences (an
      exact match counts its full length).
    - ``token_agreement``: generated tokens before each sequence's first divergence, as a
      fraction of all reference tokens (1.0 = every sequence identical).
    - ``divergences``: per prompt, the first divergence position or ``None``."""

    sequences: int
    exact: int
    mean_first_divergence: float | None
    mean_common_prefix: float
    token_agreement: float
    divergences: list[int | None]

    def as_dict(self) -> dict[str, object]:
        return asdict(self)

    def line(self) -> str:
        """One human-readable summary line."""
        mfd = "-" if self.mean_first_divergence is None else f"{self.mean_first_divergence:.1f}"
        return (
            f"exact {self.exact}/{self.sequences}, mean first divergence {mfd}, "
            f"mean common prefix {self.mean_common_prefix:.1f}, "
            f"token agreement {self.token_agreement:.1%}"
        )


def compare(reference: Sequence[Sequence[int]], candidate: Sequence[Sequence[int]]) -> Agreement:
    """Compare two engines' greedy outputs prompt by prompt (see :class:`Agreement`).

    Raises ValueError when the two do not hold the same number of sequences or hold none."""
    if len(reference) != len(candidate):
        raise ValueError(
            f"{len(reference)} reference sequences but {len(candidate)} candidate sequences: "
            "both engines must answer every prompt, in the same order"
        )
    if not reference:
        raise ValueError("no sequences to compare")
    divs = [first_divergence(r, c) for r, c in zip(reference, candidate, strict=True)]
    prefixes = [len(r) if d is None else d for r, d in zip(reference, divs, strict=True)]
    diverged = [d for d in divs if d is not None]
    total = sum(len(r) for r in reference)
    return Agreement(
        sequences=len(reference),
        exact=sum(d is None for d in divs),
        mean_first_divergence=sum(diverged) / len(diverged) if diverged else None,
        mean_common_prefix=sum(prefixes) / len(prefixes),
        token_agreement=sum(prefixes) / total if total else 1.0,
        divergences=divs,
    )


def tokenization_mismatches(a: Sequence[Sequence[int]], b: Sequence[Sequence[int]]) -> list[int]:
    """Indices of the prompts whose two tokenizations differ (the lists must align)."""
    if len(a) != len(b):
        raise ValueError(f"{len(a)} vs {len(b)} tokenized prompts")
    return [i for i, (x, y) in enumerate(zip(a, b, strict=True)) if list(x) != list(y)]


# Raw completion prompts (no chat template): prose, code, lists, dialogue, numbers, one
# chat-formatted turn written out by hand. Both engines get the same token ids.
PROMPTS: tuple[str, ...] = (
    "The history of the printing press begins in the fifteenth century, when",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
    "Photosynthesis is the process by which green plants",
    "The capital of France is Paris. The capital of Germany is",
    "Once upon a time, in a small village at the edge of a dark forest, there lived",
    "import json\n\ndef load_config(path):\n    with open(path) as fh:\n",
    "Here are five tips for staying healthy:\n1.",
    "Q: What is the boiling point of water at sea level?\nA:",
    "The three primary colors are",
    "SELECT name, email FROM users WHERE",
    "In 1969, Neil Armstrong became the first person to",
    "<|im_start|>user\nWrite a haiku about the ocean.<|im_end|>\n<|im_start|>assistant\n",
    "The quick brown fox jumps over the lazy dog. The quick brown fox",
    "Machine learning is a field of artificial intelligence that",
    "To make a cup of tea, first",
    "1, 2, 3, 5, 8, 13, 21,",
)
