"""A GGUF file's tensor table, read fast: names, types, shapes and where each tensor's data lies.

Owns `tensor_table(path)`. The `gguf` package's reader builds a Python object for every metadata
value, a vocabulary of 49k-262k strings included: seconds at every start. Here metadata is skipped
by its sizes (strings by their lengths) and only the tensor infos are decoded (GGUF v2/v3, little
endian). Cached per path, size and modification time. Knows nothing of llama.cpp or kernels.
"""

from __future__ import annotations

import functools
import mmap
import struct
from pathlib import Path
from typing import NamedTuple

_FIXED = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}  # GGUF value type -> bytes
_STRING, _ARRAY = 8, 9
_ALIGNMENT_KEY = b"general.alignment"


class TensorInfo(NamedTuple):
    name: str
    type: int  # the ggml type (gguf.GGMLQuantizationType's value)
    shape: tuple[int, ...]  # GGUF's order: the row length first
    offset: int  # of its data from the file's start


def tensor_table(path: str | Path) -> list[TensorInfo]:
    """The tensors of a GGUF file; ValueError where it is not one (or not a version this reads)."""
    stat = Path(path).stat()
    return _table(str(path), stat.st_size, stat.st_mtime_ns)


@functools.cache
def _table(path: str, size: int, mtime_ns: int) -> list[TensorInfo]:
    with open(path, "rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as data:
        if data[:4] != b"GGUF":
            raise ValueError(f"{path}: not a GGUF file")
        version, n_tensors, n_kv = struct.unpack_from("<IQQ", data, 4)
        if version not in (2, 3):
            raise ValueError(f"{path}: GGUF version {version} is not read here")
        at, alignment = 24, 32

        def string(at: int) -> tuple[bytes, int]:
            (length,) = struct.unpack_from("<Q", data, at)
            return data[at + 8 : at + 8 + length], at + 8 + length

        def skip(kind: int, at: int) -> int:
            if kind in _FIXED:
                return at + _FIXED[kind]
            if kind == _STRING:
                return string(at)[1]
            if kind != _ARRAY:
                raise ValueError(f"{path}: unknown metadata type {kind}")
            inner, count = struct.unpack_from("<IQ", data, at)
            at += 12
            if inner in _FIXED:
                return at + count * _FIXED[inner]
            for _ in range(count):
                at = skip(inner, at)
            return at

        for _ in range(n_kv):
            key, at = string(at)
            (kind,) = struct.unpack_from("<I", data, at)
            if key == _ALIGNMENT_KEY and kind == 4:  # uint32
                (alignment,) = struct.unpack_from("<I", data, at + 4)
            at = skip(kind, at + 4)
        infos = []
        for _ in range(n_tensors):
            name, at = string(at)
            (dims,) = struct.unpack_from("<I", data, at)
            shape = struct.unpack_from(f"<{dims}Q", data, at + 4)
            type_, offset = struct.unpack_from("<IQ", data, at + 4 + 8 * dims)
            at += 4 + 8 * dims + 12
            infos.append((name.decode("utf-8", errors="replace"), type_, tuple(shape), offset))
        start = (at + alignment - 1) // alignment * alignment
        return [TensorInfo(name, type_, shape, start + offset) for name, type_, shape, offset in infos]
