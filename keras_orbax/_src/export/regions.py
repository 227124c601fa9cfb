"""A sharded `jax.Array` as host blocks of at most a window each, with their global positions.

Every sink writes through this: it never fetches a whole variable (keras-hub's and Keras's own
writers do, which is what runs a host out of memory on a sharded 9B model), only one window of one
shard at a time, sliced on the device so that no host buffer larger than the window exists.

A block is cut along the leading axis of its shard (whole rows, so it is one contiguous run of the
shard); only where a single row exceeds the window is it cut along the next axis, and so on.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

DEFAULT_WINDOW_BYTES = 256 * 1024 * 1024

Index = tuple[slice, ...]


@dataclass(frozen=True)
class Region:
    """`block` holds the elements `index` names of the whole (global) array: each slice has int
    `start` and `stop` and step 1, one per axis (none for a scalar)."""

    index: Index
    block: np.ndarray


def normalized(index: tuple[slice, ...], shape: tuple[int, ...]) -> Index:
    """`index` (as `jax.Shard.index` gives it, `slice(None)` for a whole axis) with int bounds."""
    return tuple(slice(*s.indices(n)[:2]) for s, n in zip(index, shape, strict=True))


def distinct_shards(array: jax.Array) -> list[jax.Shard]:
    """This process's shards of `array`, one per distinct region (a replicated region once).

    A region held by several of this process's devices is taken from the lowest replica, so each
    region of the array is read once per process.
    """
    chosen: dict[tuple[tuple[int, int], ...], jax.Shard] = {}
    for shard in array.addressable_shards:
        key = tuple((s.start, s.stop) for s in normalized(shard.index, array.shape))
        if key not in chosen or shard.replica_id < chosen[key].replica_id:
            chosen[key] = shard
    return [chosen[k] for k in sorted(chosen)]


def windows(shape: tuple[int, ...], itemsize: int, window_bytes: int) -> Iterator[Index]:
    """Sub-regions (local to a block of `shape`) of at most `window_bytes` each, in C order.

    Whole rows along the leading axis where a row fits; otherwise one index along the leading
    axes and a run along the first axis whose trailing rows fit (at least one element).
    """
    if not shape or 0 in shape:
        yield tuple(slice(0, n) for n in shape)
        return
    window = max(window_bytes, itemsize)
    axis = 0
    while axis < len(shape) - 1 and int(np.prod(shape[axis + 1 :])) * itemsize > window:
        axis += 1
    row_bytes = int(np.prod(shape[axis + 1 :])) * itemsize
    step = max(1, window // row_bytes)
    tail = tuple(slice(0, n) for n in shape[axis + 1 :])
    for lead in itertools.product(*(range(n) for n in shape[:axis])):
        head = tuple(slice(i, i + 1) for i in lead)
        for start in range(0, shape[axis], step):
            yield (*head, slice(start, min(start + step, shape[axis])), *tail)


def on_host(array: jax.Array) -> bool:
    """Whether `array`'s shards are in host memory (CPU devices): there `np.asarray(shard.data)`
    is the shard's own buffer, no copy, and a sink writes each shard whole from it."""
    return all(device.platform == "cpu" for device in array.sharding.device_set)  # type: ignore[attr-defined]


def shard_regions(
    array: jax.Array,
    shards: Iterable[jax.Shard],
    window_bytes: int = DEFAULT_WINDOW_BYTES,
    whole: bool = False,
) -> Iterator[Region]:
    """The given shards of `array` as host blocks of at most `window_bytes`, global indices.

    `whole` (for arrays `on_host`): each shard is one region, its block the shard's own memory
    (read-only, no copy).
    """
    itemsize = np.dtype(array.dtype).itemsize
    for shard in shards:
        origin = normalized(shard.index, array.shape)
        data = shard.data
        if whole:
            yield Region(origin, np.asarray(data))
            continue
        for local in windows(tuple(data.shape), itemsize, window_bytes):
            block = np.asarray(jax.device_get(_cut(data, local)))
            index = tuple(
                slice(o.start + w.start, o.start + w.stop)
                for o, w in zip(origin, local, strict=True)
            )
            yield Region(index, block)
            del block


def iter_regions(array: jax.Array, window_bytes: int = DEFAULT_WINDOW_BYTES) -> Iterator[Region]:
    """Every distinct region this process holds of `array`, as host blocks of at most
    `window_bytes` (the default: 256 MiB), each with its global index.

    The blocks of all processes together cover the array; under `jax.distributed` a region that
    several processes hold is yielded on each of them (a sink that has one writer decides who
    writes it).
    """
    yield from shard_regions(array, distinct_shards(array), window_bytes)


def region_key(index: Index) -> str:
    """`index` as text: `0-4.0-8` (start-stop per axis)."""
    return ".".join(f"{s.start}-{s.stop}" for s in index)


def parse_region_key(text: str) -> Index:
    return tuple(slice(*map(int, b.split("-"))) for b in text.split(".") if b)


def own_shards(array: jax.Array) -> list[jax.Shard]:
    """The distinct shards this process writes (`writer_of`), each from its lowest replica here."""
    me = jax.process_index()
    owner = _owners(array)
    return [
        shard
        for shard in distinct_shards(array)
        if owner[_key(normalized(shard.index, array.shape))] == me
    ]


def due_windows(
    shape: tuple[int, ...],
    dtype: Any,
    sharding: jax.sharding.Sharding,
    process: int,
    window_bytes: int,
    fully_addressable: bool,
    whole: bool = False,
) -> list[Index]:
    """The windows (global indices) that `process` writes of an array of `shape`, `dtype` and
    `sharding`, as `shard_regions(array, own_shards(array), window_bytes, whole)` yields them
    there: computed from the sharding alone, so process 0 can check every process's part."""
    owner = _owners_of(shape, sharding, fully_addressable)
    itemsize = np.dtype(dtype).itemsize
    due = []
    for key in sorted(k for k, p in owner.items() if p == process):
        origin = tuple(slice(a, b) for a, b in key)
        local_shape = tuple(b - a for a, b in key)
        if whole:
            due.append(origin)
            continue
        for local in windows(local_shape, itemsize, window_bytes):
            due.append(
                tuple(
                    slice(o.start + w.start, o.start + w.stop)
                    for o, w in zip(origin, local, strict=True)
                )
            )
    return due


def _owners(array: jax.Array) -> dict[tuple[tuple[int, int], ...], int]:
    return _owners_of(tuple(array.shape), array.sharding, array.is_fully_addressable)


def _owners_of(
    shape: tuple[int, ...], sharding: jax.sharding.Sharding, fully_addressable: bool
) -> dict[tuple[tuple[int, int], ...], int]:
    """Each distinct region of an array -> the process that writes it: the lowest process that
    holds it; every region of a process-local array (each process holds all of it): process 0."""
    owner: dict[tuple[tuple[int, int], ...], int] = {}
    for device, index in sharding.devices_indices_map(shape).items():
        key = _key(normalized(index, shape))
        process = 0 if fully_addressable else int(device.process_index)  # type: ignore[attr-defined]
        owner[key] = min(owner.get(key, process), process)
    return owner


def _key(index: Index) -> tuple[tuple[int, int], ...]:
    return tuple((s.start, s.stop) for s in index)


def _cut(data: jax.Array, local: Index) -> jax.Array:
    """`data[local]`, sliced on its device (only the window is copied to the host).

    One compiled slice per (shape, dtype, window size): the start is a traced argument, so every
    window of one size reuses it.
    """
    if all(s.start == 0 and s.stop == n for s, n in zip(local, data.shape, strict=True)):
        return data
    sizes = tuple(s.stop - s.start for s in local)
    starts = tuple(np.int32(s.start) for s in local)
    return _slicer(sizes)(data, *starts)


@functools.lru_cache(maxsize=256)
def _slicer(sizes: tuple[int, ...]) -> Callable[..., jax.Array]:
    return jax.jit(lambda data, *starts: jax.lax.dynamic_slice(data, starts, sizes))
