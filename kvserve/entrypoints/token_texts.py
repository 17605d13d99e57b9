"""Per-token strings and bytes for OpenAI logprobs (``TokenTexts``, one per tokenizer)."""

from __future__ import annotations

from typing import Any


class TokenTexts:
    """Per-token strings and bytes for logprobs (cached; one per tokenizer).

    For byte-level BPE tokenizers (GPT-2 style, the default model) the bytes are the
    token's exact bytes, so a character split across tokens is reported as the
    pieces OpenAI would send; the string is their UTF-8 decoding (U+FFFD where a
    piece is not a whole character).
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._cache: dict[int, tuple[str, bytes]] = {}
        decoder = _byte_decoder()
        probe = tokenizer.convert_ids_to_tokens(tokenizer.encode(" a b", add_special_tokens=False))
        self._byte_decoder = decoder if any("\u0120" in (t or "") for t in probe) else None

    def get(self, token_id: int) -> tuple[str, bytes]:
        hit = self._cache.get(token_id)
        if hit is not None:
            return hit
        raw: bytes | None = None
        if self._byte_decoder is not None:
            piece = self.tokenizer.convert_ids_to_tokens(token_id)
            if isinstance(piece, str) and all(c in self._byte_decoder for c in piece):
                raw = bytes(self._byte_decoder[c] for c in piece)
        if raw is None:
            raw = self.tokenizer.decode([token_id], skip_special_tokens=False).encode("utf-8")
        out = (raw.decode("utf-8", errors="replace"), raw)
        if len(self._cache) < 1 << 17:
            self._cache[token_id] = out
        return out

    def text(self, token_id: int) -> str:
        return self.get(token_id)[0]


def _byte_decoder() -> dict[str, int]:
    """GPT-2's reversible byte <-> printable-character map, inverted."""
    bs = list(range(ord("!"), ord("~") + 1))
    bs += list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = list(bs)
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs, strict=True)}
