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
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint.experimental.v1 as ocp
import tensorstore as ts

from keras_orbax import _keys
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
        return [index for index, _ in _devices_by_index(self)]


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

    Fast-format shards are read by a pool of threads across all arrays at once, each handed to its
    devices as soon as it is read, so few host buffers are in flight where a device copies them.
    Collective when some arrays go through Orbax (the compact format): call on every process.

    Raises:
        CorruptCheckpointError: an array file is unreadable.
    """
    tasks = [
        (request, array, index, devices)
        for request, array in plan.fast
        for index, devices in _devices_by_index(request)
    ]
    workers = max_workers or min(16, 4 * (os.cpu_count() or 1))
    with ThreadPoolExecutor(workers) as pool:
        pieces = list(pool.map(lambda task: _read_piece(*task), tasks))
    shards: dict[str, dict[Any, jax.Array]] = {r.record.key: {} for r, _ in plan.fast}
    bytes_read = 0
    for (request, _, _, _), (on_devices, nbytes) in zip(tasks, pieces, strict=True):
        shards[request.record.key].update(on_devices)
        bytes_read += nbytes
    arrays = {
        request.record.key: _assemble(request, shards[request.record.key])
        for request, _ in plan.fast
    }
    if plan.via_orbax:
        loaded, nbytes = _read_with_orbax(plan.step_dir, plan.via_orbax)
        arrays.update(loaded)
        bytes_read += nbytes
    return arrays, bytes_read


def _devices_by_index(request: ReadRequest) -> list[tuple[Index, list[jax.Device]]]:
    """This process's devices grouped by the region of the array each holds, in a stable order."""
    mapping = request.target.sharding.addressable_devices_indices_map(request.target.shape)
    grouped: dict[str, tuple[Index, list[jax.Device]]] = {}  # by repr: slices are not hashable
    for device, index in mapping.items():
        grouped.setdefault(repr(index), (index, []))[1].append(device)
    return list(grouped.values())


def _read_piece(
    request: ReadRequest, array: FastArray, index: Index, devices: list[jax.Device]
) -> tuple[dict[jax.Device, jax.Array], int]:
    """One region read once and put on every device that holds it; the bytes read."""
    data = array.read(index, np.dtype(request.target.dtype))
    on_devices = jax.device_put([data] * len(devices), devices)
    return dict(zip(devices, on_devices, strict=True)), math.prod(data.shape) * array.dtype.itemsize


def _assemble(request: ReadRequest, on_devices: dict[jax.Device, jax.Array]) -> jax.Array:
    sharding, shape = request.target.sharding, request.target.shape
    ordered = [on_devices[device] for device in sharding.addressable_devices_indices_map(shape)]
    return jax.make_array_from_single_device_arrays(shape, sharding, ordered)


def _read_with_orbax(
    step_dir: Path, requests: Sequence[ReadRequest]
) -> tuple[dict[str, jax.Array], int]:
    abstract = _keys.nest({r.record.key: r.target for r in requests})
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
    flat = _keys.flatten(loaded, [r.record.key for r in requests])
    return flat, _tensorstore_bytes_read() - before


def _tensorstore_bytes_read() -> int:
    metrics = ts.experimental_collect_matching_metrics(_TS_BYTES_READ)
    return sum(int(v.get("value", 0)) for m in metrics for v in m.get("values", []))
