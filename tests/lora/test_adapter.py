"""Reading PEFT folders: what is accepted, and the clear error for each bad adapter."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from support.lora_adapters import make_adapter, tiny_hf_config

from kvserve.lora.adapter import load_adapter
from kvserve.lora.config import LoRAConfig, parse_lora_module
from kvserve.lora.errors import LoRAError
from kvserve.lora.manager import LoRAManager
from kvserve.lora.weights import LoRAWeights
from kvserve.model.arch import ModelArchConfig

HF = tiny_hf_config()
ARCH = ModelArchConfig.from_hf_config(HF)


def test_reads_a_peft_folder(tmp_path: Path) -> None:
    folder = make_adapter(tmp_path / "a", HF, rank=4, alpha=8.0, seed=3)
    a = load_adapter(str(folder), ARCH, max_rank=16)
    assert a.rank == 4 and a.scale == 2.0
    assert len(a.weights) == 2 * 7
    A, B = a.weights[(1, "k_proj")]
    assert A.shape == (4, 32) and B.shape == (16, 4)
    again = load_adapter(str(make_adapter(tmp_path / "b", HF, rank=4, alpha=8.0, seed=3)), ARCH, 16)
    assert again.digest == a.digest  # same files, same identity (block hashes)
    other = load_adapter(str(make_adapter(tmp_path / "c", HF, rank=4, seed=4)), ARCH, 16)
    assert other.digest != a.digest


def test_rslora_scale(tmp_path: Path) -> None:
    folder = make_adapter(tmp_path / "a", HF, rank=4, alpha=8.0, extra_config={"use_rslora": True})
    assert load_adapter(str(folder), ARCH, 16).scale == 4.0


@pytest.mark.parametrize(
    ("build", "match"),
    [
        (lambda p: p / "missing", "is not a folder"),
        (lambda p: (p / "empty").mkdir() or p / "empty", "no adapter_config.json"),
        (lambda p: make_adapter(p / "r", HF, rank=32), r"rank r=32 is over --max-lora-rank 16"),
        (
            lambda p: make_adapter(p / "s", HF, rank=4, shape_override={"q_proj": (4, 31)}),
            r"has shape \[4, 31\], the base model needs \[4, 32\]",
        ),
        (
            lambda p: make_adapter(p / "l", HF, rank=4, layers=[5]),
            "layer 5 but the base model has 2 layers",
        ),
        (
            lambda p: make_adapter(p / "d", HF, rank=4, extra_config={"use_dora": True}),
            "use_dora=true is not supported",
        ),
        (
            lambda p: make_adapter(
                p / "m", HF, rank=4, extra_config={"modules_to_save": ["lm_head"]}
            ),
            "modules_to_save",
        ),
        (
            lambda p: make_adapter(
                p / "t", HF, rank=4, extra_config={"target_modules": ["embed_tokens"]}
            ),
            "target_modules",
        ),
    ],
)
def test_bad_adapters_are_refused_with_the_reason(tmp_path: Path, build, match: str) -> None:
    with pytest.raises(LoRAError, match=match) as info:
        load_adapter(str(build(tmp_path)), ARCH, max_rank=16)
    assert info.value.status == 400


def test_missing_weights_file_and_half(tmp_path: Path) -> None:
    folder = make_adapter(tmp_path / "a", HF, rank=4)
    (folder / "adapter_model.safetensors").unlink()
    with pytest.raises(LoRAError, match="no adapter_model.safetensors"):
        load_adapter(str(folder), ARCH, 16)
    from safetensors.torch import save_file

    save_file(
        {"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.zeros(4, 32)},
        str(folder / "adapter_model.safetensors"),
    )
    with pytest.raises(LoRAError, match="has no lora_B.weight"):
        load_adapter(str(folder), ARCH, 16)
    (folder / "adapter_config.json").write_text("{not json")
    with pytest.raises(LoRAError, match="not JSON"):
        load_adapter(str(folder), ARCH, 16)


def test_manager_slots_names_and_unload_waits(tmp_path: Path) -> None:
    cfg = LoRAConfig(enable_lora=True, max_loras=2, max_lora_rank=8)
    m = LoRAManager(cfg, ARCH, LoRAWeights(ARCH, 2, 8))
    a = m.load("a", str(make_adapter(tmp_path / "a", HF, rank=4, seed=1)))
    b = m.load("b", str(make_adapter(tmp_path / "b", HF, rank=8, seed=2)))
    assert {a.slot, b.slot} == {0, 1} and a.adapter_id != b.adapter_id
    with pytest.raises(LoRAError, match="already loaded") as info:
        m.load("a", str(tmp_path / "a"))
    assert info.value.status == 409
    with pytest.raises(LoRAError, match="all 2 LoRA slots are taken") as info:
        m.load("c", str(make_adapter(tmp_path / "c", HF, rank=4, seed=3)))
    assert info.value.status == 409
    with pytest.raises(LoRAError, match="does not exist") as info:
        m.resolve("nope")
    assert info.value.status == 404
    assert m.acquire("r1", "a") == a.adapter_id
    m.begin_unload("a")
    with pytest.raises(LoRAError):  # new requests cannot select it any more
        m.acquire("r2", "a")
    assert [x.name for x in m.adapters()] == ["b"]
    assert m.in_use("a") == 1 and not m.finish_unload("a")  # r1 still runs
    assert m.slot_of(a.adapter_id) == a.slot
    m.release("r1")
    assert m.finish_unload("a")
    assert m.weights.A[0]["qkv"][a.slot].abs().sum() == 0  # the slot is cleared
    c = m.load("c", str(tmp_path / "c"))
    assert c.slot == a.slot


def test_lora_module_flag_forms() -> None:
    assert parse_lora_module("sql=/a/b") == ("sql", "/a/b")
    assert parse_lora_module(json.dumps({"name": "x", "path": "/p"})) == ("x", "/p")
    with pytest.raises(ValueError, match="NAME=PATH"):
        parse_lora_module("nopath")
    with pytest.raises(ValueError, match="max-loras"):
        LoRAConfig(
            enable_lora=True, max_loras=1, lora_modules=(("a", "/x"), ("b", "/y"))
        ).validate()


def test_serve_flags_build_the_lora_config() -> None:
    import argparse

    from kvserve.engine.args import (
        add_engine_arguments,
        build_engine_config,
        engine_kwargs_from_args,
    )

    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    args = parser.parse_args(
        [
            "--enable-lora",
            "--lora-modules",
            "a=/x",
            "b=/y",
            "--max-loras",
            "3",
            "--max-lora-rank",
            "32",
        ]
    )
    lora = build_engine_config(**engine_kwargs_from_args(args)).lora
    assert lora == LoRAConfig(True, 3, 32, (("a", "/x"), ("b", "/y")))
    with pytest.raises(ValueError, match="needs --enable-lora"):
        build_engine_config(enable_lora=False, lora_modules=["a=/x"])
    assert build_engine_config().lora is None


def test_slot_memory_is_what_the_docs_say() -> None:
    from kvserve.lora.adapter import module_shapes

    w = LoRAWeights(ARCH, 8, 16)
    sh = module_shapes(ARCH)
    per_slot_layer = 4 * 16 * sum(i + o for o, i in sh.values())
    assert w.nbytes() == 8 * ARCH.num_layers * per_slot_layer
