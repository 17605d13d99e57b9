"""Command-line options of ``kvserve bench forward`` (:mod:`kvserve.bench.forward`).

The parsers refuse bad lists with an :class:`argparse.ArgumentTypeError` that shows a
valid example; every default here is what :func:`kvserve.bench.forward.run` measures
when a flag is not given.
"""

from __future__ import annotations

import argparse


def _int_list(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"invalid list {text!r}: give comma-separated integers (e.g. 1,8,32)"
        ) from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"invalid list {text!r}: integers >= 1 (e.g. 1,8,32)")
    return values


def _cached_list(text: str) -> list[tuple[int, int]]:
    """``512@2048,256@4096`` -> [(512, 2048), (256, 4096)] (new tokens, cached tokens)."""
    if text.strip() == "none":
        return []
    out = []
    for item in text.split(","):
        new, _, cached = item.strip().partition("@")
        try:
            pair = (int(new), int(cached))
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"invalid chunk {item!r}: give NEW@CACHED token counts (e.g. 512@2048)"
            ) from None
        if pair[0] < 2 or pair[1] < 1:
            raise argparse.ArgumentTypeError(
                f"invalid chunk {item!r}: NEW >= 2 and CACHED >= 1 (e.g. 512@2048)"
            )
        out.append(pair)
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model", default="smollm2-135m-instruct", help="model (default: %(default)s)"
    )
    parser.add_argument(
        "--dtype", default="auto", help="auto (default), float32, bfloat16 or float16"
    )
    parser.add_argument(
        "--prefill-lens",
        type=_int_list,
        default=[512, 2048, 4096],
        help="prompt lengths (default: 512,2048,4096)",
    )
    parser.add_argument(
        "--cached-prefill",
        type=_cached_list,
        default=[(512, 2048), (512, 4096)],
        help="chunks over a cached prefix, NEW@CACHED comma-separated, or none "
        "(default: 512@2048,512@4096)",
    )
    parser.add_argument(
        "--decode-batches",
        type=_int_list,
        default=[1, 8, 32, 64],
        help="decode batch sizes (default: 1,8,32,64)",
    )
    parser.add_argument(
        "--context",
        type=int,
        default=128,
        help="prompt tokens per decode request (default: %(default)s)",
    )
    parser.add_argument(
        "--decode-steps",
        type=int,
        default=12,
        help="timed decode steps per batch size (default: %(default)s)",
    )
    parser.add_argument(
        "--repeats", type=int, default=3, help="timed prefills per length (default: %(default)s)"
    )
    parser.add_argument(
        "--kv-segment-size", type=int, default=512, help="prefill KV segment (default: %(default)s)"
    )
    parser.add_argument(
        "--block-size", type=int, default=16, help="KV block size (default: %(default)s)"
    )
    parser.add_argument(
        "--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)"
    )
    parser.add_argument(
        "--clock",
        choices=("wall", "cpu"),
        default="wall",
        help="wall: elapsed time; cpu: this process's CPU time, robust to other load on a "
        "shared machine when used with --threads 1 (default: %(default)s)",
    )
    parser.add_argument(
        "--attention-batches",
        type=_int_list,
        default=[1, 16, 64],
        help="decode attention grid: batch sizes (default: 1,16,64)",
    )
    parser.add_argument(
        "--attention-contexts",
        type=_int_list,
        default=[1024, 4096],
        help="decode attention grid: contexts (default: 1024,4096)",
    )
    parser.add_argument(
        "--attention-placements",
        default="engine,random",
        help="decode attention grid: comma-separated block placements, each a row: engine "
        "(the engine's own allocator), engine-churn (the same after a generation of "
        "requests was freed), random (the worst case) (default: %(default)s)",
    )
    parser.add_argument(
        "--attention-backends",
        default="native",
        help="decode attention grid: comma-separated native,portable, or none to skip "
        "(default: %(default)s)",
    )
    parser.add_argument(
        "--quantization",
        default="auto",
        help="weights of the main run: auto (default: a GGUF's quantized tensors as they "
        "are), none, int8 or int4",
    )
    parser.add_argument(
        "--weight-formats",
        default="",
        help="also decode at --decode-batches with each of these comma-separated "
        "quantization values (e.g. none,auto), against the memory-bandwidth limit",
    )
    parser.add_argument(
        "--kv-formats",
        default="",
        help="also time decode attention (--attention-batches x --attention-contexts, "
        "interleaved) and whole-model decode (--decode-batches) with each of these "
        "comma-separated KV cache dtypes (e.g. auto,int8,fp8_e4m3), against the "
        "memory-bandwidth limit",
    )
    parser.add_argument(
        "--batch-invariant",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="batch-invariant kernels on/off (default: the engine's automatic choice)",
    )
    parser.add_argument("--no-hf", action="store_true", help="skip the HF transformers baseline")
    parser.add_argument("--json", default=None, help="also write the results to this JSON file")
