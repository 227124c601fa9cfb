"""Reading the arrays of one step onto their target shardings, each shard straight onto its device.

Two paths, chosen per array:
- Fast format (`_fast_format`): each distinct shard this process's devices need is read once from the
  saved shard files, exactly its bytes, into an aligned host buffer that the device adopts; devices
  that hold the same shard share that read. Any target layout: a shard that matches a saved one is one
  `preadv`.
- Orbax: the `"compact"` format, remote paths and anything else, with a `jax.ShapeDtypeStruct` target,
  so tensorstore reads only the chunks each device needs.
Either way no host or device ever holds a full copy of a sharded array.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint.experimental.v1 as ocp
import tensorstore as ts

from keras_orbax._fast_format import FastArray, Index
from keras_orbax._metadata import STATE, VariableRecord
from keras_orbax.errors import CorruptCheckpointError

_TS_BYTES_READ = "/tensorstore/kvstore/file/bytes_read"


@dataclasses.dataclass(frozen=True)
class ReadRequest:
    """One array to read: what is on disk and what the variable needs."""

    record: VariableRecord
    target: jax.ShapeDtypeStruct  # the variable's shape, stored dtype and target sharding

    def local_indices(self) -> list[Index]:
        """The distinct regions this process's devices hold, in a stable order."""
        mapping = self.target.sharding.addressable_devices_indices_map(self.target.shape)
        return list({repr(index): index for index in mapping.values()}.values())


@dataclasses.dataclass(frozen=True)
class ReadPlan:
    """How this process will read each array of one step; the files it needs checked already."""

    step_dir: Path
    fast: list[tuple[ReadRequest, FastArray]]
    via_orbax: list[ReadRequest]


def plan_reads(step_dir: Path, requests: Sequence[ReadRequest]) -> ReadPlan:
    """Chooses the read path of each array and checks the files this process will read.

    Raises:
        CorruptCheckpointError: a shard file this process needs is missing or truncated.
    """
    fast, via_orbax = [], []
    for request in requests:
        array = FastArray.open(step_dir, request.record)
        if array is None:
            via_orbax.append(request)
        else:
            array.check(request.local_indices())
            fast.append((request, array))
    return ReadPlan(step_dir, fast, via_orbax)


def read_arrays(
    plan: ReadPlan, *, max_workers: int | None = None
) -> tuple[dict[str, jax.Array], int]:
    """Reads every planned array; returns them by key and the bytes this process read.

    Collective when some arrays go through Orbax (the compact format): call on every process.

    Raises:
        CorruptCheckpointError: an array file is unreadable.
    """
    arrays: dict[str, jax.Array] = {}
    bytes_read = 0
    workers = max_workers or min(16, 4 * (os.cpu_count() or 1))
    with ThreadPoolExecutor(workers) as pool:
        for request, array in plan.fast:
            arrays[request.record.key], nbytes = _read_fast(request, array, pool.map)
            bytes_read += nbytes
    if plan.via_orbax:
        loaded, nbytes = _read_with_orbax(plan.step_dir, plan.via_orbax)
        arrays.update(loaded)
        bytes_read += nbytes
    return arrays, bytes_read


def _read_fast(request: ReadRequest, array: FastArray, map_fn: Callable) -> tuple[jax.Array, int]:
    sharding, shape = request.target.sharding, request.target.shape
    indices = request.local_indices()
    dtype = np.dtype(request.target.dtype)
    buffers = dict(
        zip(map(repr, indices), map_fn(lambda i: array.read(i, dtype), indices), strict=True)
    )
    by_device = sharding.addressable_devices_indices_map(shape)
    shards = [jax.device_put(buffers[repr(index)], device) for device, index in by_device.items()]
    nbytes = sum(math.prod(b.shape) for b in buffers.values()) * array.dtype.itemsize
    return jax.make_array_from_single_device_arrays(shape, sharding, shards), nbytes


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
