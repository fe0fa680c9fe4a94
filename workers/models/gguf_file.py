"""Read a GGUF file's tensor directory and scalar metadata without parsing the vocabulary.

GGUF (ggml's file format, ``docs/gguf.md`` in ggml/llama.cpp; versions 2 and 3, little-endian):
``"GGUF"``, uint32 version, uint64 tensor count, uint64 metadata count; metadata as (string key,
uint32 type, value); tensor infos as (string name, uint32 n_dims, uint64 dims[n_dims] (ne0 =
the contiguous dimension first), uint32 ggml type, uint64 offset); tensor data from the next
multiple of ``general.alignment`` (default 32). Strings are uint64 length + UTF-8 bytes.

gguf-py's ``GGUFReader`` builds numpy views of every metadata array item (about 11 s for the
49k-token vocabulary of the default model on our 2 cores); this reader skips arrays (kept as
None) and maps tensors lazily, in milliseconds.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor: ``shape`` in PyTorch order (``[N, K]`` for a matrix), ``type`` the ggml type name
    (``"Q4_1"``, ``"F32"``...), ``data`` the raw bytes as uint8 ``[N, bytes per row]`` (a read-only
    memory map)."""

    name: str
    shape: tuple[int, ...]
    type: str
    data: np.ndarray


class GGUFFile:
    """``metadata`` (scalar and string values; arrays are None) and ``tensors`` by name.

    Raises:
        ValueError: not a GGUF file, an unsupported version or metadata type, or a truncated file.
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._map = np.memmap(self.path, dtype=np.uint8, mode="r")
        buf = self._map
        if bytes(buf[:4]) != b"GGUF":
            raise ValueError(f"{self.path} is not a GGUF file")
        version, n_tensors, n_kv = struct.unpack_from("<IQQ", buf, 4)
        if version not in (2, 3):
            raise ValueError(f"{self.path}: GGUF version {version} is not supported (2 or 3)")
        self._pos = 24
        self.metadata: dict[str, object] = {}
        for _ in range(n_kv):
            key = self._string()
            self.metadata[key] = self._value(self._u32())
        infos = []
        for _ in range(n_tensors):
            name = self._string()
            dims = [self._unpack("<Q") for _ in range(self._u32())]
            infos.append((name, dims, self._u32(), self._unpack("<Q")))
        align = int(self.metadata.get("general.alignment") or 32)
        start = -(-self._pos // align) * align
        self.tensors: dict[str, GGUFTensor] = {}
        for name, dims, type_id, offset in infos:
            qtype = GGMLQuantizationType(type_id)
            block, size = GGML_QUANT_SIZES[qtype]
            row_bytes = dims[0] // block * size
            rows = int(np.prod(dims[1:], dtype=np.int64)) if len(dims) > 1 else 1
            begin = start + offset
            if begin + rows * row_bytes > len(buf):
                raise ValueError(f"{self.path} is truncated (tensor {name})")
            data = buf[begin : begin + rows * row_bytes].reshape(rows, row_bytes)
            self.tensors[name] = GGUFTensor(name, tuple(reversed(dims)), qtype.name, data)

    def _unpack(self, fmt: str):
        value = struct.unpack_from(fmt, self._map, self._pos)[0]
        self._pos += struct.calcsize(fmt)
        return value

    def _u32(self) -> int:
        return self._unpack("<I")

    def _string(self) -> str:
        n = self._unpack("<Q")
        s = bytes(self._map[self._pos : self._pos + n]).decode("utf-8", errors="replace")
        self._pos += n
        return s

    def _value(self, vtype: int):
        if vtype in _SCALARS:
            return self._unpack(_SCALARS[vtype])
        if vtype == _STRING:
            return self._string()
        if vtype == _ARRAY:
            etype, n = self._u32(), self._unpack("<Q")
            if etype in _SCALARS:
                self._pos += n * struct.calcsize(_SCALARS[etype])
            elif etype == _STRING:
                for _ in range(n):
                    self._pos += 8 + struct.unpack_from("<Q", self._map, self._pos)[0]
            else:
                for _ in range(n):
                    self._value(etype)
            return None
        raise ValueError(f"{self.path}: unknown GGUF metadata type {vtype}")
