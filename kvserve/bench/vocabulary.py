"""Prompt text of known token length for the bench workloads (:class:`WordVocabulary`).

Words that are one token each (with a leading space) for a given tokenizer, so a text
of ``n`` words is ``n`` tokens; without a tokenizer a default list of common English
words (about one token each).
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from typing import Any

# Common short English words; almost all are a single BPE token with a leading space.
_DEFAULT_WORDS_TEXT = """
the of and to in is was for on are as with his they at be this from have or by one had
not but what all were when we there can an your which their said if do will each about
how up out them then she many some so these would other into has more her two like him
see time could no make than first been its who now people my made over did down only way
find use may water long little very after words called just where most know get through
back much before go good new write our used me man too any day same right look think
also around another came come work three word must because does part even place well
such here take why things help put years different away again off went old number great
tell men say small every found still between name should home big give air line set own
under read last never us left end along while might next sound below saw something
thought both few those always looked show large often together asked house world going
want school important until form food keep children feet land side without boy once
animals life enough took sometimes four head above kind began almost live page got earth
need far hand high year mother light parts country father let night following picture
being study second eyes soon times story boys since white days paper hard near sentence
better best across during today others however sure means knew try told young miles sun
ways thing whole hear example heard several change answer room sea against top turned
learn point city play toward five using himself usually
"""

_WORD_RE = re.compile(r"^ [a-z]{2,10}$")


@dataclass(frozen=True)
class WordVocabulary:
    """Single-token words (each with its leading space) used to build prompt text.

    ``exact`` is True when every word was checked against a tokenizer: then a text of
    ``n`` words is ``n`` tokens (without special tokens) for that tokenizer.
    """

    words: tuple[str, ...]
    exact: bool

    @classmethod
    def default(cls) -> WordVocabulary:
        """Common English words; ~1 token per word in BPE vocabularies (approximate)."""
        return cls(tuple(" " + w for w in dict.fromkeys(_DEFAULT_WORDS_TEXT.split())), exact=False)

    @classmethod
    def from_tokenizer(cls, tokenizer: Any, max_words: int = 4000) -> WordVocabulary:
        """Words the tokenizer maps to exactly one id and back.

        ``tokenizer`` needs ``decode(list[int]) -> str``, ``encode(str,
        add_special_tokens=False) -> list[int]`` and ``len()`` (any Hugging Face
        tokenizer). Raises ValueError when fewer than 100 such words exist (for
        example a character-level tokenizer), since exact lengths are then impossible.
        """
        words: list[str] = []
        for token_id in range(len(tokenizer)):
            text = tokenizer.decode([token_id])
            if not _WORD_RE.match(text):
                continue
            if tokenizer.encode(text, add_special_tokens=False) != [token_id]:
                continue
            words.append(text)
            if len(words) >= max_words:
                break
        if len(words) < 100:
            raise ValueError(
                f"tokenizer has only {len(words)} single-token words of the form ' word'; "
                "exact prompt lengths need at least 100 (use a BPE tokenizer such as "
                "SmolLM2's, or run without --tokenizer for approximate lengths)"
            )
        return cls(tuple(words), exact=True)

    def text(self, rng: random.Random, num_tokens: int) -> str:
        """A text of ``num_tokens`` words drawn with ``rng`` (starts with a space)."""
        return "".join(rng.choice(self.words) for _ in range(num_tokens))
