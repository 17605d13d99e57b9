"""DiskKVStore: the block files, their checks, the LRU byte budget (no model)."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

from kvserve.kv_cache.hashing import BlockHash, hash_block_tokens
from kvserve.kv_offload.store import BlockLayout, DiskKVStore

LAYOUT = BlockLayout("fp-A", "bfloat16", (2, 2, 1, 4, 8), 2 * 2 * 1 * 4 * 8 * 2)


def _block(i: int) -> tuple[BlockHash, tuple[int, ...], bytes]:
    tokens = tuple(range(i * 4, i * 4 + 4))
    return (
        hash_block_tokens(None, tokens, (("model", "fp-A"),)),
        tokens,
        bytes([i % 256]) * LAYOUT.nbytes,
    )


def _store(path: Path, layout: BlockLayout = LAYOUT, max_bytes: int = 1 << 30) -> DiskKVStore:
    return DiskKVStore(path, layout, max_bytes, lambda src: src)


def test_round_trip_and_restart(tmp_path: Path) -> None:
    store = _store(tmp_path)
    h, tokens, payload = _block(1)
    assert store.put(h, tokens, payload)
    assert not store.put(h, tokens, payload)  # queued or stored: not twice
    assert store.flush()
    assert store.read(h, tokens) == payload
    s = store.stats()
    assert (s.hits, s.reads, s.num_files, s.errors) == (1, 1, 1, 0)
    assert s.bytes_written == s.bytes_read == s.disk_bytes > LAYOUT.nbytes
    store.close()
    again = _store(tmp_path)  # a restart: the index is rebuilt from the files
    assert again.contains(h)
    assert again.read(h, tokens) == payload
    assert again.read(h, (9, 9, 9, 9)) is None  # other tokens under the hash: rejected
    assert again.stats().errors == 1
    again.close()


def _corrupt_cases() -> list[str]:
    return ["truncate", "flip_payload", "flip_header", "foreign", "layout", "garbage"]


@pytest.mark.parametrize("case", _corrupt_cases())
def test_bad_files_are_skipped_with_a_warning(
    tmp_path: Path, case: str, caplog: pytest.LogCaptureFixture
) -> None:
    h, tokens, payload = _block(2)
    if case in ("foreign", "layout"):
        other = (
            BlockLayout("fp-B", LAYOUT.dtype, LAYOUT.shape, LAYOUT.nbytes)
            if case == "foreign"
            else BlockLayout(LAYOUT.fingerprint, "float32", (2, 2, 1, 2, 8), LAYOUT.nbytes)
        )
        writer = _store(tmp_path, other)
    else:
        writer = _store(tmp_path)
    writer.put(h, tokens, payload)
    writer.close()
    path = writer.path_of(h)
    data = bytearray(path.read_bytes())
    if case == "truncate":
        data = data[:-7]
    elif case == "flip_payload":
        data[-100] ^= 0x01
    elif case == "flip_header":
        data[20] ^= 0x20
    elif case == "garbage":
        data = bytearray(b"not a block")
    path.write_bytes(bytes(data))
    store = _store(tmp_path)
    assert store.contains(h)
    with caplog.at_level(logging.WARNING, logger="kvserve.kv_offload.store"):
        assert store.read(h, tokens) is None
    assert "skipping" in caplog.text
    assert store.stats().errors == 1
    assert not store.contains(h) and not path.exists()  # dropped: never tried again
    store.close()


def test_lru_budget_deletes_least_recently_used(tmp_path: Path) -> None:
    probe = _store(tmp_path / "probe")
    h0, t0, p0 = _block(0)
    probe.put(h0, t0, p0)
    probe.close()
    file_size = probe.stats().disk_bytes + 16  # headers differ by a few bytes
    store = _store(tmp_path / "lru", max_bytes=3 * file_size)
    blocks = [_block(i) for i in range(5)]
    for h, t, p in blocks[:3]:
        store.put(h, t, p)
    store.flush()
    assert store.read(blocks[0][0], blocks[0][1]) is not None  # 0 is now the most recent
    for h, t, p in blocks[3:]:
        store.put(h, t, p)
        store.flush()
    kept = [store.contains(h) for h, _, _ in blocks]
    assert kept == [True, False, False, True, True]
    assert store.stats().disk_bytes <= 3 * file_size
    assert len(list((tmp_path / "lru").rglob("*.kvb"))) == 3
    store.close()
    # the order survives a restart (reads touch the file's mtime)
    os.utime(store.path_of(blocks[3][0]), (1, 1))  # 3 least recently used now
    again = _store(tmp_path / "lru", max_bytes=2 * file_size)
    assert [again.contains(h) for h, _, _ in blocks] == [True, False, False, False, True]
    again.close()


def test_full_queue_drops_instead_of_blocking(tmp_path: Path) -> None:
    import threading

    gate = threading.Event()

    def slow(src: bytes) -> bytes:
        gate.wait(10)
        return src

    store = DiskKVStore(tmp_path, LAYOUT, 1 << 30, slow, max_queued=1)
    blocks = [_block(i) for i in range(4)]
    results = [store.put(h, t, p) for h, t, p in blocks]
    assert results[0] and not all(results)
    assert store.stats().writes_dropped >= 1
    # a queued block is served from memory before it reaches the disk
    assert store.get_pending(blocks[0][0], blocks[0][1]) == blocks[0][2]
    gate.set()
    store.close()
    assert store.contains(blocks[0][0])
