"""Slot-stacked LoRA weights and the batched low-rank delta.

Every resident adapter owns one slot ``s`` in ``[0, max_loras)``. Per layer and per
fused base linear ``f`` (``qkv`` = [q; k; v], ``o``, ``gate_up`` = [gate; up],
``down``) with ``P`` parts (q/k/v: 3, gate/up: 2, else 1) and the padded rank ``R``::

    A[f]  [S, P*R, in]       rows p*R .. p*R+r-1: part p's lora_A (zero padding)
    Bt[f] [S, R, out_total]  columns off[p] .. off[p+1]-1: part p's (scale * lora_B)^T

(float32, or bfloat16 for a bfloat16 model).

After the base linear ``y = f(x)`` [T, out_total], a step applies, for each row ``t``
whose slot ``s = row_slot[t] >= 0``::

    xa = A[f][s] @ x[t]                                   # [P*R]
    y[t, off[p]:off[p+1]] += xa[p*R:(p+1)*R] @ Bt[f][s][:, off[p]:off[p+1]]

Rows of slot -1 (the base model, padding, dummies) are left untouched, so a batch
with no adapter row runs exactly the base path. Zero padding adds exact zeros, so an
adapter whose B is zero leaves ``y`` bitwise unchanged. Two implementations: the
native kernel (``kvs_lora_delta``, AVX-512 and portable C++; kvserve/model/csrc/lora.cpp)
and a torch reference grouped by slot (``index_select`` of each slot's rows).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kvserve.lora.adapter import LoRAAdapter, module_shapes
from kvserve.model.arch import ModelArchConfig

if TYPE_CHECKING:
    from kvserve.lora.ops import NativeLoRA

FUSED_PARTS: dict[str, tuple[str, ...]] = {
    "qkv": ("q_proj", "k_proj", "v_proj"),
    "o": ("o_proj",),
    "gate_up": ("gate_proj", "up_proj"),
    "down": ("down_proj",),
}


@dataclass
class LoRABatch:
    """Which slot each row of one step uses. ``row_slots`` [T] int32 (-1: none);
    ``groups``: (slot, rows) for each slot present, rows a slice when contiguous else
    an int64 index tensor. Build with :meth:`from_row_slots`; None stands for "no
    adapter row", and callers then run the base path unchanged."""

    row_slots: torch.Tensor
    groups: list[tuple[int, slice | torch.Tensor]]

    @classmethod
    def from_row_slots(
        cls, row_slots: list[int], device: torch.device | str = "cpu"
    ) -> LoRABatch | None:
        """None when every row is -1. ``device``: the model's (index tensors live there)."""
        rows_of: dict[int, list[int]] = {}
        for t, s in enumerate(row_slots):
            if s >= 0:
                rows_of.setdefault(s, []).append(t)
        if not rows_of:
            return None
        groups: list[tuple[int, slice | torch.Tensor]] = []
        for s, rows in rows_of.items():
            if rows[-1] - rows[0] + 1 == len(rows):
                groups.append((s, slice(rows[0], rows[-1] + 1)))
            else:
                groups.append((s, torch.tensor(rows, dtype=torch.int64, device=device)))
        return cls(torch.tensor(row_slots, dtype=torch.int32, device=device), groups)


class LoRAWeights:
    """The slot tensors of every layer (``dtype``: float32, or bfloat16 for a bfloat16
    model, as vLLM keeps them; zero when a slot is free).

    Caller rules: write a slot (:meth:`set_slot`) only while no running request uses
    it, and clear it (:meth:`clear_slot`) only after its requests finished; the step
    thread reads slots without a lock.
    """

    def __init__(
        self,
        arch: ModelArchConfig,
        max_loras: int,
        max_rank: int,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
    ) -> None:
        if dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"LoRA slot tensors are float32 or bfloat16, not {dtype}")
        self.arch = arch
        self.max_loras = max_loras
        self.rank = max_rank
        self.dtype = dtype
        shapes = module_shapes(arch)
        self.offsets: dict[str, list[int]] = {}
        self.in_features: dict[str, int] = {}
        for f, parts in FUSED_PARTS.items():
            offs = [0]
            for p in parts:
                offs.append(offs[-1] + shapes[p][0])
            self.offsets[f] = offs
            self.in_features[f] = shapes[parts[0]][1]
        self.offset_tensors = {
            f: torch.tensor(o, dtype=torch.int64) for f, o in self.offsets.items()
        }
        s, r = max_loras, max_rank
        self.A: list[dict[str, torch.Tensor]] = []
        self.Bt: list[dict[str, torch.Tensor]] = []
        for _ in range(arch.num_layers):
            self.A.append(
                {
                    f: torch.zeros(s, len(p) * r, self.in_features[f], dtype=dtype)
                    for f, p in FUSED_PARTS.items()
                }
            )
            self.Bt.append(
                {f: torch.zeros(s, r, self.offsets[f][-1], dtype=dtype) for f in FUSED_PARTS}
            )
        # which fused linears any resident adapter targets, per layer (skip the rest)
        self._targets: list[list[set[str]]] = [
            [set() for _ in range(max_loras)] for _ in range(arch.num_layers)
        ]
        # row_plan's answers by the set of slots present (cleared on every slot write,
        # which also bumps version)
        self._plans: dict[frozenset[int], list[list[frozenset[int] | None]]] = {}
        self.version = 0
        self.native: NativeLoRA | None = None  # the native kernel (kvserve.lora.ops)

    def nbytes(self) -> int:
        """Bytes the slot tensors hold."""
        return sum(t.numel() * t.element_size() for d in (*self.A, *self.Bt) for t in d.values())

    def set_slot(self, slot: int, adapter: LoRAAdapter) -> None:
        """Write ``adapter`` into ``slot`` (the rest of the slot becomes zero)."""
        self.clear_slot(slot)
        r = self.rank
        for (layer, module), (a, b) in adapter.weights.items():
            for f, parts in FUSED_PARTS.items():
                if module not in parts:
                    continue
                p = parts.index(module)
                rank = a.shape[0]
                self.A[layer][f][slot, p * r : p * r + rank] = a
                lo, hi = self.offsets[f][p], self.offsets[f][p + 1]
                self.Bt[layer][f][slot, :rank, lo:hi] = (b * adapter.scale).t()
                if bool(b.any()):  # an all-zero B adds nothing: skip it (bitwise the base)
                    self._targets[layer][slot].add(f)
        self._plans.clear()
        self.version += 1

    def clear_slot(self, slot: int) -> None:
        """Zero ``slot`` in every layer."""
        for layer in range(self.arch.num_layers):
            for f in FUSED_PARTS:
                self.A[layer][f][slot].zero_()
                self.Bt[layer][f][slot].zero_()
            self._targets[layer][slot].clear()
        self._plans.clear()
        self.version += 1

    def row_plan(self, present: frozenset[int]) -> list[list[frozenset[int] | None]]:
        """Per layer, per fused linear (``FUSED_PARTS`` order): the slots of ``present``
        that target it, or None where none does (no delta). What :meth:`apply` decides
        per call, for the fused decode step; cached until a slot changes."""
        plan = self._plans.get(present)
        if plan is None:
            plan = []
            for targets in self._targets:
                row: list[frozenset[int] | None] = []
                for f in FUSED_PARTS:
                    hit = frozenset(s for s in present if f in targets[s])
                    row.append(hit if hit else None)
                plan.append(row)
            self._plans[present] = plan
        return plan

    def apply(self, layer: int, f: str, x: torch.Tensor, y: torch.Tensor, batch: LoRABatch) -> None:
        """Add the delta of every adapter row to ``y`` [T, out] in place; ``x`` [T, in]
        is the linear's input (any float dtype; the sums run in float32)."""
        targets = self._targets[layer]
        if not any(f in targets[s] for s, _ in batch.groups):
            return
        native = self.native
        if native is not None and native.supports(x, y):
            rows = batch.row_slots
            if any(f not in targets[s] for s, _ in batch.groups):
                # a slot present does not target f: its rows count as base rows here
                keep = frozenset(s for s, t in enumerate(targets) if f in t)
                rows = rows_of_slots(rows, keep, self.max_loras)
            native.delta(
                x, y, self.A[layer][f], self.Bt[layer][f], rows, self.offset_tensors[f], self.rank
            )
            return
        lora_delta_torch(
            x, y, self.A[layer][f], self.Bt[layer][f], batch, self.offsets[f], self.rank, targets, f
        )


def rows_of_slots(row_slots: torch.Tensor, keep: frozenset[int], max_loras: int) -> torch.Tensor:
    """``row_slots`` [T] int32 with every slot not in ``keep`` set to -1 (those rows
    count as base rows for one linear), int32."""
    # index -1 (the base rows) reads the extra False at the end
    mask = torch.tensor([s in keep for s in range(max_loras)] + [False], device=row_slots.device)
    return torch.where(mask[row_slots.long()], row_slots, -1).to(torch.int32)


def lora_delta_torch(
    x: torch.Tensor,
    y: torch.Tensor,
    a: torch.Tensor,
    bt: torch.Tensor,
    batch: LoRABatch,
    offsets: list[int],
    rank: int,
    targets: list[set[str]] | None = None,
    f: str = "",
) -> None:
    """The reference: per slot, gather its rows, ``xa = x_s @ A_s^T`` then each part's
    ``xa_p @ Bt_s[:, part]``, added back into ``y`` (float32 sums)."""
    for slot, rows in batch.groups:
        if targets is not None and f not in targets[slot]:
            continue
        xs = x[rows] if isinstance(rows, slice) else x.index_select(0, rows)
        xa = xs.float() @ a[slot].float().t()  # [n, P*R]
        for p in range(len(offsets) - 1):
            lo, hi = offsets[p], offsets[p + 1]
            d = xa[:, p * rank : (p + 1) * rank] @ bt[slot, :, lo:hi].float()  # [n, out_p]
            if isinstance(rows, slice):
                y[rows, lo:hi] += d.to(y.dtype)
            else:
                y[:, lo:hi].index_add_(0, rows, d.to(y.dtype))
