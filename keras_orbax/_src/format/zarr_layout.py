"""The layout of keras-orbax's `"fast"` array format on disk (docs/format.md): the `zarr.json`
it writes and reads back, the chunk keys of its shard files, and the zarr shard index that ends
each file and says where its data is (`data_offset`). What `zarr_shards` reads and `write/` writes.
"""

from __future__ import annotations

import functools
import json
import os
import struct
from typing import Any

from keras_orbax._src.format.checksum import crc32c
from keras_orbax._src.format.step_record import VariableRecord
from keras_orbax._src.storage import locations
from keras_orbax.errors import CorruptCheckpointError

INDEX_BYTES = 16 + 4  # the zarr shard index: one (offset, nbytes) uint64 pair, then a crc32c
_MISSING = 2**64 - 1
_RAW = {"name": "bytes", "configuration": {"endian": "little"}}
# Chunk keys c/0/1 (Orbax's), or c.0.1: the one file of a small array (no directories under it).
ONE_FILE_SEPARATOR = "."
ONE_FILE_KEYS = {"name": "default", "configuration": {"separator": ONE_FILE_SEPARATOR}}
KEY_ENCODINGS = ({"name": "default"}, ONE_FILE_KEYS)


def chunk_key(coords: tuple[int, ...], separator: str = "/") -> str:
    """The file of chunk `coords` under its array's directory: `c/0/1`, or `c.0.1`."""
    return separator.join(["c", *map(str, coords)])


def data_offset(key: str, path: Any, index: bytes | bytearray, chunk_bytes: int, end: int) -> int:
    """Checks the shard index `index` read from `path` (a file of array `key` holding one chunk
    of `chunk_bytes`; `end`: the file's size); returns the data's offset.

    Raises:
        CorruptCheckpointError: an index of no data, another size, past the end, or failing its
            CRC-32C (a damaged index could shift the data silently).
    """
    offset, stored = struct.unpack("<QQ", index[:16])
    (crc,) = struct.unpack("<I", index[16:])
    if offset == _MISSING or stored != chunk_bytes or offset + stored > end:
        raise CorruptCheckpointError(f"{key}: shard file {path} has no data or a bad index.")
    if crc != crc32c(bytes(index[:16])):
        raise CorruptCheckpointError(f"{key}: the shard index of {path} fails its CRC-32C check.")
    return offset


def refuse_missing_spec(directory: Any, record: VariableRecord) -> None:
    """An array directory of the fast format without its `zarr.json` is damage, said naming the
    file (Orbax would fail with a page of tensorstore spec). A compact step has no such directory:
    its arrays are in OCDBT files, which Orbax reads."""
    if not locations.is_remote(directory) and os.path.isdir(directory):
        raise CorruptCheckpointError(
            f"{record.key}: its array metadata file {directory}/zarr.json is missing. The step is "
            "damaged: restore another step."
        )


def refuse_unparsable_spec(directory: Any, record: VariableRecord, raw: bytes) -> None:
    """A `zarr.json` that is not a JSON object is damage, said naming the file."""
    try:
        if isinstance(json.loads(raw), dict):
            return
        problem = "not a JSON object"
    except (ValueError, RecursionError) as error:  # UnicodeDecodeError; JSON nested too deep
        problem = f"not valid JSON ({error})"
    raise CorruptCheckpointError(
        f"{record.key}: its array metadata file {directory}/zarr.json is damaged: {problem}. "
        "The step is damaged: restore another step."
    )


def refuse_another_array(
    directory: Any, record: VariableRecord, data_type: str, shape: tuple[int, ...]
) -> None:
    """A `zarr.json` describing another array than the step's record says is there is damage
    (read through Orbax, its bytes would be cast from the dtype it names: other values)."""
    raise CorruptCheckpointError(
        f"{record.key}: its array metadata file {directory}/zarr.json describes a {shape} "
        f"{data_type} array, the step's record a {record.shape} {record.dtype} one. The step is "
        "damaged: restore another step."
    )


def fast_codec(chunk: tuple[int, ...], one_byte_dtype: bool) -> dict[str, Any]:
    """The one codec of a fast-format array's `zarr.json`: a shard per chunk, uncompressed, its
    index checksummed (what tensorstore writes for Orbax's fast options, and all this reader reads
    directly). Tensorstore leaves out the byte order of one-byte dtypes (int8, uint8, bool)."""
    return {
        "name": "sharding_indexed",
        "configuration": {
            "chunk_shape": list(chunk),
            "codecs": [{"name": "bytes"} if one_byte_dtype else _RAW],
            "index_codecs": [_RAW, {"name": "crc32c"}],
        },
    }


@functools.lru_cache(maxsize=256)
def plain_layout(
    raw: bytes, one_byte_dtype: bool
) -> tuple[str, tuple[int, ...], tuple[int, ...], str] | None:
    """(data type, shape, chunk shape, chunk key separator) of a `zarr.json` of the fast format; None
    for anything else. Cached by content: the arrays of a model share a few layouts (5000 arrays:
    parsing each took a fifth of the time to plan their reads)."""
    try:
        spec = json.loads(raw)
        chunk = tuple(spec["chunk_grid"]["configuration"]["chunk_shape"])
        shape = tuple(spec["shape"])
    except (ValueError, TypeError, KeyError, RecursionError):
        return None
    fits = (
        spec.get("zarr_format") == 3
        and spec.get("codecs") == [fast_codec(chunk, one_byte_dtype)]
        and spec.get("chunk_key_encoding") in KEY_ENCODINGS
        and isinstance(spec.get("data_type"), str)
        and all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in shape)
        and chunks_divide(chunk, shape)
    )
    if not fits:
        return None
    separator = spec["chunk_key_encoding"].get("configuration", {}).get("separator", "/")
    return spec["data_type"], shape, chunk, separator


def chunks_divide(chunk: tuple, shape: tuple[int, ...]) -> bool:
    """`chunk` (from an untrusted zarr.json) is one positive int per dimension, each dividing it."""
    return len(chunk) == len(shape) and all(
        isinstance(c, int) and not isinstance(c, bool) and c > 0 and n % c == 0
        for n, c in zip(shape, chunk, strict=True)
    )
