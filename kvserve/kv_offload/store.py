"""The disk store of the KV offload tier: one file per full KV block, named by its
block hash, an LRU index bounded in bytes, and a writer thread. No torch here: the
store moves bytes; :mod:`kvserve.kv_offload.tier` turns blocks into bytes and back.

File layout (``DIR/ab/abcdef....kvb``, ``ab`` the hash's first two hex digits)::

    b"KVSBLK01"            8 bytes, magic (the format's version is in it)
    header_len             u32 little-endian, at most MAX_HEADER_BYTES
    header                 UTF-8 JSON: {"hash": hex, "fingerprint": str, "dtype": str,
                           "shape": [L, 2, Hk, B, D], "token_ids": [...],
                           "nbytes": int, "sha256": hex of the payload}
    payload                nbytes raw bytes: one block's K and V, in ``dtype``

A file is accepted only when every field matches what the reader expects (the hash
it asked for, this engine's fingerprint, KV dtype and block shape, the block's own
token ids), the file is exactly as long as the header says, and the payload's
sha256 matches. Anything else (truncated, flipped, another model's or layout's file)
is logged as a warning, counted in ``errors``, dropped from the index and deleted:
the caller recomputes the block and a later save writes a good file again.

Threads: the engine thread calls :meth:`DiskKVStore.put`, :meth:`contains`,
:meth:`get_pending`, :meth:`read`; the writer thread drains the queue. One lock
guards the index, the pending map and the counters. Files are written to a
``.tmp`` name and renamed, so a reader never sees half a file from this process
(a crash mid-write leaves a ``.tmp``, removed at the next start).

Caller rules: one engine per directory (the byte limit is kept by this process's
index only); :meth:`close` at shutdown (it drains queued writes; without it, an
``atexit`` hook does so when the interpreter exits). Writes
never block the engine thread: when the queue is full the block is not written
(``writes_dropped``); the engine offers it again when it is evicted.
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import io
import json
import logging
import os
import queue
import struct
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvserve.kv_cache.hashing import BlockHash

logger = logging.getLogger(__name__)

MAGIC = b"KVSBLK01"
MAX_HEADER_BYTES = 1 << 20
SUFFIX = ".kvb"
_LEN = struct.Struct("<I")


@dataclass(frozen=True)
class BlockLayout:
    """What a block file must match to be loaded: the KV fingerprint (model weights,
    dtype, RoPE, KV format; :func:`kvserve.kv_cache.hashing.model_fingerprint`), the
    cache's element dtype name and one block's shape ``[L, 2, Hk, B, D]``."""

    fingerprint: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int  # payload bytes of one block


@dataclass(frozen=True)
class OffloadStats:
    """Counters since start (plain data, any thread)."""

    hits: int = 0  # blocks loaded back (from disk or from the write queue)
    bytes_read: int = 0
    bytes_written: int = 0
    read_seconds: float = 0.0  # wall time of the disk reads (open to checksum)
    reads: int = 0
    errors: int = 0  # files skipped: corrupt, truncated, foreign
    writes_dropped: int = 0  # queue full, or a write that failed
    disk_bytes: int = 0
    num_files: int = 0


class _Stop:
    pass


class DiskKVStore:
    """The files of one directory, their LRU index and the writer thread.

    ``max_bytes``: the directory's budget; after each write the least recently used
    files are deleted until it holds. ``to_bytes(source)`` runs on the writer
    thread and turns what :meth:`put` was given into the payload (a bytes-like
    object of ``layout.nbytes`` bytes). ``max_queued``: queued blocks at most.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        layout: BlockLayout,
        max_bytes: int,
        to_bytes: Callable[[Any], Any],
        *,
        max_queued: int = 64,
    ) -> None:
        if max_bytes <= 0:
            raise ValueError(f"kv offload budget must be > 0 bytes, got {max_bytes}")
        self.dir = Path(directory)
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            probe = self.dir / f".probe.{os.getpid()}.tmp"
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as e:
            raise ValueError(
                f"invalid kv_offload_dir={str(directory)!r}: cannot write there ({e}); pick a "
                "writable directory (for example: --kv-offload-dir /var/cache/kvserve/kv)"
            ) from None
        self.layout = layout
        self.max_bytes = max_bytes
        self._to_bytes = to_bytes
        self._lock = threading.Lock()
        self._index: OrderedDict[bytes, int] = OrderedDict()  # hash -> file bytes, LRU first
        self._disk_bytes = 0
        self._pending: dict[bytes, tuple[tuple[int, ...], Any]] = {}
        self._counts: dict[str, Any] = {k: 0 for k in OffloadStats.__dataclass_fields__}
        self._counts["read_seconds"] = 0.0
        self._queue: queue.Queue[tuple[bytes, tuple[int, ...], Any] | _Stop] = queue.Queue(
            maxsize=max(1, max_queued)
        )
        self._scan()
        self._closed = False
        self._thread = threading.Thread(
            target=self._write_loop, name="kv-offload-writer", daemon=True
        )
        self._thread.start()
        # A script that never calls close() still gets its queued writes at exit (atexit
        # runs before the interpreter stops daemon threads).
        atexit.register(self.close)

    # ------------------------------------------------------------------ index
    def path_of(self, block_hash: bytes) -> Path:
        """The file that holds (or would hold) the block ``block_hash``."""
        h = block_hash.hex()
        return self.dir / h[:2] / (h + SUFFIX)

    def _scan(self) -> None:
        """Index the files already in the directory, oldest modification first (the
        LRU order survives restarts: a read touches its file's mtime)."""
        found: list[tuple[float, bytes, int]] = []
        for sub in self.dir.iterdir():
            if not sub.is_dir() or len(sub.name) != 2:
                continue
            for entry in os.scandir(sub):
                name = entry.name
                if name.endswith(".tmp"):
                    _unlink(Path(entry.path))  # a write a crash cut short
                    continue
                if not name.endswith(SUFFIX):
                    continue
                try:
                    digest = bytes.fromhex(name[: -len(SUFFIX)])
                    st = entry.stat()
                except (ValueError, OSError):
                    continue
                found.append((st.st_mtime, digest, st.st_size))
        found.sort()
        for _, digest, size in found:
            self._index[digest] = size
            self._disk_bytes += size
        self._trim()

    def contains(self, block_hash: BlockHash) -> bool:
        """Whether a file (or a queued write) for ``block_hash`` exists. Cheap: no I/O."""
        with self._lock:
            return block_hash in self._index or block_hash in self._pending

    def get_pending(self, block_hash: BlockHash, token_ids: tuple[int, ...]) -> Any | None:
        """The source object of a queued, not yet written block with these tokens
        (counted as a hit), or None."""
        with self._lock:
            item = self._pending.get(block_hash)
            if item is None or item[0] != token_ids:
                return None
            self._counts["hits"] += 1
            return item[1]

    def stats(self) -> OffloadStats:
        with self._lock:
            return OffloadStats(
                **{**self._counts, "disk_bytes": self._disk_bytes, "num_files": len(self._index)}
            )

    # ------------------------------------------------------------------ writes
    def put(self, block_hash: BlockHash, token_ids: tuple[int, ...], source: Any) -> bool:
        """Queue block ``block_hash`` for writing (``source`` is turned into its payload
        on the writer thread; the caller must not change it afterwards). Returns False,
        queuing nothing, when the block is already stored or queued, the store is
        closed, or the queue is full (then ``writes_dropped`` counts it). Never blocks."""
        with self._lock:
            if self._closed or block_hash in self._index or block_hash in self._pending:
                return False
            self._pending[block_hash] = (token_ids, source)
        try:
            self._queue.put_nowait((block_hash, token_ids, source))
        except queue.Full:
            with self._lock:
                self._pending.pop(block_hash, None)
                self._counts["writes_dropped"] += 1
            return False
        return True

    def _write_loop(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if isinstance(item, _Stop):
                    return
                self._write(*item)
            except Exception:  # never let one bad write stop the thread
                logger.exception("kv offload: writing a block failed")
                with self._lock:
                    self._pending.pop(item[0], None)  # type: ignore[index]
                    self._counts["writes_dropped"] += 1
            finally:
                self._queue.task_done()

    def _write(self, block_hash: bytes, token_ids: tuple[int, ...], source: Any) -> None:
        payload = memoryview(self._to_bytes(source)).cast("B")
        lay = self.layout
        if payload.nbytes != lay.nbytes:
            raise ValueError(f"block payload of {payload.nbytes} bytes, layout needs {lay.nbytes}")
        header = json.dumps(
            {
                "hash": block_hash.hex(),
                "fingerprint": lay.fingerprint,
                "dtype": lay.dtype,
                "shape": list(lay.shape),
                "token_ids": list(token_ids),
                "nbytes": payload.nbytes,
                "sha256": hashlib.sha256(payload).hexdigest(),
            },
            separators=(",", ":"),
        ).encode()
        size = len(MAGIC) + _LEN.size + len(header) + payload.nbytes
        path = self.path_of(block_hash)
        if size > self.max_bytes:
            raise ValueError(f"one block file ({size} bytes) exceeds the kv offload budget")
        path.parent.mkdir(exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        with open(tmp, "wb") as fh:
            fh.write(MAGIC)
            fh.write(_LEN.pack(len(header)))
            fh.write(header)
            fh.write(payload)
        os.replace(tmp, path)
        with self._lock:
            self._pending.pop(block_hash, None)
            old = self._index.pop(block_hash, 0)
            self._index[block_hash] = size
            self._disk_bytes += size - old
            self._counts["bytes_written"] += size
            self._trim()

    def _trim(self) -> None:
        """Delete least recently used files until the budget holds (lock held)."""
        while self._disk_bytes > self.max_bytes and self._index:
            digest, size = self._index.popitem(last=False)
            self._disk_bytes -= size
            _unlink(self.path_of(digest))

    def flush(self, timeout_s: float = 60.0) -> bool:
        """Wait until every queued write is done; False if ``timeout_s`` passed first."""
        deadline = time.monotonic() + timeout_s
        while self._queue.unfinished_tasks:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.005)
        return True

    def close(self, timeout_s: float = 60.0) -> None:
        """Write what is queued, stop the writer thread. Idempotent; puts after it are
        refused."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        atexit.unregister(self.close)
        self._queue.put(_Stop())
        self._thread.join(timeout_s)

    # ------------------------------------------------------------------ reads
    def read(self, block_hash: BlockHash, token_ids: Sequence[int]) -> bytes | None:
        """The checked payload of block ``block_hash``, or None (:meth:`read_into`)."""
        buf = bytearray(self.layout.nbytes)
        return bytes(buf) if self.read_into(block_hash, token_ids, memoryview(buf)) else None

    def read_into(self, block_hash: BlockHash, token_ids: Sequence[int], out: memoryview) -> bool:
        """Read the payload of block ``block_hash`` with these ``token_ids`` into ``out``
        (a writable buffer of ``layout.nbytes`` bytes) and check it. False when it is
        not stored, or rejected (see the module doc; a warning, the file is deleted):
        ``out`` then holds garbage the caller must not use. A hit moves the file to the
        back of the LRU order and counts its bytes and read time."""
        with self._lock:
            if block_hash not in self._index:
                return False
        path = self.path_of(block_hash)
        t0 = time.perf_counter()
        try:
            with open(path, "rb") as fh:
                reason, size = self._read_checked(fh, block_hash, token_ids, out)
        except OSError as e:
            reason, size = f"cannot be read ({e})", 0
        elapsed = time.perf_counter() - t0
        if reason:
            self._reject(block_hash, reason)
            return False
        now = time.time()
        with contextlib.suppress(OSError):
            os.utime(path, (now, now))
        with self._lock:
            if block_hash in self._index:
                self._index.move_to_end(block_hash)
            self._counts["hits"] += 1
            self._counts["reads"] += 1
            self._counts["bytes_read"] += size
            self._counts["read_seconds"] += elapsed
        return True

    def _read_checked(
        self, fh: io.BufferedReader, block_hash: bytes, token_ids: Sequence[int], out: memoryview
    ) -> tuple[str, int]:
        """("", file bytes) with the payload in ``out``, or (why it is rejected, 0)."""
        head = fh.read(len(MAGIC) + _LEN.size)
        if len(head) < len(MAGIC) + _LEN.size or head[: len(MAGIC)] != MAGIC:
            return "has no kvserve block header (truncated or not a block file)", 0
        (hlen,) = _LEN.unpack_from(head, len(MAGIC))
        if hlen > MAX_HEADER_BYTES:
            return "has a corrupt header", 0
        raw = fh.read(hlen)
        if len(raw) != hlen:
            return "has a truncated header", 0
        try:
            header = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError):
            return "has a corrupt header", 0
        if not isinstance(header, dict):
            return "has a corrupt header", 0
        lay = self.layout
        if header.get("fingerprint") != lay.fingerprint:
            return (
                f"belongs to another model or KV format (fingerprint "
                f"{str(header.get('fingerprint'))[:12]}..., this engine's {lay.fingerprint[:12]}...)",
                0,
            )
        if header.get("dtype") != lay.dtype or header.get("shape") != list(lay.shape):
            return (
                f"has KV layout {header.get('dtype')} {header.get('shape')}, this engine's is "
                f"{lay.dtype} {list(lay.shape)}",
                0,
            )
        if header.get("hash") != block_hash.hex():
            return "names another block hash", 0
        if header.get("token_ids") != list(token_ids):
            return "holds other tokens than the block asked for", 0
        if header.get("nbytes") != lay.nbytes or out.nbytes != lay.nbytes:
            return (
                f"has a payload of {header.get('nbytes')} bytes, this engine's blocks have {lay.nbytes}",
                0,
            )
        got = fh.readinto(out)
        if got != lay.nbytes or fh.read(1):
            return (
                f"has {got} payload bytes{' and more' if got == lay.nbytes else ''}, its header says {lay.nbytes}",
                0,
            )
        if hashlib.sha256(out).hexdigest() != header.get("sha256"):
            return "fails its checksum (corrupt payload)", 0
        return "", len(head) + hlen + lay.nbytes

    def _reject(self, block_hash: bytes, reason: str) -> None:
        path = self.path_of(block_hash)
        logger.warning("kv offload: skipping %s: the file %s; recomputing the block", path, reason)
        with self._lock:
            self._counts["errors"] += 1
            size = self._index.pop(block_hash, None)
            if size is not None:
                self._disk_bytes -= size
        _unlink(path)


def _unlink(path: Path) -> None:
    with contextlib.suppress(OSError):
        path.unlink()
