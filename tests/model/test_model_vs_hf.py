"""kvserve's model against HF transformers on the same weights and tokens.

The default model (SmolLM2-135M, converted once from its GGUF) and tiny random-weight
models of each supported architecture, built with transformers' own config classes in
a temporary folder (nothing downloaded).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from support.hf_reference import hf_greedy_batch
from support.tiny_models import save_hf_folder

from kvserve.model.attention import SeqSpec, build_attention_metadata
from kvserve.model.llama import LlamaForCausalLM
from kvserve.worker.model_runner import allocate_kv_cache

pytestmark = pytest.mark.usefixtures("single_thread_torch")

BLOCK = 16
TEXT = (
    "The history of the printing press begins in the fifteenth century, when Johannes "
    "Gutenberg combined movable metal type, oil-based ink and a wooden screw press. "
    "Within decades, printing spread across Europe, books became cheaper, and literacy "
    "rose. Scholars argue about how much the press changed religion, science and politics, "
    "but few doubt that it changed how ideas travelled. "
)


def run_prefill(
    model: LlamaForCausalLM,
    token_ids: list[int],
    kv_cache: torch.Tensor,
    block_ids: list[int],
    *,
    chunk: int | None = None,
    start: int = 0,
    kv_segment_size: int = 512,
) -> torch.Tensor:
    """Prefill tokens ``[start, len)`` chunk by chunk; logits of every computed row."""
    out = []
    chunk = chunk or len(token_ids)
    with torch.inference_mode():
        for s in range(start, len(token_ids), chunk):
            e = min(s + chunk, len(token_ids))
            n = e - s
            meta = build_attention_metadata(
                [SeqSpec(0, n, n, s, block_ids)],
                num_tokens=n,
                block_size=BLOCK,
                kv_segment_size=kv_segment_size,
            )
            ids = torch.tensor(token_ids[s:e])
            hidden = model(ids, torch.arange(s, e), list(kv_cache.unbind(0)), meta)
            out.append(model.compute_logits(hidden))
    return torch.cat(out)


def hf_logits(hf, token_ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return hf(torch.tensor([token_ids])).logits[0].float()


@pytest.fixture(scope="module")
def prompt_ids(loaded_model) -> list[int]:
    ids = loaded_model.tokenizer(TEXT * 12)["input_ids"]
    return ids[:600]


@pytest.fixture(scope="module")
def hf_prompt_logits(hf_model, prompt_ids) -> torch.Tensor:
    return hf_logits(hf_model, prompt_ids)


@pytest.mark.parametrize(
    ("chunk", "kv_segment_size"),
    [(None, 512), (64, 512), (64, 48), (256, 0), (256, 128)],
    ids=["whole", "chunk64-seg512", "chunk64-seg48", "chunk256-onepass", "chunk256-seg128"],
)
def test_prefill_logits_match_hf(
    loaded_model, prompt_ids, hf_prompt_logits, chunk: int | None, kv_segment_size: int
) -> None:
    model = loaded_model.model
    n = len(prompt_ids)
    kv = allocate_kv_cache(model, 2 + n // BLOCK, BLOCK, torch.float32)
    blocks = list(range(1, 2 + n // BLOCK))
    logits = run_prefill(
        model, prompt_ids, kv, blocks, chunk=chunk, kv_segment_size=kv_segment_size
    )
    assert logits.shape == hf_prompt_logits.shape
    assert (logits - hf_prompt_logits).abs().max().item() < 1e-3


def test_prefix_hit_logits_match_hf(loaded_model, hf_model, prompt_ids) -> None:
    """Request B reuses request A's first 16 blocks (256 tokens) and computes the rest."""
    model = loaded_model.model
    prefix = prompt_ids[:256]
    a = prefix + prompt_ids[300:360]
    b = prefix + loaded_model.tokenizer(" A different question: why?")["input_ids"] * 5
    kv = allocate_kv_cache(model, 64, BLOCK, torch.float32)
    blocks_a = list(range(1, 1 + -(-len(a) // BLOCK)))
    run_prefill(model, a, kv, blocks_a)
    snapshot = kv[:, :, :, 1:17].clone()
    blocks_b = blocks_a[:16] + list(range(40, 40 + -(-(len(b) - 256) // BLOCK)))
    logits = run_prefill(model, b, kv, blocks_b, start=256, chunk=40, kv_segment_size=96)
    ref = hf_logits(hf_model, b)[256:]
    assert logits.shape == ref.shape
    assert (logits - ref).abs().max().item() < 1e-3
    assert torch.equal(kv[:, :, :, 1:17], snapshot), "the prefix hit rewrote shared blocks"


# ---------------------------------------------------------------- greedy, real scheduler


@pytest.mark.slow
def test_greedy_continuations_match_hf_with_real_scheduler(loaded_model, hf_model) -> None:
    """Five prompts batched by the mixed scheduler; the long one (two KV segments)
    needs >= 3 chunks of the 256-token budget."""
    from kvserve.config import CacheConfig, SchedulerConfig
    from kvserve.kv_cache.manager import KVCacheManager
    from kvserve.request import Request, SamplingParams
    from kvserve.sched import make_scheduler
    from kvserve.worker.model_runner import ModelRunner

    tok = loaded_model.tokenizer
    chat = tok.apply_chat_template(
        [{"role": "user", "content": "Name three rivers in Africa."}],
        tokenize=False,
        add_generation_prompt=True,
    )
    texts = [
        chat,
        "def fibonacci(n):\n    ",
        "1, 2, 3, 5, 8, 13,",
        "Bonjour, je m'appelle",
        TEXT * 12 + "In summary, the printing press",
    ]
    prompts = [tok(t)["input_ids"] for t in texts]
    assert len(prompts[-1]) > 768  # past one 512-token KV segment, three chunks at least
    sched_cfg = SchedulerConfig(max_num_batched_tokens=256, max_num_seqs=8).resolved()
    cache_cfg = CacheConfig(block_size=BLOCK, num_kv_blocks=400, kv_segment_size=512)
    runner = ModelRunner(loaded_model, cache_cfg, sched_cfg)
    manager = KVCacheManager(
        runner.num_kv_blocks, BLOCK, sched_cfg.max_model_len, enable_caching=True
    )
    scheduler = make_scheduler(sched_cfg, manager)
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    for i, p in enumerate(prompts):
        scheduler.add_request(Request(f"r{i}", p, params, eos_token_id=tok.eos_token_id))
    outputs: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    long_chunks = 0
    for _ in range(500):
        if not scheduler.has_unfinished_requests():
            break
        so = scheduler.schedule()
        n_long = so.num_scheduled_tokens.get("r4", 0)
        if n_long > 1:
            long_chunks += 1
        result = runner.execute_model(so)
        for out in scheduler.update_from_output(so, result):
            outputs[out.req_id].extend(out.new_token_ids)
    assert long_chunks >= 3
    want = hf_greedy_batch(hf_model, prompts, 32)
    for i in range(len(prompts)):
        assert outputs[f"r{i}"] == want[i], f"prompt {i} diverged"


# ---------------------------------------------------------------- other architectures


def _tiny_config(arch: str):
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    common = dict(
        vocab_size=320,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
    )
    if arch == "llama3-untied":
        return LlamaConfig(
            **common,
            num_key_value_heads=2,
            tie_word_embeddings=False,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            },
        )
    if arch == "llama-bias-tied":
        return LlamaConfig(
            **common, num_key_value_heads=4, attention_bias=True, tie_word_embeddings=True
        )
    if arch == "mistral":
        return MistralConfig(**common, num_key_value_heads=1, sliding_window=None)
    if arch == "qwen2":
        return Qwen2Config(
            **common, num_key_value_heads=2, tie_word_embeddings=True, rope_theta=1e6
        )
    if arch == "qwen3":
        return Qwen3Config(**common, num_key_value_heads=2, head_dim=32, tie_word_embeddings=False)
    raise AssertionError(arch)


def make_tiny_model(arch: str, folder: Path, tokenizer_dir: Path):
    """Random-weight HF model saved as safetensors, with the default tokenizer files."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(_tiny_config(arch)).eval()
    with torch.no_grad():  # non-trivial norms and biases, so a skipped one shows
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            elif name.endswith("bias"):
                p.normal_(0, 0.5)
    save_hf_folder(hf, folder, tokenizer_dir)
    return hf


@pytest.mark.parametrize("arch", ["llama3-untied", "llama-bias-tied", "mistral", "qwen2", "qwen3"])
def test_tiny_architectures_match_hf(
    arch: str, tmp_path: Path, default_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvserve.model.loader import load_model

    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(tmp_path / "cache"))  # weights-digest memo

    folder = tmp_path / "model"
    folder.mkdir()
    hf = make_tiny_model(arch, folder, default_model_dir)
    loaded = load_model(str(folder), dtype="float32")
    model = loaded.model
    assert loaded.model_dir == folder.resolve()
    if model.kernels.norms is not None:  # every architecture (Qwen3's q/k norms too) runs native
        assert model.uses_native_layers
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 320, (70,), generator=gen).tolist()
    kv = allocate_kv_cache(model, 8, BLOCK, torch.float32)
    blocks = [3, 1, 6, 2, 7]  # scattered on purpose
    # 60 prompt tokens in chunks of 25 (partial segments of 16), then 10 decode steps
    got = [run_prefill(model, ids[:60], kv, blocks, chunk=25, kv_segment_size=16)]
    for pos in range(60, 70):
        meta = build_attention_metadata(
            [SeqSpec(0, 1, 1, pos, blocks)], num_tokens=1, block_size=BLOCK, kv_segment_size=16
        )
        with torch.inference_mode():
            h = model(torch.tensor([ids[pos]]), torch.tensor([pos]), list(kv.unbind(0)), meta)
            got.append(model.compute_logits(h))
    ref = hf_logits(hf, ids)
    assert (torch.cat(got) - ref).abs().max().item() < 1e-4
