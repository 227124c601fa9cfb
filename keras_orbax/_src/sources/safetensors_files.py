"""Where each tensor of a Hugging Face safetensors directory lies on disk, from the headers alone.

A safetensors file is an 8-byte little-endian header length, a JSON header (`dtype`, `shape`,
`data_offsets` relative to the end of the header) and then every tensor's raw C-order, little-endian
bytes. A directory holds `model.safetensors`, or `model.safetensors.index.json` whose `weight_map`
names the part file of each tensor. Only headers are read here; no tensor data, no package code.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import struct
from pathlib import Path

import numpy as np

from keras_orbax._src.format.dtypes import np_dtype
from keras_orbax._src.format.record_check import plain_name
from keras_orbax.errors import CheckpointNotFoundError, CorruptCheckpointError

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
FILES = (SINGLE_FILE, INDEX_FILE)  # one of them makes a Hugging Face model directory

# The header's dtype names (safetensors 0.4+ spec) -> numpy's (`np_dtype`); bytes are
# little-endian.
_DTYPES: dict[str, str] = {
    "BOOL": "bool",
    "U8": "u1",
    "I8": "i1",
    "U16": "<u2",
    "I16": "<i2",
    "U32": "<u4",
    "I32": "<i4",
    "U64": "<u8",
    "I64": "<i8",
    "F16": "<f2",
    "F32": "<f4",
    "F64": "<f8",
    "BF16": "bfloat16",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
}
# safetensors refuses headers over 100 MB; keras-orbax over 16 MiB: a header lists each tensor in
# about 150 bytes, so that is 100,000 tensors in one file (Hugging Face shards hold hundreds), where
# 100 MB of JSON would be millions of Python objects, gigabytes of host memory.
_MAX_HEADER_BYTES = 16 << 20


@dataclasses.dataclass(frozen=True)
class SafetensorsTensor:
    """One tensor of a safetensors file: `nbytes` bytes at absolute byte `offset` of `file`.

    Attributes:
        name: The key in the file's header, e.g. `model.layers.0.self_attn.q_proj.weight`.
        file: The file that holds the bytes.
        offset: Absolute byte offset of the first byte in `file`.
        shape: The tensor's shape (C order).
        dtype: The numpy dtype of the stored elements (bfloat16 and float8 are ml_dtypes', as JAX uses).
    """

    name: str
    file: Path
    offset: int
    shape: tuple[int, ...]
    dtype: np.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def read_file_header(path: str | os.PathLike) -> dict[str, SafetensorsTensor]:
    """Parses one safetensors file's header into its tensors, by name, in header order.

    Raises:
        CorruptCheckpointError: the header is malformed, names an unknown dtype, or points outside
            the file or at a byte count that does not match the shape.
    """
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            raise CorruptCheckpointError(f"{path}: {size} bytes, too short for a safetensors file.")
        (header_len,) = struct.unpack("<Q", prefix)
        if header_len > size - 8:
            raise CorruptCheckpointError(
                f"{path}: header length {header_len} does not fit a file of {size} bytes."
            )
        if header_len > _MAX_HEADER_BYTES:
            raise CorruptCheckpointError(
                f"{path}: its header is {header_len} bytes of JSON; keras-orbax reads headers of "
                f"up to {_MAX_HEADER_BYTES} bytes (about 100,000 tensors in one file)."
            )
        try:
            header = json.loads(f.read(header_len))
        except (ValueError, RecursionError) as e:  # RecursionError: JSON nested too deep
            raise CorruptCheckpointError(f"{path}: header is not JSON: {e}") from None
    if not isinstance(header, dict):
        raise CorruptCheckpointError(f"{path}: header is not a JSON object.")
    data_start = 8 + header_len
    return {
        name: _tensor(path, name, entry, data_start, size)
        for name, entry in header.items()
        if name != "__metadata__"
    }


def _tensor(path: Path, name: str, entry: object, data_start: int, size: int) -> SafetensorsTensor:
    try:
        dtype_name = entry["dtype"]  # type: ignore[index]
        shape = tuple(int(d) for d in entry["shape"])  # type: ignore[index]
        begin, end = (int(o) for o in entry["data_offsets"])  # type: ignore[index]
    except (TypeError, KeyError, ValueError):
        raise CorruptCheckpointError(f"{path}: malformed header entry {name!r}: {entry}") from None
    numpy_name = _DTYPES.get(dtype_name)
    if numpy_name is None:
        raise CorruptCheckpointError(
            f"{path}: tensor {name!r} has dtype {dtype_name!r}, which keras-orbax does not read. "
            f"Known: {', '.join(_DTYPES)}."
        )
    tensor = SafetensorsTensor(name, path, data_start + begin, shape, np_dtype(numpy_name))
    if min(shape, default=0) < 0 or end - begin != tensor.nbytes or data_start + end > size:
        raise CorruptCheckpointError(
            f"{path}: tensor {name!r} ({dtype_name} {list(shape)}, {tensor.nbytes} bytes) has "
            f"data_offsets [{begin}, {end}] in a file of {size} bytes (data starts at {data_start})."
        )
    return tensor


def read_directory(directory: str | os.PathLike) -> dict[str, SafetensorsTensor]:
    """Every tensor of a Hugging Face model directory, by name.

    Reads `model.safetensors.index.json` and the headers of the part files it names when the index
    exists (as keras-hub does), else the header of `model.safetensors`.

    Raises:
        CheckpointNotFoundError: the directory has neither file, or the index names a missing part.
        CorruptCheckpointError: a header or the index is malformed, or the index names a tensor
            that its part file lacks.
    """
    directory = Path(directory)
    index_path = directory / INDEX_FILE
    if not index_path.exists():
        single = directory / SINGLE_FILE
        if not single.exists():
            raise CheckpointNotFoundError(
                f"{directory} holds neither {SINGLE_FILE} nor {INDEX_FILE}."
            )
        return read_file_header(single)
    try:
        weight_map = json.loads(index_path.read_text())["weight_map"]
        parts = {str(part) for part in weight_map.values()}
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as e:
        raise CorruptCheckpointError(f"{index_path}: no readable weight_map ({e!r}).") from None
    headers = {}
    for part in sorted(parts):
        if not plain_name(part):  # Hugging Face keeps every part beside its index
            raise CorruptCheckpointError(
                f"{index_path} names the part '{part}', which is not a file of {directory}."
            )
        if not (directory / part).exists():
            raise CheckpointNotFoundError(f"{index_path} names {part}, which does not exist.")
        headers[part] = read_file_header(directory / part)
    tensors = {}
    for name, part in weight_map.items():
        if name not in headers[part]:
            raise CorruptCheckpointError(f"{index_path} puts {name!r} in {part}, which lacks it.")
        tensors[name] = headers[part][name]
    return tensors


def read_tensor(tensor: SafetensorsTensor) -> np.ndarray:
    """Reads exactly one tensor's bytes from its file into a new array of its shape and dtype."""
    count = math.prod(tensor.shape)
    with open(tensor.file, "rb") as f:
        array = np.fromfile(f, dtype=tensor.dtype, count=count, offset=tensor.offset)
    if array.size != count:
        raise CorruptCheckpointError(
            f"{tensor.file}: tensor {tensor.name!r} is truncated ({array.size} of {count} elements)."
        )
    return array.reshape(tensor.shape)
