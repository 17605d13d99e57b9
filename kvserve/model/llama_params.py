"""The Llama-family parameters and the prepared state both forwards read.

:class:`LlamaParams` holds what :class:`~kvserve.model.llama.LlamaForCausalLM` (the
portable forward, kernel preparation) and :mod:`kvserve.model.llama_native` (the fused
native forward) share, and what :mod:`kvserve.model.llama_weights` fills from a
checkpoint: the fused parameters (``qkv_proj`` = [q; k; v], ``gate_up_proj`` =
[gate; up]), the per-layer ops :meth:`LlamaForCausalLM.prepare` builds
(:class:`LayerOps`), the quantized weights, the embedding and the RoPE tables. It
imports neither forward, so both stand on it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.lora.weights import LoRAWeights
from kvserve.model.arch import ModelArchConfig
from kvserve.model.linear import FastLinear
from kvserve.model.quant.formats import QuantWeight
from kvserve.model.quant.linear import QuantEmbedding, QuantLinear

Linear = FastLinear | QuantLinear


@dataclass
class LayerOps:
    """One layer's prepared kernels and norm weights (built by ``prepare``)."""

    input_layernorm: torch.Tensor
    qkv: Linear
    qk_norm: torch.Tensor | None
    o: Linear
    post_attention_layernorm: torch.Tensor
    gate_up: Linear
    down: Linear


class LlamaDecoderLayer(nn.Module):
    """One layer's parameters (fused); the computation is in ``LlamaForCausalLM.forward``."""

    def __init__(self, c: ModelArchConfig) -> None:
        super().__init__()
        h, hk, d, hid, inter = (
            c.num_heads,
            c.num_kv_heads,
            c.head_dim,
            c.hidden_size,
            c.intermediate_size,
        )
        self.input_layernorm = nn.Parameter(torch.empty(hid))
        self.qkv_proj = nn.Parameter(torch.empty((h + 2 * hk) * d, hid))
        self.qkv_bias = nn.Parameter(torch.empty((h + 2 * hk) * d)) if c.qkv_bias else None
        self.o_proj = nn.Parameter(torch.empty(hid, h * d))
        self.o_bias = nn.Parameter(torch.empty(hid)) if c.o_bias else None
        self.qk_norm = nn.Parameter(torch.empty(h + hk, d)) if c.qk_norm else None
        self.post_attention_layernorm = nn.Parameter(torch.empty(hid))
        self.gate_up_proj = nn.Parameter(torch.empty(2 * inter, hid))
        self.gate_up_bias = nn.Parameter(torch.empty(2 * inter)) if c.mlp_bias else None
        self.down_proj = nn.Parameter(torch.empty(hid, inter))
        self.down_bias = nn.Parameter(torch.empty(hid)) if c.mlp_bias else None


class LlamaParams(nn.Module):
    """The parameters and prepared state of a Llama-family decoder (no forward).

    Parameters per layer (:class:`LlamaDecoderLayer`):
    ``qkv_proj`` [(H + 2 Hk) * D, hidden], ``o_proj`` [hidden, H * D],
    ``gate_up_proj`` [2 * I, hidden], ``down_proj`` [hidden, I], norms [hidden],
    optional ``qkv_bias``/``o_bias``, ``qk_norm`` [H + Hk, D] (Qwen3).
    """

    def __init__(self, config: ModelArchConfig) -> None:
        super().__init__()
        self.config = c = config
        d, hid = c.head_dim, c.hidden_size
        self.embed_tokens = nn.Parameter(torch.empty(c.vocab_size, hid))
        self.lm_head = (
            None if c.tie_word_embeddings else nn.Parameter(torch.empty(c.vocab_size, hid))
        )
        self.norm = nn.Parameter(torch.empty(hid))
        self.layers: list[LlamaDecoderLayer] = nn.ModuleList(  # type: ignore[assignment]
            LlamaDecoderLayer(c) for _ in range(c.num_layers)
        )
        self.scale = d**-0.5
        self._rope_cache: tuple[torch.Tensor, torch.Tensor] | None = None
        self._rope_f32: tuple[torch.Tensor, torch.Tensor] | None = None  # [n, D/2] cos, sin
        self._ops: list[LayerOps] = []
        self._embed_quant: QuantEmbedding | None = None
        self._lm_head: Linear | None = None
        # quantized weights by parameter name ("embed_tokens", "lm_head", "layers.3.qkv_proj"):
        # their nn.Parameter is then an empty placeholder of the model dtype
        self._quant: dict[str, list[QuantWeight]] = {}
        self.batch_invariant = False  # see LlamaForCausalLM.set_batch_invariant
        # LoRA slot tensors (kvserve.lora.weights); forward applies them to the rows a
        # LoRABatch names
        self.lora_weights: LoRAWeights | None = None

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.embed_tokens if self.lm_head is None else self.lm_head

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings [T, hidden] in the model dtype (dequantized rows when the
        embedding is quantized, rows of the lm_head's panels when a tied bfloat16
        embedding is resident only there)."""
        if self._embed_quant is not None:
            return self._embed_quant(input_ids)
        if self.embed_tokens.numel() == 0:  # tied, resident only as the lm_head's panels
            head = self._lm_head
            assert isinstance(head, FastLinear)
            return head.rows(input_ids.reshape(-1)).reshape(*input_ids.shape, -1)
        return F.embedding(input_ids, self.embed_tokens)

    # ------------------------------------------------------------------ rope

    def prepare_rope(self, max_len: int) -> None:
        """Build the RoPE table for positions ``[0, max_len)`` now (compiled graphs need it)."""
        self.rope_cos_sin(torch.tensor([max(max_len, 1) - 1]))

    def rope_cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin for ``positions`` [T] -> two [T, 1, D] tensors.

        ``sin_signed = [-sin, sin]`` so that RoPE is ``x * cos + roll(x, D/2) * sin_signed``
        (identical to HF's ``x * cos + rotate_half(x) * sin``).
        """
        cache = self._rope_cache
        if torch.compiler.is_compiling():  # no data-dependent size inside a graph
            assert cache is not None, "call prepare_rope(max_len) before compiling"
            return cache[0][positions].unsqueeze(1), cache[1][positions].unsqueeze(1)
        max_pos = int(positions.max()) + 1 if positions.numel() else 1
        if cache is None or cache[0].shape[0] < max_pos:
            n = max(max_pos, min(self.config.max_position_embeddings, 1 << 16))
            inv_freq = torch.tensor(self.config.rope_inv_freq, dtype=torch.float32)
            freqs = torch.outer(torch.arange(n, dtype=torch.float32), inv_freq)  # [n, D/2]
            scaling = self.config.rope_attention_scaling
            cos = torch.cat([freqs.cos(), freqs.cos()], -1) * scaling
            sin = torch.cat([-freqs.sin(), freqs.sin()], -1) * scaling
            dev, dt = self.embed_tokens.device, self.embed_tokens.dtype
            cache = (cos.to(dev, dt), sin.to(dev, dt))
            self._rope_cache = cache
        return cache[0][positions].unsqueeze(1), cache[1][positions].unsqueeze(1)

    def _rope_tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 cos and sin [n, D/2] (attention scaling included) covering ``positions``."""
        max_pos = int(positions.max()) + 1 if positions.numel() else 1
        tables = self._rope_f32
        if tables is None or tables[0].shape[0] < max_pos:
            n = max(max_pos, min(self.config.max_position_embeddings, 1 << 16))
            inv_freq = torch.tensor(self.config.rope_inv_freq, dtype=torch.float32)
            freqs = torch.outer(torch.arange(n, dtype=torch.float32), inv_freq)  # [n, D/2]
            scaling = self.config.rope_attention_scaling
            tables = ((freqs.cos() * scaling).contiguous(), (freqs.sin() * scaling).contiguous())
            self._rope_f32 = tables
        return tables
