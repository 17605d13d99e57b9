"""The kv_offload_* options: validated up front, with the fix in the message."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvserve.engine.args import build_engine_config
from kvserve.kv_offload.store import BlockLayout, DiskKVStore


def test_offload_options_reach_the_cache_config(tmp_path: Path) -> None:
    config = build_engine_config(kv_offload_dir=str(tmp_path), kv_offload_gib=2.5)
    assert config.cache.kv_offload_dir == str(tmp_path)
    assert config.cache.kv_offload_gib == 2.5
    assert build_engine_config().cache.kv_offload_dir is None


@pytest.mark.parametrize(
    ("options", "needle"),
    [
        ({"hash_algo": "builtin"}, "--hash-algo sha256"),
        ({"enable_prefix_caching": False}, "needs the prefix cache"),
        ({"kv_offload_gib": 0}, "kv_offload_gib"),
        ({"kv_offload_gib": -1.0}, "kv_offload_gib"),
    ],
)
def test_bad_offload_options_are_refused(
    tmp_path: Path, options: dict[str, object], needle: str
) -> None:
    with pytest.raises(ValueError, match="invalid kv_offload") as err:
        build_engine_config(kv_offload_dir=str(tmp_path), **options)
    assert needle in str(err.value)


def test_unwritable_directory_is_a_clear_error(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    layout = BlockLayout("fp", "bfloat16", (1, 2, 1, 4, 8), 128)
    with pytest.raises(ValueError, match="cannot write there"):
        DiskKVStore(blocker / "kv", layout, 1 << 20, lambda s: s)
