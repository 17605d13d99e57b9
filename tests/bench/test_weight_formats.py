"""``kvserve bench forward --weight-formats``: bytes a decode step streams per format."""

from __future__ import annotations

import time

from kvserve.bench.weight_formats import kv_bytes_read, read_bandwidth_gb_s, streamed_weight_bytes


def test_streamed_bytes_follow_the_format(loaded_model) -> None:  # type: ignore[no-untyped-def]
    from kvserve.model.loader import DEFAULT_MODEL_NAME, gguf_source, load_model

    quant = load_model(DEFAULT_MODEL_NAME, dtype="float32", quantization="auto")
    file_bytes = gguf_source(DEFAULT_MODEL_NAME).stat().st_size  # type: ignore[union-attr]
    q = streamed_weight_bytes(quant.model)
    f = streamed_weight_bytes(loaded_model.model)
    # the quantized step reads about the file (panels re-pad nothing for this model),
    # the float32 one ~5.5x that
    assert 0.9 * file_bytes < q < 1.1 * file_bytes, (q, file_bytes)
    assert f > 4 * q
    c = quant.model.config
    assert kv_bytes_read(quant.model, 2, 100, 2) == 2 * 100 * c.num_layers * 2 * (
        c.num_kv_heads * c.head_dim * 2
    )
    assert read_bandwidth_gb_s(time.perf_counter, num_bytes=8 << 20, repeats=2) > 0
