"""The metadata files a fast-format save writes beside the shards, as Orbax's tensorstore path
writes them: per array a zarr v3 `zarr.json` whose chunk is the saved shard, `_sharding` (each
array's sharding, for plain `ocp.load`) and `array_metadatas/process_<i>`.

```python
kernel = SavedArray("dense.vars.0", (64, 64), (64, 16), np.dtype("float32"), sharding, False)
files = metadata_files([kernel])  # [("dense.vars.0/zarr.json", b"{...}"), ("_sharding", ...), ...]
```
"""

from __future__ import annotations

import base64
import dataclasses
import functools
import json
from typing import Any

import jax
import numpy as np

from keras_orbax._src.compat import orbax_compat
from keras_orbax._src.format.zarr_shards import ONE_FILE_KEYS, fast_codec
from keras_orbax._src.runtime import multihost


@dataclasses.dataclass(frozen=True)
class SavedArray:
    """One array as saved: its Orbax parameter name (the directory), shape, chunk (the saved
    shard, or the whole array when `packed` in one file), dtype and sharding."""

    name: str
    shape: tuple[int, ...]
    chunk: tuple[int, ...]
    dtype: np.dtype
    sharding: Any
    packed: bool


def metadata_files(arrays: list[SavedArray]) -> list[tuple[str, bytes]]:
    """(relative name, content) of the array metadata files this process writes."""
    return [*array_files(arrays), *step_files(arrays)]


def array_files(arrays: list[SavedArray]) -> list[tuple[str, bytes]]:
    """The metadata files of each of `arrays` alone (its `zarr.json`), which this process writes:
    written as each array is, when a step's arrays come one at a time."""
    if not multihost.is_primary():
        return []
    return [(f"{a.name}/zarr.json", _zarr_json(a)) for a in arrays]


def step_files(arrays: list[SavedArray]) -> list[tuple[str, bytes]]:
    """The metadata files that list all of a step's `arrays` (`_sharding`, this process's
    `array_metadatas`), which this process writes: written once every array is known."""
    files: list[tuple[str, bytes]] = []
    if multihost.is_primary():
        files.append(("_sharding", _sharding_json(arrays)))
    files.append((f"array_metadatas/process_{jax.process_index()}", _array_metadatas(arrays)))
    return files


def _zarr_json(array: SavedArray) -> bytes:
    """The `zarr.json` tensorstore writes for Orbax's fast options (chunk = shard, uncompressed)."""
    return _zarr_json_of(array.shape, array.chunk, array.dtype, array.packed)


# A model's thousands of arrays have a few distinct (shape, chunk, dtype) (5000 variables: 2).
@functools.lru_cache(maxsize=1024)
def _zarr_json_of(
    shape: tuple[int, ...], chunk: tuple[int, ...], dtype: np.dtype, packed: bool
) -> bytes:
    spec = {
        "chunk_grid": {"configuration": {"chunk_shape": list(chunk)}, "name": "regular"},
        "chunk_key_encoding": ONE_FILE_KEYS if packed else {"name": "default"},
        "codecs": [fast_codec(chunk, dtype.itemsize == 1)],
        "data_type": dtype.name,
        "fill_value": _fill_value(dtype),
        "node_type": "array",
        "shape": list(shape),
        "zarr_format": 3,
    }
    return json.dumps(spec, sort_keys=True, separators=(",", ":")).encode()


def _fill_value(dtype: np.dtype) -> Any:
    if dtype == np.bool_:
        return False
    if np.issubdtype(dtype, np.integer):
        return 0
    if np.issubdtype(dtype, np.complexfloating):
        return [0.0, 0.0]
    return 0.0


def _sharding_json(arrays: list[SavedArray]) -> bytes:
    """Orbax's `_sharding` file: base64url(param name) -> serialized sharding."""
    entries = {}
    for array in arrays:
        serialized = _serialized_sharding(array.sharding)
        if serialized is not None:
            entries[base64.urlsafe_b64encode(array.name.encode()).decode()] = serialized
    return json.dumps(entries, sort_keys=True, separators=(",", ":")).encode()


# Orbax's serializer takes 0.1 ms a call; a model's arrays share a few shardings.
_serialized_sharding = functools.lru_cache(maxsize=1024)(orbax_compat.serialized_sharding)


def _array_metadatas(arrays: list[SavedArray]) -> bytes:
    """Orbax's per-process `array_metadatas/process_<i>` (write shape = chunk = shard shape)."""
    entries = [
        {
            "array_metadata": {
                "param_name": a.name,
                "write_shape": list(a.chunk),
                "chunk_shape": list(a.chunk),
                "ext_metadata": None,
            }
        }
        for a in arrays
    ]
    return json.dumps({"array_metadatas": entries}).encode()
