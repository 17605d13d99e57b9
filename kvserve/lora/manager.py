"""Resident adapters: names, slots, the requests using each, and unloading.

One :class:`LoRAManager` per engine, owned by the model runner (it writes the slot
tensors the model reads) and called by the engine (request admission), the server
(load/unload endpoints, ``/v1/models``) and the offline ``LLM``. Thread-safe: the
server's event loop and the engine's step thread both call it.

An adapter's ``adapter_id`` (``"lora:<sha256 of its files>"``) goes into the first
block hash of each of its requests (``kvserve.kv_cache.hashing.request_extra_keys``),
so two adapters never share KV and requests of one adapter share their prefix.

Unloading an adapter in use waits: :meth:`begin_unload` stops new requests from
selecting it (404 for them), :meth:`in_use` counts the ones still running, and
:meth:`finish_unload` frees the slot once that count is zero.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from kvserve.lora.adapter import load_adapter
from kvserve.lora.config import LoRAConfig
from kvserve.lora.errors import LoRAError
from kvserve.lora.weights import LoRAWeights
from kvserve.model.arch import ModelArchConfig


@dataclass
class ResidentAdapter:
    """A loaded adapter: its name, folder, slot, rank and block-hash id."""

    name: str
    path: str
    slot: int
    rank: int
    adapter_id: str
    int_id: int = 0
    unloading: bool = False


class LoRAManager:
    """See the module docstring. ``weights``: the slot tensors the model applies."""

    def __init__(self, config: LoRAConfig, arch: ModelArchConfig, weights: LoRAWeights) -> None:
        self.config = config
        self.arch = arch
        self.weights = weights
        self._lock = threading.Lock()
        self._by_name: dict[str, ResidentAdapter] = {}
        self._users: dict[str, str] = {}  # req_id -> adapter name
        self._loading: set[str] = set()

    # ------------------------------------------------------------------ load / unload
    def load(self, name: str, path: str, int_id: int = 0) -> ResidentAdapter:
        """Read ``path`` (a PEFT folder), check it against the base model and write it
        into a free slot. Raises :class:`LoRAError`: 400 for a bad adapter or name,
        409 when ``name`` is loaded already or every slot is taken. Reading the files
        happens outside the lock; the slot is written before the name is visible."""
        if not name or not isinstance(name, str):
            raise LoRAError('lora_name must be a non-empty string, e.g. "sql-adapter"')
        with self._lock:
            if name in self._by_name or name in self._loading:
                raise LoRAError(
                    f"LoRA adapter {name!r} is already loaded: unload it first or pick "
                    "another lora_name",
                    status=409,
                )
            self._loading.add(name)
        try:
            adapter = load_adapter(path, self.arch, self.config.max_lora_rank)
            with self._lock:
                used = {a.slot for a in self._by_name.values()}
                free = [s for s in range(self.config.max_loras) if s not in used]
                if not free:
                    raise LoRAError(
                        f"all {self.config.max_loras} LoRA slots are taken "
                        f"({', '.join(sorted(self._by_name))}): unload one with "
                        "POST /v1/unload_lora_adapter, or restart with a larger --max-loras",
                        status=409,
                    )
                slot = free[0]
                self.weights.set_slot(slot, adapter)
                resident = ResidentAdapter(
                    name, adapter.path, slot, adapter.rank, "lora:" + adapter.digest, int_id
                )
                self._by_name[name] = resident
                return resident
        finally:
            with self._lock:
                self._loading.discard(name)

    def begin_unload(self, name: str) -> ResidentAdapter:
        """Stop new requests from selecting ``name``; 404 when it is not loaded (or
        already unloading). Its running requests go on; see :meth:`finish_unload`."""
        with self._lock:
            a = self._by_name.get(name)
            if a is None or a.unloading:
                raise LoRAError(self._unknown(name), status=404)
            a.unloading = True
            return a

    def in_use(self, name: str) -> int:
        """Requests of ``name`` not yet finished."""
        with self._lock:
            return sum(1 for n in self._users.values() if n == name)

    def finish_unload(self, name: str) -> bool:
        """Free ``name``'s slot if no request uses it; returns whether it did."""
        with self._lock:
            a = self._by_name.get(name)
            if a is None:
                return True
            if any(n == name for n in self._users.values()):
                return False
            self.weights.clear_slot(a.slot)
            del self._by_name[name]
            return True

    def cancel_unload(self, name: str) -> None:
        """Serve ``name`` again after a :meth:`begin_unload` that gave up."""
        with self._lock:
            a = self._by_name.get(name)
            if a is not None:
                a.unloading = False

    # ------------------------------------------------------------------ requests
    def resolve(self, name: str) -> ResidentAdapter:
        """The resident adapter called ``name``; 404 :class:`LoRAError` otherwise."""
        with self._lock:
            a = self._by_name.get(name)
            if a is None or a.unloading:
                raise LoRAError(self._unknown(name), status=404)
            return a

    def acquire(self, req_id: str, name: str) -> str:
        """Count request ``req_id`` as a user of ``name``; returns the adapter id for
        its block hashes. 404 when ``name`` is unknown or unloading."""
        with self._lock:
            a = self._by_name.get(name)
            if a is None or a.unloading:
                raise LoRAError(self._unknown(name), status=404)
            self._users[req_id] = name
            return a.adapter_id

    def release(self, req_id: str) -> None:
        """``req_id`` finished (or was aborted); unknown ids are ignored."""
        with self._lock:
            self._users.pop(req_id, None)

    def slot_of(self, adapter_id: str | None) -> int:
        """The slot of a resident adapter by id; -1 for None. RuntimeError when no
        slot holds it (an adapter unloaded under a running request: a bug)."""
        if adapter_id is None:
            return -1
        with self._lock:
            for a in self._by_name.values():
                if a.adapter_id == adapter_id:
                    return a.slot
        raise RuntimeError(f"no LoRA slot holds adapter {adapter_id!r}")

    def adapters(self) -> list[ResidentAdapter]:
        """Resident adapters (not unloading), by name."""
        with self._lock:
            return [a for _, a in sorted(self._by_name.items()) if not a.unloading]

    def _unknown(self, name: str) -> str:
        names = ", ".join(sorted(n for n, a in self._by_name.items() if not a.unloading))
        return (
            f"the model {name!r} does not exist: no LoRA adapter of that name is loaded "
            f"(loaded: {names or 'none'}); load it with POST /v1/load_lora_adapter"
        )
