"""A GGUF file's tensor table, read fast: names, types, shapes and where each tensor's data lies.

Owns `tensor_table(path)`, `metadata(path, keys)` and `check(path)` (a whole GGUF file, or one
line why not). The `gguf` package's reader builds a Python object for every metadata value, a
vocabulary of 49k-262k strings included: seconds at every start. Here metadata is skipped by its
sizes (strings by their lengths) except the keys asked for, and the tensor infos are decoded
(GGUF v2/v3, little endian). Cached per path, size and modification time. Knows nothing of
llama.cpp or kernels.
"""

from __future__ import annotations

import functools
import mmap
import struct
from pathlib import Path
from typing import NamedTuple

_FORMATS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}  # by GGUF type
_FIXED = {kind: struct.calcsize("<" + code) for kind, code in _FORMATS.items()}  # GGUF value type -> bytes
_STRING, _ARRAY = 8, 9
_ALIGNMENT = "general.alignment"


class TensorInfo(NamedTuple):
    name: str
    type: int  # the ggml type (gguf.GGMLQuantizationType's value)
    shape: tuple[int, ...]  # GGUF's order: the row length first
    offset: int  # of its data from the file's start


def tensor_table(path: str | Path) -> list[TensorInfo]:
    """The tensors of a GGUF file; ValueError where it is not one (or not a version this reads)."""
    stat = Path(path).stat()
    return _read(str(path), stat.st_size, stat.st_mtime_ns, frozenset())[1]


def metadata(path: str | Path, keys: tuple[str, ...]) -> dict:
    """The values of these metadata keys that the file holds (numbers, strings, lists), the rest skipped unread."""
    stat = Path(path).stat()
    return _read(str(path), stat.st_size, stat.st_mtime_ns, frozenset(keys))[0]


def check(path: str | Path) -> None:
    """ValueError, one line, where the file is not a whole GGUF file: empty, another format, a header
    that ends early, or tensor data that ends before its last tensor does (a download cut short)."""
    from gguf import GGML_QUANT_SIZES

    size = Path(path).stat().st_size
    if size == 0:
        raise ValueError(f"{path}: an empty file, not a GGUF file")
    with open(path, "rb") as file:
        start = file.read(4)
    if start != b"GGUF":
        raise ValueError(f"{path}: not a GGUF file (it starts with {start!r}, a GGUF file with b'GGUF')")
    try:
        tensors = tensor_table(path)
    except (struct.error, IndexError):
        raise ValueError(f"{path}: truncated: {size} bytes end inside the GGUF header") from None
    needed = 0
    for tensor in tensors:
        block, block_bytes = GGML_QUANT_SIZES.get(tensor.type, (1, 0))
        count = 1
        for n in tensor.shape:
            count *= n
        needed = max(needed, tensor.offset + count // block * block_bytes)
    if size < needed:
        raise ValueError(f"{path}: truncated: {size} of the {needed} bytes its tensors need")


@functools.cache
def _read(path: str, size: int, mtime_ns: int, wanted: frozenset[str]) -> tuple[dict, list[TensorInfo]]:
    with open(path, "rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as data:
        if data[:4] != b"GGUF":
            raise ValueError(f"{path}: not a GGUF file")
        version, n_tensors, n_kv = struct.unpack_from("<IQQ", data, 4)
        if version not in (2, 3):
            raise ValueError(f"{path}: GGUF version {version} is not read here")
        at, found = 24, {}

        def string(at: int) -> tuple[bytes, int]:
            (length,) = struct.unpack_from("<Q", data, at)
            return data[at + 8 : at + 8 + length], at + 8 + length

        def value(kind: int, at: int, keep: bool) -> tuple[object, int]:
            """(the value, or None where not kept; where the next item starts)."""
            if kind in _FIXED:
                return (struct.unpack_from("<" + _FORMATS[kind], data, at)[0] if keep else None), at + _FIXED[kind]
            if kind == _STRING:
                text, end = string(at)
                return (text.decode("utf-8", errors="replace") if keep else None), end
            if kind != _ARRAY:
                raise ValueError(f"{path}: unknown metadata type {kind}")
            inner, count = struct.unpack_from("<IQ", data, at)
            at += 12
            if inner in _FIXED:
                end = at + count * _FIXED[inner]
                return (list(struct.unpack_from(f"<{count}{_FORMATS[inner]}", data, at)) if keep else None), end
            items = []
            for _ in range(count):
                item, at = value(inner, at, keep)
                items.append(item)
            return (items if keep else None), at

        for _ in range(n_kv):
            key, at = string(at)
            name = key.decode("utf-8", errors="replace")
            (kind,) = struct.unpack_from("<I", data, at)
            keep = name in wanted or name == _ALIGNMENT
            found[name], at = value(kind, at + 4, keep)
            if not keep:
                del found[name]
        alignment = found.get(_ALIGNMENT, 32)
        if _ALIGNMENT not in wanted:
            found.pop(_ALIGNMENT, None)
        infos = []
        for _ in range(n_tensors):
            name, at = string(at)
            (dims,) = struct.unpack_from("<I", data, at)
            shape = struct.unpack_from(f"<{dims}Q", data, at + 4)
            type_, offset = struct.unpack_from("<IQ", data, at + 4 + 8 * dims)
            at += 4 + 8 * dims + 12
            infos.append((name.decode("utf-8", errors="replace"), type_, tuple(shape), offset))
        start = (at + alignment - 1) // alignment * alignment
        return found, [TensorInfo(name, type_, shape, start + offset) for name, type_, shape, offset in infos]
