"""Reading arrays of one step onto their target shardings, each shard straight onto its device.

Two paths, chosen per array:
- Direct: the array was saved in the `"fast"` format (uncompressed zarr3, one file per shard) and
  each target shard is exactly one saved shard. The shard file is read once, with one `preadv`, into a
  64-byte-aligned host buffer that the CPU backend adopts without a copy (an accelerator copies it to
  device memory and the buffer is freed). Devices that hold the same shard share that read.
- Orbax: everything else (resharding, the `"compact"` format, remote paths) goes through
  `orbax.checkpoint` with a `jax.ShapeDtypeStruct` target, so tensorstore reads only the chunks each
  device needs.
Either way no host or device ever holds a full copy of a sharded array.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import os
import struct
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint.experimental.v1 as ocp
import tensorstore as ts

from keras_orbax._dtypes import np_dtype
from keras_orbax._metadata import STATE, VariableRecord
from keras_orbax.errors import CorruptCheckpointError

_ALIGN = 64  # the CPU backend adopts a numpy buffer without a copy only at this alignment
_INDEX_BYTES = (
    16 + 4
)  # one (offset, nbytes) uint64 pair + crc32c: the shard index at the file's end
_MISSING = 2**64 - 1
_TS_BYTES_READ = "/tensorstore/kvstore/file/bytes_read"


@dataclasses.dataclass(frozen=True)
class ReadRequest:
    """One array to read: what is on disk and what the variable needs."""

    record: VariableRecord
    target: jax.ShapeDtypeStruct  # the variable's shape, stored dtype and target sharding


@dataclasses.dataclass(frozen=True)
class ReadPlan:
    """How each array of one step will be read by this process; its files checked already."""

    step_dir: Path
    direct: list[tuple[ReadRequest, _ShardFiles]]
    via_orbax: list[ReadRequest]


def plan_reads(step_dir: Path, requests: Sequence[ReadRequest]) -> ReadPlan:
    """Chooses the read path of each array and checks the files this process will read.

    Raises:
        CorruptCheckpointError: a shard file this process needs is missing or truncated.
    """
    direct, via_orbax = [], []
    for request in requests:
        files = _fast_format_files(step_dir, request.record)
        if files is not None:
            _check_files(request, files)
        if files is not None and files.chunk_shape == _shard_shape(request):
            direct.append((request, files))
        else:
            via_orbax.append(request)
    return ReadPlan(step_dir, direct, via_orbax)


def read_arrays(
    plan: ReadPlan, *, max_workers: int | None = None
) -> tuple[dict[str, jax.Array], int]:
    """Reads every planned array; returns them by key and the bytes this process read.

    Collective when some arrays go through Orbax (resharding, the compact format): call on every
    process.

    Raises:
        CorruptCheckpointError: an array file is unreadable.
    """
    arrays: dict[str, jax.Array] = {}
    bytes_read = 0
    workers = max_workers or min(16, 4 * (os.cpu_count() or 1))
    with ThreadPoolExecutor(workers) as pool:
        for request, files in plan.direct:
            arrays[request.record.key], nbytes = _read_direct(request, files, pool.map)
            bytes_read += nbytes
    if plan.via_orbax:
        loaded, nbytes = _read_with_orbax(plan.step_dir, plan.via_orbax)
        arrays.update(loaded)
        bytes_read += nbytes
    return arrays, bytes_read


@dataclasses.dataclass(frozen=True)
class _ShardFiles:
    """An array in the "fast" format: one uncompressed shard file per chunk."""

    directory: Path
    shape: tuple[int, ...]
    chunk_shape: tuple[int, ...]
    itemsize: int

    def file(self, index: tuple[slice, ...]) -> Path:
        coords = [str((s.start or 0) // n) for s, n in zip(index, self.chunk_shape, strict=True)]
        return self.directory.joinpath("c", *coords)

    def files_for(self, indices: Sequence[tuple[slice, ...]]) -> list[Path]:
        """The shard files that hold any part of the given regions, each once."""
        found: dict[Path, None] = {}
        for index in indices:
            ranges = []
            for s, n, c in zip(index, self.shape, self.chunk_shape, strict=True):
                start, stop = s.start or 0, n if s.stop is None else s.stop
                ranges.append(range(start // c, (stop - 1) // c + 1))
            for coords in itertools.product(*ranges):
                found[self.directory.joinpath("c", *map(str, coords))] = None
        return list(found)

    @property
    def file_bytes(self) -> int:
        return math.prod(self.chunk_shape) * self.itemsize + _INDEX_BYTES


def _fast_format_files(step_dir: Path, record: VariableRecord) -> _ShardFiles | None:
    """The array's shard files if it was saved in the "fast" format, else None."""
    directory = step_dir / STATE / record.array
    try:
        spec = json.loads((directory / "zarr.json").read_text())
    except (OSError, ValueError):
        return None  # OCDBT, remote or foreign layout: Orbax knows how to read it
    chunk = tuple(spec.get("chunk_grid", {}).get("configuration", {}).get("chunk_shape", ()))
    raw = {"name": "bytes", "configuration": {"endian": "little"}}
    plain_shard = {
        "name": "sharding_indexed",
        "configuration": {
            "chunk_shape": list(chunk),
            "codecs": [raw],
            "index_codecs": [raw, {"name": "crc32c"}],
        },
    }
    fits = (
        spec.get("zarr_format") == 3
        and spec.get("codecs") == [plain_shard]
        and spec.get("chunk_key_encoding") == {"name": "default"}
        and spec.get("data_type") == record.dtype
        and tuple(spec.get("shape", ())) == record.shape
        and all(n % c == 0 for n, c in zip(record.shape, chunk, strict=True))
    )
    itemsize = np_dtype(record.dtype).itemsize
    return _ShardFiles(directory, record.shape, chunk, itemsize) if fits else None


def _check_files(request: ReadRequest, files: _ShardFiles) -> None:
    """Every shard file this process reads is there and whole (Orbax writes every chunk, even
    all-zero ones, so a missing file is damage, not a fill value)."""
    problems = []
    for path in files.files_for(_local_indices(request)):
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            problems.append(f"  {request.record.key}: missing file {path}")
            continue
        if size != files.file_bytes:
            problems.append(
                f"  {request.record.key}: {path} has {size} bytes, expected {files.file_bytes}"
            )
    if problems:
        raise CorruptCheckpointError(
            f"Checkpoint array '{files.directory}' is damaged; {len(problems)} shard files are "
            "missing or truncated:\n" + "\n".join(problems[:20]) + "\nNo variable was modified."
        )


def _local_indices(request: ReadRequest) -> list[tuple[slice, ...]]:
    """Distinct shard indices this process's devices hold, in a stable order."""
    mapping = request.target.sharding.addressable_devices_indices_map(request.target.shape)
    unique: dict[str, tuple[slice, ...]] = {}
    for index in mapping.values():
        unique.setdefault(repr(index), index)
    return list(unique.values())


def _shard_shape(request: ReadRequest) -> tuple[int, ...]:
    return tuple(request.target.sharding.shard_shape(request.record.shape))


def _shard_nbytes(request: ReadRequest) -> int:
    return math.prod(_shard_shape(request)) * np_dtype(request.record.dtype).itemsize


def _read_direct(
    request: ReadRequest, files: _ShardFiles, map_fn: Callable
) -> tuple[jax.Array, int]:
    sharding = request.target.sharding
    by_device = sharding.addressable_devices_indices_map(request.target.shape)
    indices = _local_indices(request)
    buffers = dict(
        zip(
            (repr(i) for i in indices),
            map_fn(lambda i: _read_shard(files.file(i), request), indices),
            strict=True,
        )
    )
    shards = [jax.device_put(buffers[repr(index)], device) for device, index in by_device.items()]
    array = jax.make_array_from_single_device_arrays(request.target.shape, sharding, shards)
    return array, len(indices) * _shard_nbytes(request)


def _read_shard(path: Path, request: ReadRequest) -> np.ndarray:
    """One shard file's data, read once into an aligned buffer, cast to the target dtype."""
    saved = np_dtype(request.record.dtype)
    shape = _shard_shape(request)
    nbytes = _shard_nbytes(request)
    with open(path, "rb", buffering=0) as file:
        fd = file.fileno()
        offset, stored = struct.unpack("<QQ", os.pread(fd, 16, nbytes))
        if offset == _MISSING or stored != nbytes:
            raise CorruptCheckpointError(
                f"{request.record.key}: shard file {path} has no data or an unexpected size "
                f"({stored} bytes, expected {nbytes})."
            )
        buffer = _aligned_empty(nbytes)
        view = buffer.data  # a writable memoryview of the aligned buffer
        done = 0
        while done < nbytes:
            n = os.preadv(fd, [view[done:]], offset + done)
            if n == 0:
                raise CorruptCheckpointError(f"{request.record.key}: {path} is truncated.")
            done += n
    data = buffer.view(saved).reshape(shape)
    target = np.dtype(request.target.dtype)
    if target == saved:
        return data
    cast = _aligned_empty(data.size * target.itemsize).view(target).reshape(shape)
    np.copyto(cast, data, casting="unsafe")
    return cast


def _aligned_empty(nbytes: int) -> np.ndarray:
    raw = np.empty(nbytes + _ALIGN, dtype=np.uint8)
    start = (-raw.ctypes.data) % _ALIGN
    return raw[start : start + nbytes]


def _read_with_orbax(
    step_dir: Path, requests: Sequence[ReadRequest]
) -> tuple[dict[str, jax.Array], int]:
    abstract: dict[str, Any] = {}
    for request in requests:
        node = abstract
        *parents, leaf = request.record.key.split("/")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = request.target
    before = _tensorstore_bytes_read()
    try:
        context = ocp.Context()
        context.pytree.loading.partial_load = True
        with context:
            loaded = ocp.load(step_dir, abstract, checkpointable_name=STATE)
    except Exception as error:  # tensorstore raises plain Exceptions; re-raised, never swallowed
        keys = ", ".join(r.record.key for r in requests[:10])
        raise CorruptCheckpointError(
            f"Cannot read arrays of checkpoint step '{step_dir}' ({keys}): {error}. "
            "No variable was modified."
        ) from error
    flat = {r.record.key: _lookup(loaded, r.record.key) for r in requests}
    return flat, _tensorstore_bytes_read() - before


def _lookup(tree: dict[str, Any], key: str) -> jax.Array:
    for part in key.split("/"):
        tree = tree[part]
    return tree  # type: ignore[return-value]


def _tensorstore_bytes_read() -> int:
    metrics = ts.experimental_collect_matching_metrics(_TS_BYTES_READ)
    return sum(int(v.get("value", 0)) for m in metrics for v in m.get("values", []))
