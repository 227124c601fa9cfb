"""Writing the `"fast"` format's shard files ourselves, while Orbax still commits the step.

Orbax's `PyTreeHandler` writes the tree metadata (`_METADATA`) and commits the step (temporary
directory, barrier across processes, rename); only the `jax.Array` leaves go through
`FastArrayLeafHandler`, which writes the very files Orbax's tensorstore path would
(`tests/test_format.py` compares them byte for byte): per array a zarr v3 `zarr.json` whose chunk
is the saved shard, one file per distinct shard (the raw C-order bytes, then the 20-byte
`sharding_indexed` index), `_sharding` and `array_metadatas/process_<i>`. One difference: an array
of at most `PACK_BYTES` is one chunk in one file, `<array>/c.0.0`, however it is sharded (the bytes
Orbax writes for it replicated, under a chunk key with no directories). What it does not do that
tensorstore does: encode each shard into a second buffer, write every file under a temporary name
and rename it, and fsync the directory after every file. Here each file is written once from the
shard's own buffer (on CPU, the device buffer itself) by a pool of threads, checksummed piece by
piece while it is written, fsync-ed, and every directory is fsync-ed once at the end; a metadata
file whose content another has already (the same `zarr.json` for arrays of one shape, chunk and
dtype) is a hard link to it. The step stays atomic: nothing is visible until Orbax renames the
temporary step directory. Each single file's write is `shard_files`'.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
from collections.abc import Awaitable, Iterator, Mapping, Sequence
from concurrent.futures import Future
from typing import Any, NamedTuple

import jax
import numpy as np

from keras_orbax._src.compat import orbax_compat
from keras_orbax._src.format import crc
from keras_orbax._src.storage import durable, locations
from keras_orbax._src.write import files_writer, incremental, staging
from keras_orbax._src.write.shard_files import Shard
from keras_orbax._src.write.shard_metadata import SavedArray

# An array of at most this many bytes is one chunk in one file, not one per shard: the files and
# directories of a model of many small variables are what its save costs (5000 variables, kernels
# split over 4 devices: 17,500 files and 12,500 directories before, 10,000 and 5,000 now; save
# 3.8 x -> 2.05 x the write floor, docs/benchmarks.md).
PACK_BYTES = 1 << 20
_COPY_SHARDS = contextvars.ContextVar("keras_orbax_copy_shards", default=True)
_STAGED: contextvars.ContextVar[Mapping[str, list[Shard]] | None] = contextvars.ContextVar(
    "keras_orbax_staged_shards", default=None
)
_SYNCED: contextvars.ContextVar[durable.Synced | None] = contextvars.ContextVar(
    "keras_orbax_synced", default=None
)
_RECYCLED: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "keras_orbax_recycled", default=None
)


@contextlib.contextmanager
def shards_stay_unchanged() -> Iterator[None]:
    """Within it, a save may write straight from the device buffers instead of host copies.

    Only for a save that is waited for before the arrays can change: Keras's train step donates
    the state's buffers, so an asynchronous save must copy them first (as Orbax does).
    """
    token = _COPY_SHARDS.set(False)
    try:
        yield
    finally:
        _COPY_SHARDS.reset(token)


def stage(values: Mapping[str, Any]) -> dict[str, list[Shard]]:
    """Host copies, taken now, of the shards this process writes for `values` (Orbax parameter
    name -> array): a save started later under `from_staged` writes these, whatever has become of
    the arrays' buffers since (a train step donates them)."""
    params = [_Param(name, value) for name, value in values.items() if _writable(value)]
    staged: dict[str, list[Shard]] = {p.name: [] for p in params}
    for shard in _host_shards(params, copy=True):
        staged[shard.array].append(shard)
    return staged


@contextlib.contextmanager
def noting_fsyncs(synced: durable.Synced) -> Iterator[None]:
    """Within it, a save notes in `synced` every file it fsyncs (`durable.step_committed` then
    passes over them)."""
    token = _SYNCED.set(synced)
    try:
        yield
    finally:
        _SYNCED.reset(token)


@contextlib.contextmanager
def local_tier(recycled: str | None) -> Iterator[None]:
    """Within it (unless `recycled` is None), a save is the local tier's: it writes its shards into
    the files of `recycled` (a retired step's `state/`) where it may (`recycled_step`), and
    records one CRC of each, the faster (`crc.LOCAL`)."""
    token = _RECYCLED.set(recycled)
    try:
        yield
    finally:
        _RECYCLED.reset(token)


@contextlib.contextmanager
def from_staged(staged: Mapping[str, list[Shard]]) -> Iterator[None]:
    """Within it, a save writes the shards `stage` copied instead of reading the arrays."""
    token = _STAGED.set(staged)
    try:
        yield
    finally:
        _STAGED.reset(token)


class _Param(NamedTuple):
    name: str
    value: Any


class FastArrayLeafHandler(orbax_compat.array_leaf_handler()):  # type: ignore[misc]
    """Orbax's array leaf handler, saving with keras-orbax's own shard writer.

    Loading and metadata stay Orbax's. A tree holding an array this writer does not handle (a PRNG
    key, an empty array; Keras makes neither) is saved by Orbax's own serializer, all of it, so
    that the per-process files stay one writer's.
    """

    async def serialize(self, params: Sequence[Any], serialization_context: Any) -> Awaitable[None]:
        if not all(_writable(p.value) for p in params):
            return await super().serialize(params, serialization_context)
        arrays = [_describe(p.name, p.value) for p in params]
        staged = _STAGED.get()
        if staged is not None and all(p.name in staged for p in params):
            shards = [shard for p in params for shard in staged[p.name]]
        else:
            shards = _host_shards(params, copy=_COPY_SHARDS.get())
        parent = serialization_context.parent_dir
        plan, synced, recycled = incremental.active(), _SYNCED.get(), _RECYCLED.get()
        recorded = crc.RECORDED if recycled is None else crc.LOCAL

        async def write() -> None:
            await parent.await_creation()
            path = locations.as_path(parent.path)
            await asyncio.to_thread(
                files_writer.write_arrays, path, arrays, shards, plan, synced, recycled, recorded
            )

        return write()


def shards_of(name: str, value: jax.Array) -> tuple[list[SavedArray], list[Shard]]:
    """What `files_writer.ArrayFiles.add` takes to write `value` under the Orbax parameter name `name`: its
    description and the shards this process writes (on CPU, views of its device buffers: `value`
    must not change until they are written).

    Raises:
        ValueError: `value` is empty or holds PRNG keys (written by Orbax's own serializer).
    """
    if not _writable(value):
        raise ValueError(
            f"Array '{name}' cannot be written as shard files: it is empty or holds PRNG keys. "
            f"Received: shape={value.shape}, dtype={value.dtype}"
        )
    return [_describe(name, value)], _host_shards([_Param(name, value)], copy=False)


def _writable(value: Any) -> bool:
    return (
        isinstance(value, jax.Array)
        and value.size > 0
        and not jax.dtypes.issubdtype(value.dtype, jax.dtypes.prng_key)
    )


def _describe(name: str, value: jax.Array) -> SavedArray:
    packed = is_packed(value)
    chunk = value.shape if packed else value.sharding.shard_shape(value.shape)
    dtype = np.dtype(value.dtype)
    return SavedArray(name, tuple(value.shape), tuple(chunk), dtype, value.sharding, packed)


def is_packed(value: jax.Array) -> bool:
    """Whether `value` is saved as one chunk in one file, `<array>/c.0.0`, however it is sharded:
    small (each file and directory costs a journal commit more than its bytes) and held by one
    process (which writes that file)."""
    devices: set[Any] = value.sharding.device_set
    return value.nbytes <= PACK_BYTES and len({d.process_index for d in devices}) == 1


def _host_shards(params: Sequence[Any], *, copy: bool) -> list[Shard]:
    """Replica 0 of every shard this process's devices hold, on the host (one copy each on an
    accelerator; on CPU a view of the device buffer unless `copy`); a packed array's shards
    assembled into one."""

    def distinct(value: jax.Array) -> list[Any]:
        return [s for s in value.addressable_shards if s.replica_id == 0]

    packed = [is_packed(p.value) for p in params]
    unpacked = [p for p, one_file in zip(params, packed, strict=True) if not one_file]
    # A packed array is held by one process: all its distinct shards are here, or none.
    whole = [(p, distinct(p.value)) for p, one_file in zip(params, packed, strict=True) if one_file]
    whole = [(p, shards) for p, shards in whole if shards]
    picked = [(p.name, s) for p in unpacked for s in distinct(p.value)]
    held = staging.active() if copy else None
    on_device = held.keep_on_device([p.value for p in unpacked]) if held is not None else None
    filled: list[Future | None] = [None] * len(picked)
    if on_device is not None:  # copied on the device, fetched into warm buffers meanwhile
        host, filled = on_device[0], list(on_device[1])
    else:
        host = _on_host([s.data for _, s in picked])
        if not copy:
            host = [np.ascontiguousarray(data) for data in host]
        elif held is not None:  # a background save of the callback: pinned, or warm buffers
            host = held.keep(host, [p.value for p in unpacked])
        else:
            host = [np.array(data, order="C") for data in host]
    fetched = iter(_on_host([s.data for _, shards in whole for s in shards]))
    assembled = [
        Shard(
            p.name,
            (0,) * p.value.ndim,
            _assemble(p.value, shards, fetched),
            packed=True,
            layout=_layout(p.value, p.value.shape, packed=True),
        )
        for p, shards in whole
    ]
    values = {p.name: p.value for p in unpacked}
    shards = []
    for (name, shard), data, fetch in zip(picked, host, filled, strict=True):
        chunk = shard.data.shape
        coords = tuple(
            (index.start or 0) // n if n else 0 for index, n in zip(shard.index, chunk, strict=True)
        )
        layout = _layout(values[name], chunk, packed=False)
        shards.append(Shard(name, coords, data, layout=layout, filled=fetch))
    return shards + assembled


def _layout(value: jax.Array, chunk: tuple[int, ...], *, packed: bool) -> str:
    shape, dtype = tuple(value.shape), np.dtype(value.dtype)
    return incremental.layout_of(shape, tuple(chunk), dtype, value.sharding, packed)


def _on_host(datas: list[jax.Array]) -> list[np.ndarray]:
    """`jax.device_get(datas)` (single-device arrays) without its cost per array where they are on
    the host already: on CPU 12,500 shards take 0.05 s this way, 0.17 s through `device_get`.
    An accelerator's copies are all started before the first is waited for, as there."""
    if any(d.platform != "cpu" for data in datas for d in data.devices()):
        return [np.asarray(data) for data in jax.device_get(datas)]
    return [np.asarray(data) for data in datas]


def _assemble(value: jax.Array, shards: Sequence[Any], datas: Iterator[np.ndarray]) -> np.ndarray:
    """The whole of `value` in a new C-contiguous host array, from its distinct shards (their host
    data the next of `datas`)."""
    whole = np.empty(value.shape, np.dtype(value.dtype))
    for shard in shards:
        whole[shard.index] = next(datas)
    return whole
