"""Quantized weights: formats and packing (``formats``), GGUF tensors as they are
(``gguf``), the native kernel bindings (``kernel``) and the layers (``linear``). See
docs/quantization.md."""
