"""A GGUF file's header and tensor table, read without parsing its large arrays.

The gguf package's ``GGUFReader`` builds a NumPy view for every element of every
metadata array, which for a tokenizer's 49k tokens and 49k merges costs ~2.5 s per
load (most of a server's start on the default model). :func:`read_gguf` walks the
same header with ``struct``: scalars and strings are decoded, arrays are skipped
(their length is recorded), and each tensor's data is one NumPy view of the file
(memory-mapped, read-only), shaped and typed exactly as ``GGUFReader`` shapes it
(typed elements for F16/F32/F64/I8-I64, raw bytes per row for every other type),
so callers can use either. Layout (GGUF v2/v3, little-endian):

    magic "GGUF", version u32, tensor_count u64, kv_count u64,
    kv_count x (key string, value type u32, value),
    tensor_count x (name string, n_dims u32, ne u64 x n_dims, type u32, offset u64),
    padding to ``general.alignment`` (default 32), then the tensor data.

A string is a u64 byte length and UTF-8 bytes; an array is an element type u32, a
count u64 and the elements. Big-endian files and versions other than 2 and 3 are
refused (ValueError), as is any offset or size that runs past the end of the file.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
# value types (GGUF spec): code -> struct format of one scalar ("" for string / array)
_SCALARS = {
    0: "<B",  # uint8
    1: "<b",  # int8
    2: "<H",  # uint16
    3: "<h",  # int16
    4: "<I",  # uint32
    5: "<i",  # int32
    6: "<f",  # float32
    7: "<?",  # bool
    10: "<Q",  # uint64
    11: "<q",  # int64
    12: "<d",  # float64
}
_STRING, _ARRAY = 8, 9
# tensor types whose data GGUFReader gives as typed elements (the rest: raw bytes)
_TYPED = {
    0: np.float32,
    1: np.float16,
    24: np.int8,
    25: np.int16,
    26: np.int32,
    27: np.int64,
    28: np.float64,
}


@dataclass(frozen=True)
class GGUFArray:
    """A metadata array that was skipped: its element type code and length."""

    type_code: int
    count: int


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor: ``shape`` is GGUF's ``ne`` order (fastest-varying dim first, as
    ``GGUFReader``'s ``shape``); ``data`` a read-only view of its bytes in the file,
    which start at byte ``offset``."""

    name: str
    tensor_type: Any  # gguf.GGMLQuantizationType
    shape: tuple[int, ...]
    data: np.ndarray
    offset: int


@dataclass(frozen=True)
class GGUFFile:
    """A GGUF file's metadata (scalars and strings as values, arrays as
    :class:`GGUFArray`) and tensors in file order."""

    version: int
    fields: dict[str, Any]
    tensors: list[GGUFTensor]
    alignment: int

    def string(self, key: str) -> str:
        """A string field; ValueError where it is missing or not a string."""
        v = self.fields.get(key)
        if not isinstance(v, str):
            raise ValueError(f"GGUF field {key!r} is missing or not a string")
        return v


class _Cursor:
    def __init__(self, buf: memoryview) -> None:
        self.buf = buf
        self.pos = 0

    def take(self, n: int) -> memoryview:
        if n < 0 or self.pos + n > len(self.buf):
            raise ValueError(f"GGUF header runs past the end of the file (at byte {self.pos})")
        out = self.buf[self.pos : self.pos + n]
        self.pos += n
        return out

    def unpack(self, fmt: str) -> Any:
        size = struct.calcsize(fmt)
        return struct.unpack(fmt, self.take(size))[0]

    def string(self) -> str:
        n = self.unpack("<Q")
        return bytes(self.take(n)).decode("utf-8", errors="replace")

    def skip_array(self, type_code: int, count: int) -> None:
        if type_code in _SCALARS:
            self.take(struct.calcsize(_SCALARS[type_code]) * count)
        elif type_code == _STRING:
            buf, pos, end = self.buf, self.pos, len(self.buf)
            unpack_from = struct.unpack_from
            for _ in range(count):
                if pos + 8 > end:
                    raise ValueError("GGUF string array runs past the end of the file")
                pos += 8 + unpack_from("<Q", buf, pos)[0]
            if pos > end:
                raise ValueError("GGUF string array runs past the end of the file")
            self.pos = pos
        elif type_code == _ARRAY:
            for _ in range(count):
                self.skip_array(self.unpack("<I"), self.unpack("<Q"))
        else:
            raise ValueError(f"GGUF array of unknown value type {type_code}")

    def value(self, type_code: int) -> Any:
        if type_code in _SCALARS:
            return self.unpack(_SCALARS[type_code])
        if type_code == _STRING:
            return self.string()
        if type_code == _ARRAY:
            elem, count = self.unpack("<I"), self.unpack("<Q")
            self.skip_array(elem, count)
            return GGUFArray(elem, count)
        raise ValueError(f"GGUF value of unknown type {type_code}")


def read_gguf(path: str | Path) -> GGUFFile:
    """The header and tensor table of the GGUF file at ``path`` (see the module doc).

    The tensors' ``data`` views keep the file mapped while they live; ValueError for
    a file that is not a readable little-endian GGUF v2/v3 file."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import quant_shape_to_byte_shape

    mm = np.memmap(str(path), mode="r").view(np.ndarray)  # plain views: no memmap subclass
    cur = _Cursor(memoryview(mm.data).cast("B"))
    if bytes(cur.take(4)) != MAGIC:
        raise ValueError("not a GGUF file (bad magic)")
    version = cur.unpack("<I")
    if version not in (2, 3):
        raise ValueError(f"GGUF version {version} is not supported (2 or 3, little-endian)")
    n_tensors, n_kv = cur.unpack("<Q"), cur.unpack("<Q")
    fields: dict[str, Any] = {}
    for _ in range(n_kv):
        key = cur.string()
        fields[key] = cur.value(cur.unpack("<I"))
    infos = []
    for _ in range(n_tensors):
        name = cur.string()
        n_dims = cur.unpack("<I")
        dims = tuple(cur.unpack("<Q") for _ in range(n_dims))
        infos.append((name, dims, cur.unpack("<I"), cur.unpack("<Q")))
    alignment = fields.get("general.alignment", DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or alignment <= 0:
        raise ValueError(f"GGUF general.alignment {alignment!r} is not a positive integer")
    start = -(-cur.pos // alignment) * alignment
    tensors = []
    seen: set[str] = set()
    for name, dims, code, offset in infos:
        if name in seen:
            raise ValueError(f"GGUF tensor {name!r} appears twice")
        seen.add(name)
        ttype = GGMLQuantizationType(code)
        n_elems = int(np.prod(dims, dtype=np.int64)) if dims else 1
        block, type_size = GGML_QUANT_SIZES[ttype]
        n_bytes = n_elems * type_size // block
        shape = tuple(reversed(dims))
        lo = start + offset
        if lo + n_bytes > len(mm):
            raise ValueError(f"GGUF tensor {name!r} runs past the end of the file")
        raw = mm[lo : lo + n_bytes]
        if code in _TYPED:
            data = raw.view(_TYPED[code]).reshape(shape)
        else:
            data = raw.reshape(quant_shape_to_byte_shape(shape, ttype))
        tensors.append(GGUFTensor(name, ttype, dims, data, lo))
    return GGUFFile(version, fields, tensors, alignment)
