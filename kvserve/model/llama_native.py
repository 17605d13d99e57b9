"""The Llama layers on kvserve's fused native kernels (the CPU path of
:meth:`~kvserve.model.llama.LlamaForCausalLM.forward`).

Two forms of one computation:

- :func:`forward_native`: the layer loop in Python, one native call per op (add+RMSNorm,
  qkv linear, RoPE + KV write, paged attention, o linear, add+RMSNorm, gate_up linear
  with SiLU*mul, down linear). Every step shape, KV format and weight format.
- :class:`FusedDecode`: the same loop as one call of ``kvs_decode_layers``
  (``csrc/decode_step.cpp``) for the steps it supports (:meth:`FusedDecode.supports`:
  decode rows only, a float KV cache, every linear a quantized weight on the native
  kernels (one part or several, GGUF K-quants and act-order weights included: an
  act-order linear's input is gathered as ``index_select`` does) or packed
  float panels in the model dtype at a row count where the layer loop runs those panels
  too). It runs the same kernels in the same order on the same arguments, so its
  output is bitwise that of :func:`forward_native` (tested); it saves the Python work
  between the calls (~270 ctypes calls a step for a 30-layer model). A step with
  adapter rows takes it too where :meth:`FusedDecode.supports_lora` holds: the LoRA
  delta runs inside the call after each linear (``kvs_lora_delta``, the kernel and
  arguments of :meth:`LoRAWeights.apply`), bitwise the loop's.
  ``KVSERVE_FUSED_DECODE=0`` turns it off (read when the model is prepared).
"""

from __future__ import annotations

import ctypes
import functools
import os
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

import torch

from kvserve.model.attention import AttentionMetadata, native_attention
from kvserve.model.kernels._ctypes import DTYPE_CODES, F32, I32, I64, PTR, CFunction
from kvserve.model.kernels.backend import KernelBackend
from kvserve.model.kernels.kv8 import is_kv8, kv8_paged_attention
from kvserve.model.linear import NATIVE_BF16_MAX_M, NATIVE_F32_MAX_M, FastLinear
from kvserve.model.llama_params import LayerOps, LlamaParams
from kvserve.model.quant.kernel import K_CODES
from kvserve.model.quant.linear import QuantLinear

if TYPE_CHECKING:
    from kvserve.lora.weights import LoRABatch, LoRAWeights

FUSED_DECODE_ENV_VAR = "KVSERVE_FUSED_DECODE"

# layer words' format codes besides the quantized ones (csrc/decode_step.cpp's kDenseFmt,
# kPartsFmt): packed float panels; a table of quantized parts
DENSE_FMT = -1
PARTS_FMT = -2

# one layer's words for kvs_decode_layers (csrc/decode_step.cpp's struct Layer)
LAYER_FIELDS = (
    "ln1", "qkv_w", "qkv_fmt", "qkv_b", "o_w", "o_fmt", "o_b",
    "ln2", "gu_w", "gu_fmt", "gu_b", "dn_w", "dn_fmt", "dn_b", "qk_norm", "kv",
)  # fmt: skip

_PARAMS = [
    ("layers", PTR),
    ("num_layers", I64),
    ("residual", PTR),
    ("rows", I64),
    ("hidden", I64),
    ("num_heads", I32),
    ("num_kv_heads", I32),
    ("head_dim", I32),
    ("inter", I64),
    ("eps", F32),
    ("positions", PTR),
    ("cos", PTR),
    ("sin", PTR),
    ("num_blocks", I64),
    ("block_size", I32),
    ("slots", PTR),
    ("seqs", PTR),
    ("num_seqs", I64),
    ("block_tables", PTR),
    ("max_blocks", I64),
    ("seg", I32),
    ("scale", F32),
    ("dtype", I32),
    ("y", PTR),
    ("qkv", PTR),
    ("attn", PTR),
    ("o", PTR),
    ("act", PTR),
    ("down", PTR),
    ("gu", PTR),
    ("xg", PTR),
    ("lora_table", PTR),
    ("nthreads", I32),
]
# the LoRA table's layout (csrc/decode_step.cpp's kLoraHeader, kLoraLayerWords)
LORA_HEADER = 10
LORA_LAYER_WORDS = 12


def forward_native(
    model: LlamaParams,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    kv_caches: list[torch.Tensor],
    meta: AttentionMetadata,
    kernels: KernelBackend,
    lora: LoRABatch | None = None,
    fused: FusedDecode | None = None,
) -> torch.Tensor:
    """The layers with fused native ops and an fp32 residual stream.

    Rules: ``meta.native`` is set (the native attention backend), ``kernels.norms`` and
    ``kernels.attention`` are bound. Returns the fp32 residual stream [T, hidden]
    (before the final norm). ``lora``: adapter rows (``model.lora_weights`` set).
    ``fused``: the model's one-call decode step, run for the steps it supports (with
    adapter rows: where it also :meth:`~FusedDecode.supports_lora` the weights).
    """
    assert meta.native is not None
    lw = model.lora_weights if lora is not None else None
    if (
        fused is not None
        and fused.supports(meta, kv_caches)
        and (lw is None or fused.supports_lora(lw))
    ):
        embedded = model.embed(input_ids).float()
        return fused(embedded, positions, kv_caches, meta, lw, lora if lw is not None else None)
    nk, attention = kernels.norms, kernels.attention
    assert nk is not None and attention is not None
    c = model.config
    h, hk, d = c.num_heads, c.num_kv_heads, c.head_dim
    num_tokens = input_ids.shape[0]
    eps = c.rms_norm_eps
    cos, sin = model._rope_tables(positions)
    seqs, tables, seg = meta.native.seqs, meta.native.block_tables, meta.kv_segment_size
    residual = model.embed(input_ids).float()  # [T, hidden] fp32
    pending: torch.Tensor | None = None  # the last sublayer's output, not yet added
    no_write: torch.Tensor | None = None  # all -1 slots (8-bit caches are written apart)
    for li, (ops, kv_cache) in enumerate(zip(model._ops, kv_caches, strict=True)):
        y = nk.add_rms_norm(residual, pending, ops.input_layernorm, eps)
        qkv = ops.qkv(y)  # [T, (H + 2Hk) * D]
        if lw is not None and lora is not None:
            lw.apply(li, "qkv", y, qkv, lora)
        if ops.qk_norm is not None:  # Qwen3: per-head RMSNorm of q and k, before RoPE
            nk.head_rms_norm(qkv, h + hk, d, ops.qk_norm, eps)
        if is_kv8(kv_cache):  # RoPE only, then the quantized write and 8-bit attention
            if no_write is None:
                no_write = torch.full((num_tokens,), -1, dtype=torch.int64)
            nk.rope_and_cache(qkv, h, hk, d, positions, cos, sin, kv_cache, no_write)
            qkv3 = qkv.view(num_tokens, h + 2 * hk, d)
            attn = kv8_paged_attention(
                qkv3[:, :h], qkv3[:, h : h + hk], qkv3[:, h + hk :], kv_cache, meta, model.scale
            )
        else:
            nk.rope_and_cache(qkv, h, hk, d, positions, cos, sin, kv_cache, meta.slot_mapping)
            q = qkv[:, : h * d].view(num_tokens, h, d)
            if meta.native.prefills or meta.native.cascade is not None:
                k = qkv[:, h * d : (h + hk) * d].view(num_tokens, hk, d)
                v = qkv[:, (h + hk) * d :].view(num_tokens, hk, d)
                attn = native_attention(q, k, v, kv_cache, meta, model.scale)
            else:
                attn = attention(q, kv_cache, seqs, tables, seg, model.scale)  # [T, H, D]
        attn2 = attn.view(num_tokens, h * d)
        o = ops.o(attn2)
        if lw is not None and lora is not None:
            lw.apply(li, "o", attn2, o, lora)
        y = nk.add_rms_norm(residual, o, ops.post_attention_layernorm, eps)
        gu = ops.gate_up
        if lw is None and isinstance(gu, QuantLinear) and gu.fused_silu_capable:
            act = gu.silu_mul(y)  # the same values in one native pass
        else:
            gate_up = gu(y)
            if lw is not None and lora is not None:
                lw.apply(li, "gate_up", y, gate_up, lora)
            act = nk.silu_mul(gate_up)
        pending = ops.down(act)
        if lw is not None and lora is not None:
            lw.apply(li, "down", act, pending, lora)
    if pending is not None:
        residual += pending
    return residual


@functools.cache
def _decode_fn(library: str) -> CFunction:
    return CFunction(ctypes.CDLL(library), "kvs_decode_layers", _PARAMS)


def fused_decode_enabled() -> bool:
    """``KVSERVE_FUSED_DECODE``: ``1`` (default) or ``0``; anything else a ValueError."""
    value = os.environ.get(FUSED_DECODE_ENV_VAR, "1")
    if value not in ("0", "1"):
        raise ValueError(f"invalid {FUSED_DECODE_ENV_VAR}={value!r}: use 1 (default) or 0")
    return value == "1"


# Multi-row chunks the fused step takes (speculative verifications): at most this many
# rows per chunk and in the whole step; longer chunks keep the layer loop, whose
# prefill kernels are faster for them (same arithmetic within the invariance reach).
FUSED_MAX_CHUNK = 16
FUSED_MAX_ROWS = 32


class FusedDecode:
    """All decoder layers of a decode-only step in one native call; see the module
    docstring. Made by :meth:`build` (None where the model's weights or kernels do not
    fit it). Rules: the model's weights and layer ops stay as they were when it was
    built (``prepare`` builds a new one)."""

    def __init__(
        self,
        model: LlamaParams,
        library: Path,
        layers: list[list[int]],
        dtype: torch.dtype,
        dense_rows: int | None = None,
        gu_scratch: bool = False,
        xg_scratch: bool = False,
        silu_tables: bool = False,
    ) -> None:
        c = model.config
        self._fn = _decode_fn(str(library))
        self._model = model
        self._layers = layers  # words without the kv pointer (set per cache list)
        self._table: torch.Tensor | None = None
        self._table_key: tuple[int, ...] = ()
        self.dtype = dtype
        self._dt = DTYPE_CODES[dtype]
        self._h, self._hk, self._d = c.num_heads, c.num_kv_heads, c.head_dim
        self._hidden, self._eps = c.hidden_size, c.rms_norm_eps
        self._inter = c.intermediate_size
        # dense panels: the most rows at which FastLinear runs them outside batch-invariant
        # mode (None: no dense linear); whether a gate_up runs its linear, then SiLU
        # (dense or in parts: the gu scratch)
        self._dense_rows = dense_rows
        self._gu_scratch = gu_scratch
        self._xg_scratch = xg_scratch  # an act-order linear: its inputs gathered there
        self._tables: list[torch.Tensor] = []  # parts tables the layer words point at
        self._silu_tables = silu_tables  # a gate_up table with the fused SiLU (no LoRA)
        # LoRA tables by (weights, their version, slots present, rows): the weights
        # (held, so their id stays theirs), the table and the row-slot buffers its
        # words point at, each with the slots it keeps (None: every slot present)
        self._lora: dict[
            tuple[int, int, frozenset[int], int],
            tuple[LoRAWeights, torch.Tensor, list[tuple[torch.Tensor, frozenset[int] | None]]],
        ] = {}

    @classmethod
    def build(cls, model: LlamaParams, kernels: KernelBackend) -> FusedDecode | None:
        """The fused step for ``model``'s layer ops, or None: the switch is off, the
        library lacks a family it needs, or a layer has a linear the C++ loop cannot
        call as the Python loop does (see
        :func:`_linear_words`: the portable reference, float weights
        without packed panels)."""
        if not fused_decode_enabled() or kernels.library is None:
            return None
        if kernels.norms is None or kernels.attention is None:
            return None
        dtype = model.embed_tokens.dtype
        if dtype not in DTYPE_CODES or not model._ops or K_CODES != 16:  # kKCodes in C++
            return None
        found = [_layer_words(ops, dtype) for ops in model._ops]
        if any(f is None for f in found):
            return None
        layers = [f for f in found if f is not None]
        limits = [f.rows for f in layers if f.rows is not None]
        try:
            fused = cls(
                model,
                kernels.library,
                [f.words for f in layers],
                dtype,
                min(limits) if limits else None,
                any(f.gu_scratch for f in layers),
                any(f.xg_scratch for f in layers),
                any(f.silu_table for f in layers),
            )
        except (OSError, AttributeError):  # an older library without the symbol
            return None
        fused._tables = [t for f in layers for t in f.keep]  # the words point into them
        return fused

    def supports(self, meta: AttentionMetadata, kv_caches: list[torch.Tensor]) -> bool:
        """Decode rows, and short chunks the paged kernel computes whole (a speculative
        verification's k + 1 rows within the invariance reach: the layer loop gives
        them the paged kernel's arithmetic too, :func:`attend_invariant`), at most
        ``FUSED_MAX_ROWS`` rows in all; no cascade split, no chunk for the prefill
        kernels; float KV caches in the model dtype, one per layer."""
        nb = meta.native
        if nb is None or nb.cascade is not None:
            return False
        if nb.prefills and not (
            meta.num_tokens <= FUSED_MAX_ROWS
            and all(p.whole and p.seq.num_rows <= FUSED_MAX_CHUNK for p in nb.prefills)
            and (nb.prefill_seqs is None or nb.prefill_seqs.shape[0] == 0)
        ):
            return False
        if len(kv_caches) != len(self._layers):
            return False
        if (
            self._dense_rows is not None
            and meta.num_tokens > self._dense_rows
            and not self._model.batch_invariant  # its linears run the panels at every M
        ):
            return False  # the loop's dense linears take another kernel at these rows
        kv = kv_caches[0]
        return kv.dtype == self.dtype and not is_kv8(kv)

    def supports_lora(self, lw: LoRAWeights) -> bool:
        """Whether a step with adapter rows of ``lw`` may run here: the native LoRA
        kernel is in use (not ``KVSERVE_LORA=portable``), ``lw`` has this model's
        layers, and no gate_up is a table with the fused SiLU (act-order weights)."""
        return (
            lw.native is not None
            and not self._silu_tables
            and lw.arch.num_layers == len(self._layers)
        )

    def _lora_table(self, lw: LoRAWeights, batch: LoRABatch, rows: int) -> torch.Tensor:
        """The LoRA words for one step (csrc/decode_step.cpp's layout): each layer's and
        linear's A and Bt, and row slots as :meth:`LoRAWeights.apply` masks them
        (:meth:`LoRAWeights.row_plan`), copied into buffers the cached table points at."""
        from kvserve.lora.weights import FUSED_PARTS, rows_of_slots

        if batch.row_slots.shape[0] != rows or batch.row_slots.dtype != torch.int32:
            raise ValueError("LoRA row slots must be int32, one per row of the step")
        present = frozenset(s for s, _ in batch.groups)
        key = (id(lw), lw.version, present, rows)
        found = self._lora.get(key)
        if found is None:
            if len(self._lora) >= 64:
                self._lora.clear()
            words = [lw.rank, DTYPE_CODES[lw.dtype]]
            for f, parts in FUSED_PARTS.items():
                words += [lw.offset_tensors[f].data_ptr(), len(parts)]
            buffers: dict[frozenset[int], torch.Tensor] = {}
            for li, plan in enumerate(lw.row_plan(present)):
                for f, hit in zip(FUSED_PARTS, plan, strict=True):
                    at = 0
                    if hit is not None:
                        if hit not in buffers:
                            buffers[hit] = torch.empty(rows, dtype=torch.int32)
                        at = buffers[hit].data_ptr()
                    words += [lw.A[li][f].data_ptr(), lw.Bt[li][f].data_ptr(), at]
            assert len(words) == LORA_HEADER + LORA_LAYER_WORDS * len(self._layers)
            table = torch.tensor(words, dtype=torch.int64)
            fills = [(b, None if hit == present else hit) for hit, b in buffers.items()]
            found = (lw, table, fills)
            self._lora[key] = found
        _, table, fills = found
        for buf, keep in fills:
            src = (
                batch.row_slots
                if keep is None
                else rows_of_slots(batch.row_slots, keep, lw.max_loras)
            )
            buf.copy_(src)
        return table

    def _kv_table(self, kv_caches: list[torch.Tensor]) -> torch.Tensor:
        key = tuple(kv.data_ptr() for kv in kv_caches)
        if self._table is None or key != self._table_key:
            for kv in kv_caches:
                if not kv.is_contiguous() or kv.dtype != self.dtype:
                    raise ValueError("fused decode needs contiguous KV caches in the model dtype")
            rows = [[*w, p] for w, p in zip(self._layers, key, strict=True)]
            self._table = torch.tensor(rows, dtype=torch.int64)
            self._table_key = key
        return self._table

    def __call__(
        self,
        residual: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
        lw: LoRAWeights | None = None,
        lora: LoRABatch | None = None,
    ) -> torch.Tensor:
        """residual [T, hidden] fp32 contiguous (the embedding; updated in place) ->
        the residual stream after every layer. ``lw`` and ``lora``: the adapter slots
        and each row's slot (both or neither). Rules: :meth:`supports` holds, and
        :meth:`supports_lora` for ``lw``."""
        nb = meta.native
        assert nb is not None
        kv_table = self._kv_table(kv_caches)
        rows = residual.shape[0]
        cos, sin = self._model._rope_tables(positions)
        h, hk, d, hid, dt = self._h, self._hk, self._d, self._hidden, self.dtype
        empty = torch.empty
        y, o, down = (
            empty(rows, hid, dtype=dt),
            empty(rows, hid, dtype=dt),
            empty(rows, hid, dtype=dt),
        )
        qkv = empty(rows, (h + 2 * hk) * d, dtype=dt)
        attn = empty(rows, h * d, dtype=dt)
        act = empty(rows, self._inter, dtype=dt)
        table = None if lw is None or lora is None else self._lora_table(lw, lora, rows)
        gu_needed = self._gu_scratch or table is not None  # with LoRA: linear, delta, SiLU
        gu = empty(rows, 2 * self._inter, dtype=dt) if gu_needed else None
        xg = empty(rows, max(hid, self._inter), dtype=dt) if self._xg_scratch else None
        kv0 = kv_caches[0]
        positions = positions.contiguous()
        slots, seqs, tables = meta.slot_mapping, nb.seqs, nb.block_tables
        rc = self._fn(
            layers=kv_table.data_ptr(), num_layers=kv_table.shape[0],
            residual=residual.data_ptr(),
            rows=rows, hidden=hid, num_heads=h, num_kv_heads=hk, head_dim=d,
            inter=self._inter, eps=self._eps, positions=positions.data_ptr(),
            cos=cos.data_ptr(), sin=sin.data_ptr(), num_blocks=kv0.shape[2],
            block_size=kv0.shape[3], slots=slots.data_ptr(), seqs=seqs.data_ptr(),
            num_seqs=seqs.shape[0], block_tables=tables.data_ptr(),
            max_blocks=tables.shape[1], seg=meta.kv_segment_size, scale=self._model.scale,
            dtype=self._dt, y=y.data_ptr(), qkv=qkv.data_ptr(), attn=attn.data_ptr(),
            o=o.data_ptr(), act=act.data_ptr(), down=down.data_ptr(),
            gu=None if gu is None else gu.data_ptr(), xg=None if xg is None else xg.data_ptr(),
            lora_table=None if table is None else table.data_ptr(),
            nthreads=torch.get_num_threads(),
        )  # fmt: skip
        if rc != 0:
            raise RuntimeError(f"kvs_decode_layers returned {rc}")
        return residual


class _LinearWords(NamedTuple):
    """How the fused step calls one linear: its three layer words (weight, format
    code, bias), the most rows at which the loop runs the same kernel (None: every row
    count), the tensors the words point at (a parts table, act-order permutations: kept
    alive with the step), whether it gathers its inputs (the xg scratch), and whether
    it is a table whose one call includes gate_up's SiLU."""

    words: list[int]
    rows: int | None
    keep: list[torch.Tensor]
    gathers: bool = False
    silu_table: bool = False


def _linear_words(lin: object, dtype: torch.dtype, gate_up: bool) -> _LinearWords | None:
    """The fused step's call of ``lin``, the same kernels on the same arguments as the
    layer loop's (:meth:`QuantLinear.eager`, :meth:`FastLinear.eager`, and for gate_up
    the fused SiLU or ``silu_mul`` after the linear); None where it has no such call."""
    if isinstance(lin, QuantLinear):
        if lin.kernel is None:
            return None  # the portable reference
        bias = lin.bias
        perms = [p.in_perm for p in lin.parts]
        silu = gate_up and lin.fused_silu_capable  # (one part)
        if len(lin.parts) == 1 and perms[0] is None and (not gate_up or silu):
            part = lin.parts[0]  # one call (K-quant codes run csrc/linear_kquant.cpp)
            bptr = 0 if bias is None else bias.data_ptr()
            return _LinearWords([part.data.data_ptr(), part.fmt.code, bptr], None, [])
        # parts into their columns, act-order inputs, or a gate_up without the fused
        # SiLU: a table (csrc/decode_step.cpp's kPartsFmt)
        keep = [p.to(torch.int64).contiguous() for p in perms if p is not None]
        perm_ptrs = iter(k.data_ptr() for k in keep)
        words = [len(lin.parts), int(silu)]
        for part, off, perm in zip(lin.parts, lin.offsets, perms, strict=True):
            at = 0 if bias is None else bias.data_ptr() + off * bias.element_size()
            words += [part.data.data_ptr(), part.fmt.code, part.n, at]
            words.append(0 if perm is None else next(perm_ptrs))
        table = torch.tensor(words, dtype=torch.int64)
        return _LinearWords(
            [table.data_ptr(), PARTS_FMT, 0], None, [table, *keep], bool(keep), silu
        )
    if isinstance(lin, FastLinear) and lin.panels is not None and lin.panels.dtype == dtype:
        # the bias eager() passes with these panels: fp32 [N] (float32), padded fp32 (bfloat16)
        fb = lin.bias if dtype == torch.float32 else lin.panel_bias
        if fb is not None and (fb.dtype != torch.float32 or not fb.is_contiguous()):
            return None
        rows_max = NATIVE_F32_MAX_M if dtype == torch.float32 else NATIVE_BF16_MAX_M
        bptr = 0 if fb is None else fb.data_ptr()
        return _LinearWords([lin.panels.data_ptr(), DENSE_FMT, bptr], rows_max, [])
    return None


class _LayerWords(NamedTuple):
    """One layer's words (LAYER_FIELDS without ``kv``), the most rows its dense linears
    allow (None: no limit), whether gate_up needs the ``gu`` scratch and a linear the
    ``xg`` one, the tensors the words point at (kept alive), and whether gate_up is a
    table with the fused SiLU."""

    words: list[int]
    rows: int | None
    gu_scratch: bool
    xg_scratch: bool
    keep: list[torch.Tensor]
    silu_table: bool = False


def _layer_words(ops: LayerOps, dtype: torch.dtype) -> _LayerWords | None:
    """How the fused step runs one layer, or None where a linear has no call that is
    the loop's (see :func:`_linear_words`) or a norm weight is not in ``dtype``."""
    found = [
        _linear_words(lin, dtype, gate_up=lin is ops.gate_up)
        for lin in (ops.qkv, ops.o, ops.gate_up, ops.down)
    ]
    for norm in (ops.input_layernorm, ops.post_attention_layernorm, ops.qk_norm):
        if norm is not None and (norm.dtype != dtype or not norm.is_contiguous()):
            return None
    qkv, o, gu, dn = found
    if qkv is None or o is None or gu is None or dn is None:
        return None
    limits = [f.rows for f in (qkv, o, gu, dn) if f.rows is not None]
    words = [
        ops.input_layernorm.data_ptr(), *qkv.words, *o.words,
        ops.post_attention_layernorm.data_ptr(), *gu.words, *dn.words,
        0 if ops.qk_norm is None else ops.qk_norm.data_ptr(),
    ]  # fmt: skip
    keep = [t for f in (qkv, o, gu, dn) for t in f.keep]
    # gate_up runs its linear, then SiLU (not a silu table: the fused call into act)
    gu_scratch = gu.words[1] == DENSE_FMT or (gu.words[1] == PARTS_FMT and not gu.silu_table)
    xg_scratch = any(f.gathers for f in (qkv, o, gu, dn))
    return _LayerWords(
        words, min(limits) if limits else None, gu_scratch, xg_scratch, keep, gu.silu_table
    )
