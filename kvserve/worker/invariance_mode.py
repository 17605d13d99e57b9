"""The runner's batch-invariance mode (docs/determinism.md): what ``batch_invariant``
(``True`` / ``False`` / ``None`` for automatic) resolves to for one model, attention
backend and ``compile`` setting. :class:`~kvserve.worker.model_runner.ModelRunner`
calls both once, when it is built; neither touches the model.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvserve.model.attention_metadata import AUTO_INVARIANT_MAX_CONTEXT

if TYPE_CHECKING:
    from kvserve.model.llama import LlamaForCausalLM


def resolve_batch_invariant(
    requested: bool | None, model: LlamaForCausalLM, backend: str, compile: bool
) -> bool:
    """Whether a runner runs in batch-invariant mode (docs/determinism.md).

    ``None`` (the default): on where it is supported and cheap
    (``model.batch_invariant_default``, the native attention backend) and ``compile`` is
    off (compiled decode graphs use other elementwise kernels than eager prefill).
    ``True``: on, or ValueError saying why it cannot be; ``False``: off.
    """
    if requested is not None and not isinstance(requested, bool):
        raise ValueError(
            f"invalid batch_invariant={requested!r}: must be True, False or None (automatic) "
            "(for example: batch_invariant=True)"
        )
    supported = model.batch_invariant_supported and backend == "native"
    if requested is None:
        return supported and model.batch_invariant_default and not compile
    if requested and compile:
        raise ValueError(
            "invalid batch_invariant=True with compile=True: compiled decode steps use other "
            "kernels than eager prefill steps, so a row's logits would depend on how it was "
            "scheduled (for example: batch_invariant=True, compile=False)"
        )
    if requested and not supported:
        raise ValueError(
            "invalid batch_invariant=True: it needs kvserve's native kernels for this model "
            "and dtype (a C++ compiler; AVX-512F for float32, AVX512-BF16 for bfloat16) "
            "(for example: batch_invariant=False)"
        )
    return bool(requested)


def resolve_auto_invariance(
    requested: bool | None, model: LlamaForCausalLM, backend: str, compile: bool
) -> int:
    """The automatic mode's reach (docs/determinism.md): with ``batch_invariant``
    unset (None), no ``compile``, the native backend and cheap invariant linears
    (``model.auto_invariance_cheap``), requests whose context is at most
    ``AUTO_INVARIANT_MAX_CONTEXT`` tokens are batch invariant (returns that length);
    otherwise 0 (``True`` covers every length, ``False`` none)."""
    if requested is not None or compile or backend != "native":
        return 0
    return AUTO_INVARIANT_MAX_CONTEXT if model.auto_invariance_cheap else 0
