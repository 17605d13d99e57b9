"""LoRA settings of an engine and the offline request type.

``LoRAConfig`` is built from ``--enable-lora --lora-modules NAME=PATH ... --max-loras
--max-lora-rank``; ``LoRARequest`` is vLLM's offline selector
(``LLM.generate(..., lora_request=LoRARequest(name, id, path))``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

DEFAULT_MAX_LORAS = 8
DEFAULT_MAX_LORA_RANK = 16


@dataclass(frozen=True)
class LoRARequest:
    """One adapter as vLLM's offline API names it: ``lora_name`` (also the served
    model name), ``lora_int_id`` (a positive id, kept for vLLM compatibility; kvserve
    keys adapters by name) and ``lora_path`` (a PEFT folder). The adapter is loaded on
    first use and stays loaded (a slot) until unloaded."""

    lora_name: str
    lora_int_id: int
    lora_path: str

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path


def parse_lora_module(text: str) -> tuple[str, str]:
    """``NAME=PATH`` -> (name, path); ValueError with an example otherwise. vLLM's JSON
    form ``{"name": ..., "path": ...}`` is accepted too."""
    text = text.strip()
    if text.startswith("{"):
        import json

        try:
            obj = json.loads(text)
            return str(obj["name"]), str(obj["path"])
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(
                f"invalid --lora-modules entry {text!r}: use NAME=PATH or "
                '\'{"name": "sql", "path": "/adapters/sql"}\''
            ) from e
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise ValueError(
            f"invalid --lora-modules entry {text!r}: use NAME=PATH, e.g. sql=/adapters/sql"
        )
    return name, path


@dataclass(frozen=True)
class LoRAConfig:
    """``enable_lora``: serve adapters at all (off: the other fields are unused).
    ``max_loras``: adapters resident at once (one slot each; all of them can run in one
    batch). ``max_lora_rank``: the largest rank an adapter may have (slots are padded to
    it). ``lora_modules``: (name, path) pairs loaded at start."""

    enable_lora: bool = False
    max_loras: int = DEFAULT_MAX_LORAS
    max_lora_rank: int = DEFAULT_MAX_LORA_RANK
    lora_modules: tuple[tuple[str, str], ...] = field(default_factory=tuple)

    def validate(self) -> None:
        """Raise ValueError with the fix when a setting cannot work."""
        if self.max_loras < 1:
            raise ValueError(f"invalid max_loras={self.max_loras}: use 1 or more, e.g. 8")
        if self.max_lora_rank < 1:
            raise ValueError(f"invalid max_lora_rank={self.max_lora_rank}: use 1 or more, e.g. 16")
        if self.lora_modules and not self.enable_lora:
            raise ValueError("--lora-modules needs --enable-lora")
        if len(self.lora_modules) > self.max_loras:
            raise ValueError(
                f"{len(self.lora_modules)} --lora-modules but max_loras={self.max_loras}: "
                f"raise --max-loras to {len(self.lora_modules)}"
            )
        names = [n for n, _ in self.lora_modules]
        if len(set(names)) != len(names):
            raise ValueError(f"--lora-modules names must be unique, got {names}")
