"""A GGUF file's tensors as kvserve runs them, stored once and memory-mapped later.

Repacking a GGUF file's blocks into the kernels' panel layout runs at 36-70 MB of
file per second per core, so an 8B Q4_K_M file (4.9 GB) takes over a minute to load.
:func:`cached_tensors` stores what :func:`kvserve.model.quant.gguf.read_tensors`
yields (panels, float tensors) in one file the first time, and on later starts
yields zero-copy views of that file mapped copy-on-write: the weights are then the
page cache's pages (shared by every process serving the same file, given back by the
kernel under memory pressure, read again from disk), and a warm start costs the
mapping, not the repack.

Rules:

- The cache is keyed by the GGUF file's content digest, the loader's arguments that
  change the tensors (heads, KV heads), and :data:`PACK_VERSION` plus a digest of the
  packing code, so a changed packer never reads an old layout.
- An entry is complete only once its ``index.json`` is renamed into place (written
  last, under a lock); a partial or unreadable entry is rebuilt, never read.
- Views share the file's pages: callers must not write into yielded tensors
  (copy-on-write keeps the file intact if they do, at the cost of a private copy).
- ``KVSERVE_PACKED_CACHE=0`` disables the cache (every load repacks); the entry
  needs about the GGUF file's size on disk under ``cache_dir()/packed``.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import mmap
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from kvserve.model.quant.formats import FORMATS, QuantWeight
from kvserve.model.quant.kquant import KFORMATS, KQuantWeight

logger = logging.getLogger(__name__)

PACK_VERSION = 1
_ALIGN = 64
_INDEX = "index.json"
_DATA = "weights.bin"
_CODE = ("formats.py", "kquant.py", "gguf.py")
_CSRC = ("linear_quant.cpp", "linear_kquant.cpp")

Value = torch.Tensor | QuantWeight


def enabled() -> bool:
    """False when ``KVSERVE_PACKED_CACHE=0``."""
    return os.environ.get("KVSERVE_PACKED_CACHE", "1") != "0"


def _code_digest() -> str:
    here = Path(__file__).parent
    h = hashlib.sha256(f"pack{PACK_VERSION}".encode())
    for name in _CODE:
        h.update((here / name).read_bytes())
    for name in _CSRC:
        p = here.parent / "csrc" / name
        if p.is_file():
            h.update(p.read_bytes())
    return h.hexdigest()[:16]


def entry_dir(root: Path, file_digest: str, args: str) -> Path:
    """The folder of one cache entry under ``root``."""
    key = hashlib.sha256(f"{file_digest}|{args}|{_code_digest()}".encode()).hexdigest()[:24]
    return root / key


def _dtype_name(dt: torch.dtype) -> str:
    return str(dt).removeprefix("torch.")


_FUSED = {"q_proj": 0, "k_proj": 1, "v_proj": 2, "gate_proj": 3, "up_proj": 4}


def _file_order(name: str) -> tuple[str, int, str]:
    """Sort key that puts the parts of a fused linear (q, k, v; gate, up) end to end,
    so that :func:`~kvserve.model.quant.formats.cat_bytes` fuses them as a view."""
    parts = name.split(".")
    for i, part in enumerate(parts):
        if part in _FUSED:
            return (".".join(parts[:i]), _FUSED[part], ".".join(parts[i + 1 :]))
    return (name, -1, "")


def _write(entry: Path, tensors: Iterator[tuple[str, Value]]) -> Iterator[tuple[str, Value]]:
    """Yield ``tensors`` (all read first, as the model's loader keeps them all) and
    store them in a new entry, published (rename of a temporary folder) when complete.
    A failure to write (full disk) only logs: the tensors were produced."""
    items = list(tensors)
    try:
        _store(entry, items)
    except (OSError, ValueError) as e:
        logger.warning("packed weight cache not written (%s): later starts repack", e)
    yield from items


def _store(entry: Path, items: list[tuple[str, Value]]) -> None:
    entry.parent.mkdir(parents=True, exist_ok=True)
    tmp = entry.with_name(f".{entry.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    index: list[dict[str, Any]] = []
    try:
        with open(tmp / _DATA, "wb") as f:
            for name, value in sorted(items, key=lambda nv: _file_order(nv[0])):
                t = value.data if isinstance(value, QuantWeight) else value
                t = t.detach().contiguous()
                pos = f.tell()
                if pos % _ALIGN:
                    f.write(b"\0" * (_ALIGN - pos % _ALIGN))
                    pos = f.tell()
                if t.numel():
                    f.write(t.reshape(-1).view(torch.uint8).numpy().data)
                item: dict[str, Any] = {
                    "name": name,
                    "offset": pos,
                    "nbytes": t.numel() * t.element_size(),
                    "dtype": _dtype_name(t.dtype),
                    "shape": list(t.shape),
                }
                if isinstance(value, QuantWeight):
                    if value.in_perm is not None:
                        raise ValueError("act-order weights are not cached")
                    item.update(
                        kind="kquant" if isinstance(value, KQuantWeight) else "quant",
                        fmt=value.fmt.name, n=value.n, k=value.k, source=value.source,
                    )  # fmt: skip
                else:
                    item["kind"] = "tensor"
                index.append(item)
        index.sort(key=lambda it: [n for n, _ in items].index(it["name"]))  # the loader's order
        (tmp / _INDEX).write_text(json.dumps({"version": PACK_VERSION, "tensors": index}))
        with _lock(entry):
            if not (entry / _INDEX).is_file():
                shutil.rmtree(entry, ignore_errors=True)
                os.rename(tmp, entry)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


@contextlib.contextmanager
def _lock(entry: Path) -> Iterator[None]:
    with open(entry.with_name(f".{entry.name}.lock"), "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _read(entry: Path) -> list[tuple[str, Value]] | None:
    """The entry's tensors as views of its file, mapped once copy-on-write; None
    when it is unreadable."""
    try:
        meta = json.loads((entry / _INDEX).read_text())
        if meta.get("version") != PACK_VERSION:
            raise ValueError(f"layout version {meta.get('version')!r}, not {PACK_VERSION}")
        path = entry / _DATA
        size = path.stat().st_size
        whole = torch.empty(0, dtype=torch.uint8)
        if size:
            with open(path, "rb") as fh:
                mm = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_COPY)
            whole = torch.frombuffer(mm, dtype=torch.uint8)
        out: list[tuple[str, Value]] = []
        for item in meta["tensors"]:
            dtype = getattr(torch, item["dtype"])
            off, nbytes = int(item["offset"]), int(item["nbytes"])
            if off + nbytes > size or off % _ALIGN:
                raise ValueError(f"tensor {item['name']!r} runs past the file's {size} bytes")
            t = whole[off : off + nbytes].view(dtype).view(item["shape"])
            value: Value
            if item["kind"] == "kquant":
                value = KQuantWeight(t, KFORMATS[item["fmt"]], item["n"], item["k"], item["source"])
            elif item["kind"] == "quant":
                value = QuantWeight(t, FORMATS[item["fmt"]], item["n"], item["k"], item["source"])
            else:
                value = t
            out.append((item["name"], value))
        return out
    except (OSError, ValueError, KeyError, TypeError, AttributeError, RuntimeError) as e:
        logger.warning("packed weight cache %s unreadable (%s): repacking", entry, e)
        return None


def cached_tensors(
    root: Path, file_digest: str, args: str, produce: Callable[[], Iterator[tuple[str, Value]]]
) -> Iterator[tuple[str, Value]]:
    """``produce()``'s tensors, from the cache entry for (``file_digest``, ``args``)
    when it is complete, else produced and stored for the next start."""
    if not enabled():
        yield from produce()
        return
    entry = entry_dir(root, file_digest, args)
    if (entry / _INDEX).is_file():
        got = _read(entry)
        if got is not None:
            logger.info("weights mapped from the packed cache %s", entry)
            yield from got
            return
    yield from _write(entry, produce())
