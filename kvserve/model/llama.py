"""Llama-family decoder (Llama 2/3, SmolLM, TinyLlama, Mistral, Qwen2, Qwen3).

Knows nothing about scheduling: it runs a flat batch of tokens ``[num_tokens]`` with
their positions and an :class:`~kvserve.model.attention.AttentionMetadata`, reading and
writing the paged KV cache tensors it is given. Variants it covers:

- QKV bias (Qwen2; Llama/Qwen3 ``attention_bias``, which also biases o_proj);
- per-head RMSNorm on q and k before RoPE (Qwen3);
- tied or untied embeddings; RoPE theta and static RoPE scaling (llama3, linear,
  yarn), computed by transformers' own init functions for the exact same frequencies.

For speed the layers are plain functions over fused weights (``qkv_proj`` =
[q; k; v], ``gate_up_proj`` = [gate; up]) with no per-layer ``nn.Module`` call.
Homes: :mod:`kvserve.model.llama_params` the parameters, prepared layer ops, embedding
and RoPE tables (what both forwards read); this module kernel preparation and the
portable forward; :mod:`kvserve.model.llama_native` the forward on the fused native
kernels (and the one-call decode step); :mod:`kvserve.model.llama_weights` the
checkpoint copying. The last two import only ``llama_params``, never this module.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable

import torch
import torch.nn.functional as F

from kvserve.lora.weights import LoRABatch
from kvserve.model.arch import ModelArchConfig  # noqa: F401  (re-exported)
from kvserve.model.attention import AttentionMetadata, paged_attention
from kvserve.model.kernels.backend import KernelBackend, default_backend
from kvserve.model.kernels.paged_attention import PagedAttention
from kvserve.model.linear import FastLinear, mkldnn_linear_works
from kvserve.model.llama_native import FusedDecode, forward_native
from kvserve.model.llama_params import LayerOps, Linear, LlamaParams
from kvserve.model.llama_weights import load_llama_weights
from kvserve.model.quant.formats import QuantWeight
from kvserve.model.quant.kernel import QuantKernel
from kvserve.model.quant.linear import QuantEmbedding, QuantLinear


class LlamaForCausalLM(LlamaParams):
    """Decoder over a flat token batch; see the module docstring. The parameters and
    their shapes are :class:`~kvserve.model.llama_params.LlamaParams`'."""

    def __init__(self, config: ModelArchConfig) -> None:
        super().__init__(config)
        self._native: KernelBackend | None = None  # set when the fused native layers run
        self._fused_decode: FusedDecode | None = None  # all layers of a decode step, one call
        self.kernels = KernelBackend.portable()  # the backend prepare() was given
        self._qkernel: QuantKernel | None = None

    # ------------------------------------------------------------------ weights

    def load_weights(
        self,
        tensors: Iterable[tuple[str, torch.Tensor | QuantWeight]],
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        fast_kernels: bool = True,
    ) -> None:
        """Copy HF-named tensors into the fused parameters, then :meth:`prepare`.

        A tensor may be a :class:`QuantWeight` (2-D weights only): it is kept quantized
        and runs as a :class:`QuantLinear` (fused q/k/v or gate/up parts of different
        formats stay separate row blocks; a fused weight mixing float and quantized parts
        is dequantized). Raises ValueError listing missing or unexpected tensors (e.g.
        an MoE layer), so a wrong checkpoint never runs silently. The copying rules are
        in :func:`kvserve.model.llama_weights.load_llama_weights`.
        """
        self._quant = load_llama_weights(self, tensors, dtype, device)
        self._rope_cache = None
        self._rope_f32 = None
        self.prepare(fast=fast_kernels)

    def prepare(self, fast: bool = True, kernels: KernelBackend | None = None) -> None:
        """Build the per-layer kernels from the parameters (call after changing weights).

        With ``fast`` on CPU each projection gets its kernels' copies (FastLinear): in
        float32 a [K, N] copy or native panels for decode-sized batches and a
        oneDNN-packed copy for larger ones, the parameter becoming a view of the [K, N]
        copy; in bfloat16 with native panels the panels alone, and the parameter (and a
        tied embedding) an empty [0, K] placeholder, so the weights are resident once
        (``embed`` reads a tied embedding's rows from the panels; preparing again
        restores the dense parameters from the panels first).
        ``kernels``: the native kernel families to use (default: :func:`default_backend`,
        from the switches in docs/kernels.md); kept as ``self.kernels`` for the runner to
        pass on (attention metadata, sampler). Without ``fast`` or off the CPU the
        layers use no native family (attention still follows the metadata).
        """
        old_ops: list[LayerOps] = getattr(self, "_ops", [])
        old_head = getattr(self, "_lm_head", None)
        self._restore_dense(old_ops, old_head)
        self._ops = []
        cpu = self.embed_tokens.device.type == "cpu"
        pack = fast and cpu and mkldnn_linear_works(self.embed_tokens.dtype)
        self.kernels = kernels if kernels is not None else default_backend()
        kernels = self.kernels if fast and cpu else KernelBackend.portable()
        native = kernels.linear
        qkernel: QuantKernel | None = kernels.quant_linear
        self._qkernel = qkernel
        for li, layer in enumerate(self.layers):
            lins: list[Linear] = []
            for name, bias in (
                ("qkv_proj", layer.qkv_bias),
                ("o_proj", layer.o_bias),
                ("gate_up_proj", layer.gate_up_bias),
                ("down_proj", layer.down_bias),
            ):
                param = getattr(layer, name)
                quant = self._quant.get(f"layers.{li}.{name}")
                if quant is not None:
                    lins.append(QuantLinear(quant, None if bias is None else bias.data, qkernel))
                    continue
                lin = FastLinear(
                    param.data,
                    None if bias is None else bias.data,
                    fast=fast,
                    pack=pack,
                    native=native,
                )
                if lin.wt is not None:
                    param.data = lin.wt.t()  # same values, no second [N, K] copy
                    lin.weight = param.data
                elif lin.weight is None:  # bfloat16 panels only: drop the dense copy
                    param.data = _placeholder(param.data)
                lins.append(lin)
            self._ops.append(
                LayerOps(
                    input_layernorm=layer.input_layernorm.data,
                    qkv=lins[0],
                    qk_norm=None if layer.qk_norm is None else layer.qk_norm.data,
                    o=lins[1],
                    post_attention_layernorm=layer.post_attention_layernorm.data,
                    gate_up=lins[2],
                    down=lins[3],
                )
            )
        emb = self._quant.get("embed_tokens")
        dt = self.embed_tokens.dtype
        self._embed_quant = None if emb is None else QuantEmbedding(emb, dt, qkernel)
        head = self._quant.get("embed_tokens" if self.lm_head is None else "lm_head")
        if head is not None:
            self._lm_head = QuantLinear(head, None, qkernel)
        else:
            self._lm_head = FastLinear(
                self.lm_head_weight.data, None, fast=fast, pack=pack, native=native
            )
            if self._lm_head.weight is None:  # panels only; a tied embedding reads them
                self.lm_head_weight.data = _placeholder(self.lm_head_weight.data)
        usable = (
            kernels.attention is not None
            and kernels.norms is not None
            and PagedAttention.supports(self.embed_tokens.dtype)
        )
        self._native = kernels if usable else None
        self._fused_decode = None if self._native is None else FusedDecode.build(self, kernels)
        self.batch_invariant = False
        self.set_batch_invariant(self.batch_invariant_default)

    def _restore_dense(self, old_ops: list[LayerOps], old_head: Linear | None) -> None:
        """Give the parameters that an earlier :meth:`prepare` emptied (bfloat16 panels
        only) their dense values back from those panels, so preparing again (other
        kernels, fast off) starts from the weights."""
        for layer, ops in zip(self.layers, old_ops, strict=False):
            for name, lin in (
                ("qkv_proj", ops.qkv),
                ("o_proj", ops.o),
                ("gate_up_proj", ops.gate_up),
                ("down_proj", ops.down),
            ):
                param = getattr(layer, name)
                if param.numel() == 0 and isinstance(lin, FastLinear):
                    param.data = lin.dense()
        head = self.lm_head_weight
        if head.numel() == 0 and isinstance(old_head, FastLinear):
            head.data = old_head.dense()

    def _linears(self) -> list[Linear]:
        lins = [lin for ops in self._ops for lin in (ops.qkv, ops.o, ops.gate_up, ops.down)]
        return lins + ([self._lm_head] if self._lm_head is not None else [])

    @property
    def batch_invariant_supported(self) -> bool:
        """Whether batch-invariant mode can run: the fused native layers (fp32 residual,
        per-row norms) and native panels for every linear (docs/determinism.md)."""
        return self.uses_native_layers and all(lin.invariant_capable for lin in self._linears())

    @property
    def batch_invariant_default(self) -> bool:
        """Off: the full mode (every length) is opt-in (``--batch-invariant``). Its
        linears cost about nothing off AMX, but it runs long prefill chunks whole in the
        paged kernel instead of the vector/AMX prefill kernels, which measured (AMD Zen
        5, bf16, ``kvserve bench forward --clock cpu --threads 1``, 2026-12-01) 0.88x the
        tok/s of a 2,048-token prefill and 0.83x of 512 new tokens over a 2,048-token
        prefix. The automatic default covers requests up to 512 tokens instead
        (``auto_invariance_cheap``); docs/determinism.md has the table."""
        return False

    @property
    def auto_invariance_cheap(self) -> bool:
        """Whether the automatic mode (invariance for requests up to
        ``AUTO_INVARIANT_MAX_CONTEXT`` tokens, docs/determinism.md) may run: supported,
        and every linear's invariant routing costs nothing measurable. Quantized
        linears always run one reduction order; bfloat16 panels at every M matched
        oneDNN's time from 16 to 512 rows off AMX (AMX tiles: not measured, so off);
        float32 panels at every M: not measured cheap, so off."""
        if not self.batch_invariant_supported:
            return False
        for lin in self._linears():
            if isinstance(lin, QuantLinear):
                continue
            panels = getattr(lin, "panels", None)
            if panels is None or panels.dtype != torch.bfloat16 or getattr(lin, "amx", True):
                return False
        return True

    def set_batch_invariant(self, on: bool) -> None:
        """Route every linear through the native panels at any row count (``on``) or
        through the fastest kernel per row count. The attention side of the mode is in
        the step's metadata (``build_attention_metadata(batch_invariant=...)``), which
        the caller must set to match. Raises ValueError when ``on`` is unsupported."""
        if on and not self.batch_invariant_supported:
            raise ValueError(
                "batch_invariant=True needs kvserve's native kernels for this model and dtype "
                "(AVX-512F for float32, AVX512-BF16 for bfloat16, a C++ compiler): use "
                "batch_invariant=False"
            )
        for lin in self._linears():
            lin.invariant = on
        self.batch_invariant = on

    def weight_formats(self) -> str:
        """``"float"``, or the quantized formats run, e.g. ``"q4_1+q8_0"``."""
        names = sorted({q.fmt.name for parts in self._quant.values() for q in parts})
        return "+".join(names) if names else "float"

    def streamed_weight_bytes(self) -> int:
        """Bytes a decode step reads from the weights (after :meth:`prepare`): each
        linear's one copy (quantized panels, or the float weight) and the lm_head."""
        total = 0
        lins = [x for o in self._ops for x in (o.qkv, o.o, o.gate_up, o.down)]
        for lin in [*lins, self._lm_head]:
            if lin is None:
                continue
            if isinstance(lin, QuantLinear):
                total += int(lin.nbytes)
            else:
                w = lin.panels if lin.panels is not None else lin.dense()
                total += w.numel() * w.element_size()
        return total

    def weight_bytes(self) -> int:
        """Bytes of every weight copy the model holds: parameters, quantized panels and
        the kernels' packed copies (the resident weight memory)."""
        seen: set[int] = set()
        total = 0

        def add(t: torch.Tensor | None) -> None:
            nonlocal total
            if t is None:
                return
            key = t.untyped_storage().data_ptr()
            if key in seen or t.device.type == "meta":
                return
            seen.add(key)
            total += t.untyped_storage().nbytes()

        for p in self.parameters():
            add(p.data)
        for parts in self._quant.values():
            for q in parts:
                add(q.data)
        lins: list[Linear] = [x for o in self._ops for x in (o.qkv, o.o, o.gate_up, o.down)]
        if self._lm_head is not None:
            lins.append(self._lm_head)
        for lin in lins:
            if isinstance(lin, FastLinear):
                for t in (lin.wt, lin.packed, lin.panels, lin.weight):
                    with contextlib.suppress(RuntimeError, NotImplementedError):
                        add(t)
        return total

    @property
    def uses_native_layers(self) -> bool:
        """Whether forward runs the fused native layer ops (when attention is native too)."""
        return self._native is not None

    # ------------------------------------------------------------------ forward

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        attn_meta: AttentionMetadata,
        lora: LoRABatch | None = None,
    ) -> torch.Tensor:
        """input_ids, positions: [T] int64 -> hidden states [T, hidden] (before final norm).

        ``kv_caches[i]`` is layer ``i``'s cache (layout in ``kvserve.model.attention``).
        ``lora``: the adapter slot of each row (``self.lora_weights`` must be set); each
        targeted linear's output gets its rows' low-rank delta (kvserve.lora.weights).
        None: the base model only, exactly the path without LoRA.
        """
        lw = self.lora_weights if lora is not None else None
        if (
            self._native is not None
            and attn_meta.native is not None
            and not torch.compiler.is_compiling()
        ):
            return forward_native(
                self,
                input_ids,
                positions,
                kv_caches,
                attn_meta,
                self._native,
                lora,
                self._fused_decode,
            )
        c = self.config
        h, hk, d = c.num_heads, c.num_kv_heads, c.head_dim
        num_tokens = input_ids.shape[0]
        eps = c.rms_norm_eps
        hidden = (c.hidden_size,)
        q_size, qk_size = h * d, (h + hk) * d
        half = d // 2
        cos, sin = self.rope_cos_sin(positions)  # [T, 1, D]

        x = self.embed(input_ids)  # [T, hidden]
        for li, (ops, kv_cache) in enumerate(zip(self._ops, kv_caches, strict=True)):
            y = F.rms_norm(x, hidden, ops.input_layernorm, eps)
            qkv = ops.qkv(y)  # [T, (H + 2Hk) * D]
            if lw is not None and lora is not None:
                lw.apply(li, "qkv", y, qkv, lora)
            qk = qkv[:, :qk_size].view(num_tokens, h + hk, d)
            if ops.qk_norm is not None:
                qk = F.rms_norm(qk, (d,), None, eps) * ops.qk_norm
            qk = torch.addcmul(qk * cos, qk.roll(half, -1), sin)  # RoPE, [T, H + Hk, D]
            v = qkv[:, qk_size:].view(num_tokens, hk, d)
            attn = paged_attention(qk[:, :h], qk[:, h:], v, kv_cache, attn_meta, self.scale)
            attn2 = attn.reshape(num_tokens, q_size)
            o = ops.o(attn2)
            if lw is not None and lora is not None:
                lw.apply(li, "o", attn2, o, lora)
            x = x + o
            y = F.rms_norm(x, hidden, ops.post_attention_layernorm, eps)
            gate_up = ops.gate_up(y)  # [T, 2I]
            if lw is not None and lora is not None:
                lw.apply(li, "gate_up", y, gate_up, lora)
            gate, up = gate_up.chunk(2, dim=-1)
            act = F.silu(gate) * up
            down = ops.down(act)
            if lw is not None and lora is not None:
                lw.apply(li, "down", act, down, lora)
            x = x + down
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden] (rows to sample from) -> fp32 logits [N, vocab].

        ``hidden`` may be the fp32 residual stream of the native path: the final norm
        runs in fp32 and its output goes to the lm_head in the model dtype.
        """
        if hidden.dtype != self.norm.dtype:
            y = F.rms_norm(
                hidden.float(),
                (self.config.hidden_size,),
                self.norm.float(),
                self.config.rms_norm_eps,
            ).to(self.norm.dtype)
        else:
            y = F.rms_norm(hidden, (self.config.hidden_size,), self.norm, self.config.rms_norm_eps)
        assert self._lm_head is not None, "load_weights() or prepare() first"
        return self._lm_head(y).float()


def _placeholder(weight: torch.Tensor) -> torch.Tensor:
    """An empty [0, K] stand-in (same dtype and device) for a weight whose only resident
    copy is a FastLinear's panels."""
    return weight.new_empty(0, weight.shape[1])
