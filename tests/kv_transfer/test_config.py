"""The --kv-* flags: spelled as documented, validated with the fix in the message."""

from __future__ import annotations

import argparse

import pytest

from kvserve.kv_transfer.config import KVTransferConfig
from kvserve.kv_transfer.factory import (
    add_kv_transfer_arguments,
    build_connector,
    kv_transfer_config_from_args,
)


def _parse(*argv: str) -> KVTransferConfig:
    parser = argparse.ArgumentParser()
    add_kv_transfer_arguments(parser)
    return kv_transfer_config_from_args(parser.parse_args(list(argv)))


def test_defaults_are_the_single_process_engine():
    config = _parse()
    assert config == KVTransferConfig()
    assert config.kv_role == "both" and config.kv_stream_chunks
    assert config.kv_load_failure_policy == "recompute" and config.kv_remote_min_tokens == 256
    assert build_connector(config, block_size=16, kv_dtype="float32") is None


def test_flags_as_spelled_in_the_issue():
    config = _parse(
        "--kv-role", "decode",
        "--kv-prefill-peers", "10.0.0.1:7100, 10.0.0.2:7100",
        "--kv-remote-min-tokens", "64",
        "--no-kv-stream-chunks",
        "--kv-transfer-timeout", "2.5",
        "--kv-load-failure-policy", "fail",
    )  # fmt: skip
    assert config.kv_prefill_peers == ("10.0.0.1:7100", "10.0.0.2:7100")
    assert config.kv_remote_min_tokens == 64 and not config.kv_stream_chunks
    assert config.kv_transfer_timeout == 2.5 and config.lease_s == 5.0
    assert config.kv_load_failure_policy == "fail"
    assert _parse("--kv-role", "prefill", "--kv-address", "0.0.0.0:7100").kv_address


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"kv_role": "prefill"}, "needs the address"),
        ({"kv_role": "prefill", "kv_address": "nohost"}, "HOST:PORT"),
        ({"kv_role": "decode"}, "at least one prefill worker"),
        ({"kv_role": "decode", "kv_prefill_peers": ("h:0",)}, "HOST:PORT"),
        ({"kv_remote_min_tokens": 0}, "integer >= 1"),
        ({"kv_transfer_timeout": 0}, "seconds > 0"),
        ({"kv_load_failure_policy": "retry"}, "recompute or fail"),
        ({"kv_role": "router"}, "both, prefill or decode"),
    ],
)
def test_bad_settings_say_how_to_fix_them(kwargs, match):
    with pytest.raises(ValueError, match=match):
        KVTransferConfig(**kwargs).validate()


def test_worker_roles_need_hashes_stable_across_processes():
    config = KVTransferConfig(kv_role="prefill", kv_address="127.0.0.1:1")
    with pytest.raises(ValueError, match="stable sha256"):
        build_connector(config, block_size=16, kv_dtype="float32", hash_algo="builtin")


def test_pools_send_every_full_block_unless_the_flag_is_given():
    """--prefill-replicas/--decode-replicas: an unset --kv-remote-min-tokens means every
    full block comes from the prefill pool; an explicit value is kept either way."""
    parser = argparse.ArgumentParser()
    add_kv_transfer_arguments(parser)
    unset = parser.parse_args([])
    assert kv_transfer_config_from_args(unset).kv_remote_min_tokens == 256
    assert kv_transfer_config_from_args(unset, pools=True).kv_remote_min_tokens == 1
    given = parser.parse_args(["--kv-remote-min-tokens", "256"])
    assert kv_transfer_config_from_args(given, pools=True).kv_remote_min_tokens == 256
