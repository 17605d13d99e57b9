"""kvserve's native CPU kernels: one binding module per ``csrc`` file, a build module,
and the :class:`~kvserve.model.kernels.backend.KernelBackend` the runner chooses once.

- :mod:`.build`: compile ``csrc/*.cpp`` into a cached library and load it.
- :mod:`.paged_attention`, :mod:`.prefill_amx`, :mod:`.prefill_vec`, :mod:`.fused_ops`,
  :mod:`.sampling`, :mod:`.linear_panels`, :mod:`.kv8` (``csrc/attention_kv8.cpp``, with
  the 8-bit KV formats and codec): named-argument wrappers of each file's C functions
  (``csrc/linear_quant.cpp`` is bound by :mod:`kvserve.model.quant.kernel`).
- :mod:`.backend`: the families, their switches (docs/kernels.md) and the default.
- :mod:`.ops`: the ``torch.library`` operators compiled graphs call.
"""
