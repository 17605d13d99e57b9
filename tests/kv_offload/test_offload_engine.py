"""The disk KV tier end to end on the default model: blocks evicted from RAM or left
by an earlier engine come back as prefix hits with output identical to a cold
compute (greedy); bad files are skipped with a warning and recomputed; cache_salt
isolates; the byte budget holds; /metrics counts it all."""

from __future__ import annotations

import json
import logging
import random
import struct
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvserve import LLM, SamplingParams
from kvserve.kv_offload.store import MAGIC

GREEDY = SamplingParams(max_tokens=8, temperature=0.0)
# 23 usable blocks of 16 tokens: a second 200-token prompt evicts the first one's blocks
OPTS = {"num_kv_blocks": 24, "max_model_len": 512}
NUM_FULL = (200 - 1) // 16  # blocks of a 200-token prompt a hit can cover


def _prompt(seed: int, n: int = 200) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 20000) for _ in range(n)]


A, B = _prompt(1), _prompt(2)


@pytest.fixture
def engines() -> Iterator[list[LLM]]:
    """LLMs a test builds, closed at the end (their writer threads stop)."""
    made: list[LLM] = []
    yield made
    for llm in made:
        llm.engine.close()


def _llm(engines: list[LLM], directory: Path, **kw: object) -> LLM:
    llm = LLM(kv_offload_dir=str(directory), **OPTS, **kw)  # type: ignore[arg-type]
    engines.append(llm)
    return llm


def _gen(llm: LLM, prompt: list[int], salt: str | None = None) -> list[int]:
    out = llm.generate(
        prompt_token_ids=[prompt], sampling_params=GREEDY, use_tqdm=False, cache_salt=salt
    )
    return list(out[0].outputs[0].token_ids)


def _restart(engines: list[LLM], directory: Path) -> LLM:
    """Close the last engine (its queued writes land) and start a new one on ``directory``."""
    old = engines.pop()
    old.engine.close()
    del old
    return _llm(engines, directory)


def test_evicted_blocks_round_trip_identical(tmp_path: Path, engines: list[LLM]) -> None:
    llm = _llm(engines, tmp_path)
    cold = _gen(llm, A)
    _gen(llm, B)  # evicts A's blocks from RAM
    assert llm.engine.kv_offload.flush()
    before = llm.engine.stats()
    assert before.kv_offload_files >= 2 * NUM_FULL  # written through
    assert _gen(llm, A) == cold
    after = llm.engine.stats()
    assert after.kv_offload_hits > 0
    assert after.prefix_cache_hits - before.prefix_cache_hits == NUM_FULL * 16
    assert after.kv_offload_bytes_read > 0 and after.kv_offload_errors == 0
    llm.engine.check_no_leaks()


def test_restart_serves_from_disk_and_metrics_count_it(tmp_path: Path, engines: list[LLM]) -> None:
    cold = _gen(_llm(engines, tmp_path), A)
    llm = _restart(engines, tmp_path)
    assert llm.engine.stats().kv_offload_files >= NUM_FULL
    assert _gen(llm, A) == cold
    stats = llm.engine.stats()
    assert stats.kv_offload_hits == NUM_FULL and stats.kv_offload_reads == NUM_FULL
    assert stats.prefix_cache_hits == NUM_FULL * 16
    assert stats.kv_offload_read_seconds > 0
    llm.engine.check_no_leaks()

    from kvserve.engine.metrics import EngineMetrics

    metrics = EngineMetrics("m")
    metrics.set_stats_source(lambda: stats)
    text = metrics.render().decode()
    for name in (
        "kv_offload_hits_total",
        "kv_offload_bytes_read_total",
        "kv_offload_read_seconds_total",
    ):
        line = next(ln for ln in text.splitlines() if ln.startswith("kvserve:" + name))
        assert float(line.split()[-1]) > 0, line


def _paths(llm: LLM, prompt: list[int], salt: str | None = None) -> list[Path]:
    engine = llm.engine
    req = engine.make_request(prompt, GREEDY, cache_salt=salt)
    hashes = engine.kv_cache_manager.block_hashes(req)[:NUM_FULL]
    return [engine.kv_offload.store.path_of(h) for h in hashes]


def _foreign(path: Path) -> None:
    """Rewrite the file as another model's: a good checksum, a foreign fingerprint."""
    data = path.read_bytes()
    (hlen,) = struct.unpack_from("<I", data, len(MAGIC))
    start = len(MAGIC) + 4
    header = json.loads(data[start : start + hlen])
    header["fingerprint"] = "0" * 64
    raw = json.dumps(header).encode()
    path.write_bytes(MAGIC + struct.pack("<I", len(raw)) + raw + data[start + hlen :])


@pytest.mark.parametrize("damage", ["truncate", "flip", "foreign"])
def test_bad_files_are_recomputed_never_loaded(
    tmp_path: Path, engines: list[LLM], damage: str, caplog: pytest.LogCaptureFixture
) -> None:
    cold = _gen(_llm(engines, tmp_path), A)
    llm = _restart(engines, tmp_path)
    bad = 5
    path = _paths(llm, A)[bad]
    if damage == "truncate":
        path.write_bytes(path.read_bytes()[:-1000])
    elif damage == "flip":
        data = bytearray(path.read_bytes())
        data[-5000] ^= 0x10
        path.write_bytes(bytes(data))
    else:
        _foreign(path)
    with caplog.at_level(logging.WARNING, logger="kvserve.kv_offload.store"):
        assert _gen(llm, A) == cold
    assert "skipping" in caplog.text and str(path) in caplog.text
    stats = llm.engine.stats()
    assert stats.kv_offload_errors == 1
    assert stats.kv_offload_hits == bad  # the blocks before the bad one; the rest recomputed
    assert stats.prefix_cache_hits == bad * 16
    llm.engine.check_no_leaks()
    # the recomputed block is written again, good this time
    assert llm.engine.kv_offload.flush()
    llm = _restart(engines, tmp_path)
    assert _gen(llm, A) == cold
    assert llm.engine.stats().kv_offload_hits == NUM_FULL


def test_cache_salt_isolates_the_disk_tier(tmp_path: Path, engines: list[LLM]) -> None:
    llm = _llm(engines, tmp_path)
    cold = _gen(llm, A, salt="tenant-1")
    llm = _restart(engines, tmp_path)
    assert _gen(llm, A, salt="tenant-2") == cold
    assert _gen(llm, A) == cold
    assert llm.engine.stats().kv_offload_hits == 0
    llm = _restart(engines, tmp_path)
    assert _gen(llm, A, salt="tenant-1") == cold
    assert llm.engine.stats().kv_offload_hits == NUM_FULL


def test_byte_budget_keeps_the_most_recent_files(tmp_path: Path, engines: list[LLM]) -> None:
    probe = _llm(engines, tmp_path / "probe")
    per_file = probe.engine.kv_offload.block_nbytes + 4096  # payload + header, generously
    budget = 6 * per_file
    llm = _llm(engines, tmp_path / "small", kv_offload_gib=budget / (1 << 30))
    _gen(llm, A)
    _gen(llm, B)
    assert llm.engine.kv_offload.flush()
    stats = llm.engine.stats()
    assert stats.kv_offload_disk_bytes <= budget
    files = list((tmp_path / "small").rglob("*.kvb"))
    assert 0 < len(files) == stats.kv_offload_files <= 6
    assert sum(f.stat().st_size for f in files) == stats.kv_offload_disk_bytes
    # the survivors are B's last blocks (the most recently written)
    assert set(files) <= set(_paths(llm, B))


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8_e4m3"])
def test_8bit_kv_round_trips_through_disk(
    tmp_path: Path, engines: list[LLM], kv_cache_dtype: str
) -> None:
    """8-bit caches are stored as their codes and scales, and a restart gets them back."""
    cold = _gen(_llm(engines, tmp_path, kv_cache_dtype=kv_cache_dtype), A)
    old = engines.pop()
    old.engine.close()
    del old
    llm = _llm(engines, tmp_path, kv_cache_dtype=kv_cache_dtype)
    assert _gen(llm, A) == cold
    assert llm.engine.stats().kv_offload_hits == NUM_FULL
    assert llm.engine.stats().kv_offload_errors == 0


def test_a_script_that_never_closes_still_writes_its_blocks(tmp_path: Path) -> None:
    """An offline script that exits right after generate: the queued writes land (atexit)."""
    import subprocess
    import sys

    script = (
        "import random\n"
        "from kvserve import LLM, SamplingParams\n"
        f"llm = LLM(kv_offload_dir={str(tmp_path)!r}, num_kv_blocks=24, max_model_len=512)\n"
        f"llm.generate(prompt_token_ids=[{A!r}], sampling_params=SamplingParams(max_tokens=1),"
        " use_tqdm=False)\n"
    )
    subprocess.run([sys.executable, "-c", script], check=True, timeout=600)
    assert len(list(tmp_path.rglob("*.kvb"))) == 200 // 16
