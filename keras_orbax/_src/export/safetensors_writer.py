"""Safetensors files laid out before any byte is written, then filled region by region.

A safetensors file is an 8-byte little-endian header length, a JSON header (`__metadata__`, then
each tensor's `dtype`, `shape` and `data_offsets` relative to the end of the header, padded with
spaces to a multiple of 8) and every tensor's C-order bytes, back to back. The layout depends only
on names, shapes and dtypes, so every process computes the same one and writes its own regions at
their byte positions with `pwrite`; no process needs another's data, nor a whole tensor.

The order and the header bytes are those of the `safetensors` package's own `save_file` (tensors
by dtype, larger types first, then by name), so a file written here equals, byte for byte, the one
keras-hub writes through it.
"""

from __future__ import annotations

import dataclasses
import json
import math
import struct
from collections.abc import Mapping, Sequence

import numpy as np

from keras_orbax.errors import UnsupportedSourceError

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
METADATA = {"format": "pt"}  # what keras-hub (and transformers' PyTorch models) record

# numpy dtype name -> the header's; the list order is the `safetensors` crate's `Dtype` order,
# which `save_file` sorts by (descending) before the name.
_NAMES = {
    "bool": "BOOL",
    "uint8": "U8",
    "int8": "I8",
    "float8_e5m2": "F8_E5M2",
    "float8_e4m3fn": "F8_E4M3",
    "int16": "I16",
    "uint16": "U16",
    "float16": "F16",
    "bfloat16": "BF16",
    "int32": "I32",
    "uint32": "U32",
    "float32": "F32",
    "float64": "F64",
    "int64": "I64",
    "uint64": "U64",
}
_RANK = {name: rank for rank, name in enumerate(_NAMES.values())}


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """One tensor of a file: its header key, shape (C order) and numpy dtype."""

    name: str
    shape: tuple[int, ...]
    dtype: np.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    @property
    def dtype_name(self) -> str:
        name = _NAMES.get(self.dtype.name)
        if name is None:
            raise UnsupportedSourceError(
                f"Tensor {self.name!r} has dtype {self.dtype.name}, which safetensors cannot "
                f"store. Known: {', '.join(_NAMES)}."
            )
        return name


@dataclasses.dataclass(frozen=True)
class FileLayout:
    """Where each tensor's bytes start in one file (absolute offsets), and the header bytes."""

    file_name: str
    prefix: bytes  # the 8-byte length and the padded JSON header
    offsets: Mapping[str, int]
    specs: Mapping[str, TensorSpec]
    size: int


def plan_file(file_name: str, specs: Sequence[TensorSpec]) -> FileLayout:
    """The layout `safetensors.numpy.save_file(tensors, metadata=METADATA)` would give `specs`."""
    ordered = sorted(specs, key=lambda s: (-_RANK[s.dtype_name], s.name))
    header: dict[str, object] = {"__metadata__": METADATA}
    offset = 0
    relative = {}
    for spec in ordered:
        header[spec.name] = {
            "dtype": spec.dtype_name,
            "shape": list(spec.shape),
            "data_offsets": [offset, offset + spec.nbytes],
        }
        relative[spec.name] = offset
        offset += spec.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    prefix = struct.pack("<Q", len(text)) + text
    return FileLayout(
        file_name,
        prefix,
        {name: len(prefix) + start for name, start in relative.items()},
        {spec.name: spec for spec in ordered},
        len(prefix) + offset,
    )


def plan_files(specs: Sequence[TensorSpec], max_shard_bytes: int | None) -> list[FileLayout]:
    """One `model.safetensors`, or parts of at most `max_shard_bytes` of tensor data each (a tensor
    larger than that gets a part of its own), named as transformers names them."""
    ordered = sorted(specs, key=lambda s: (-_RANK[s.dtype_name], s.name))
    if max_shard_bytes is None or sum(s.nbytes for s in ordered) <= max_shard_bytes:
        return [plan_file(SINGLE_FILE, ordered)]
    parts: list[list[TensorSpec]] = [[]]
    for spec in ordered:
        if parts[-1] and sum(s.nbytes for s in parts[-1]) + spec.nbytes > max_shard_bytes:
            parts.append([])
        parts[-1].append(spec)
    n = len(parts)
    return [
        plan_file(f"model-{i + 1:05d}-of-{n:05d}.safetensors", part) for i, part in enumerate(parts)
    ]


def index_json(layouts: Sequence[FileLayout]) -> str:
    """`model.safetensors.index.json` for `layouts`: total size and each tensor's part file."""
    weight_map = {name: layout.file_name for layout in layouts for name in layout.offsets}
    total = sum(spec.nbytes for layout in layouts for spec in layout.specs.values())
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    return json.dumps(index, indent=2) + "\n"
