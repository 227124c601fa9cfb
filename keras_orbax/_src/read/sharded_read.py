"""Reading the arrays of one step onto their target shardings, each shard straight onto its device.

Two paths, chosen per array:
- Fast format (`_fast_format`): each distinct shard this process's devices need is read once from the
  saved shard files, exactly its bytes, into an aligned host buffer that the device adopts; devices
  that hold the same shard share that read. Any target layout: a shard that matches a saved one is one
  `preadv`; regions that cut the same saved rows are read together (`_coalesce`); small arrays, each
  one file, are read many at once (`_small_files`) and cut on the calling thread. The regions of
  all arrays are read ahead by a pool of threads, in waves of a byte budget (`_read_ahead`).
- Orbax: the `"compact"` format and anything else, with a `jax.ShapeDtypeStruct` target,
  so tensorstore reads only the chunks each device needs.
Either way no host or device ever holds a full copy of a sharded array. Where several processes hold
replicas of a region, `replicas.share` lets one of them read it and the others receive it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import re
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, cast

import jax
import numpy as np
import orbax.checkpoint.experimental.v1 as ocp
import tensorstore as ts

from keras_orbax._src.compat import orbax_compat
from keras_orbax._src.format.dtypes import np_dtype
from keras_orbax._src.format.read_checks import ReadChecks
from keras_orbax._src.format.step_record import STATE, VariableRecord
from keras_orbax._src.format.zarr_shards import FastArray
from keras_orbax._src.model import state_keys
from keras_orbax._src.model.matching import ReadRequest
from keras_orbax._src.read import replicas
from keras_orbax._src.read.contiguous import ComputedArray
from keras_orbax._src.read.read_ahead import (
    batched,
    read_ahead,
    region_bytes,
    units_of,
)
from keras_orbax._src.runtime import quiet
from keras_orbax._src.runtime.progress import Progress
from keras_orbax._src.storage import locations
from keras_orbax._src.storage.byte_runs import ArrayReader, Index, bounds
from keras_orbax._src.storage.small_files import SmallFiles
from keras_orbax.errors import CorruptCheckpointError

_TS_BYTES_READ = "/tensorstore/kvstore/"
# Bytes from storage itself (not from a layer over it, such as OCDBT, which would count them twice).
_TS_STORAGE_BYTES_READ = {f"/tensorstore/kvstore/{d}/bytes_read" for d in ("file", "gcs", "s3")}


@dataclasses.dataclass(frozen=True)
class ReadPlan:
    """How this process will read each array of one step; the files it needs checked already."""

    step_dir: Path
    fast: list[tuple[ReadRequest, ArrayReader, list[Index]]]  # with the regions this process reads
    via_orbax: list[ReadRequest]
    checkpointable: str = STATE  # the Orbax checkpointable holding the arrays read via Orbax
    tree_paths: dict[str, str] | None = None  # key -> path in that tree, where it is not the key
    shared: Mapping[str, replicas.Sharing] = dataclasses.field(default_factory=dict)
    checks: ReadChecks | None = None  # what `finish`es checking the bytes read (`verify`)

    @property
    def received_bytes(self) -> int:
        """Bytes of regions this process's devices get from other processes instead of storage."""
        return sum(sharing.received for sharing in self.shared.values())


def plan_reads(
    step_dir: Path,
    requests: Sequence[ReadRequest],
    opener: Callable[[VariableRecord], ArrayReader] | None = None,
) -> ReadPlan:
    """Chooses the read path of each array and checks the files this process will read.

    `opener` gives the `ArrayReader` of each array of another source (`.weights.h5`, ...). Without
    it, arrays are read from the keras-orbax step at `step_dir` (`FastArray`, or through Orbax
    where the fast format does not apply).

    Raises:
        CorruptCheckpointError: a shard file this process needs is missing or truncated.
    """
    fast: list[tuple[ReadRequest, ArrayReader, list[Index]]] = []
    via_orbax: list[ReadRequest] = []
    regions: dict[tuple[Any, tuple[int, ...]], list[Index]] = {}  # many arrays share both
    state = step_dir / STATE
    base = os.fspath(state)
    spec_paths = [f"{base}/{request.record.array}/zarr.json" for request in requests]
    specs = None if opener or locations.is_remote(step_dir) else SmallFiles()
    if specs is not None:  # read all at once: thousands of arrays, thousands of files
        for path in spec_paths:
            specs.start(path)
    for request, spec_path in zip(requests, spec_paths, strict=True):
        if request.record.nbytes == 0:  # a zero-size variable: nothing is stored, nothing to read
            array: ArrayReader | None = EmptyArray(request.record.shape)
        elif opener:
            array = opener(request.record)
        elif specs is not None:
            try:
                spec = specs.get(spec_path)
            except OSError:  # Orbax reads it, or says what is wrong
                spec = None
            array = FastArray.from_spec(state / request.record.array, request.record, spec)
        else:
            array = FastArray.open(step_dir, request.record)
        if array is None:
            via_orbax.append(request)
        else:
            layout = (request.target.sharding, request.target.shape)
            if layout not in regions:
                regions[layout] = request.local_indices()
            indices = regions[layout]
            array.check(indices)
            fast.append((request, array, indices))
    return ReadPlan(step_dir, fast, via_orbax)


@dataclasses.dataclass(frozen=True)
class EmptyArray:
    """The reader of a zero-size variable: every region is empty."""

    shape: tuple[int, ...]

    def check(self, indices: list[Index]) -> None:
        return None

    def read(self, index: Index, dtype: np.dtype) -> np.ndarray:
        return np.empty(
            [len(range(*s.indices(n))) for s, n in zip(index, self.shape, strict=True)], dtype
        )


DEFAULT_WINDOW_BYTES = 512 << 20


def read_arrays(
    plan: ReadPlan,
    *,
    max_workers: int | None = None,
    window_bytes: int | None = None,
    show_progress: bool = False,
) -> tuple[dict[str, jax.Array], int]:
    """Reads every planned array; returns them by key and the bytes this process read.

    Regions are read by a pool of threads across all arrays at once, at most `window_bytes` ahead
    of being put on their devices (default: 512 MiB or the largest region, whichever is larger;
    one region always goes; `read_ahead` reads in waves). So host memory for reads stays
    within the window plus the regions of the one array being placed (which, on the CPU backend,
    are the devices' own buffers). Collective when some arrays go through Orbax (the compact
    format) or `plan.shared` holds some (one process reads each replicated region, the others
    receive it, a window of arrays at a time): call on every process. `show_progress` draws bytes
    read and the rate on a terminal.

    Raises:
        CorruptCheckpointError: an array file is unreadable.
    """
    # Planned as they are read (`read_ahead` takes them a wave ahead): the first reads start
    # once the first arrays are planned, not all of them.
    units = batched(
        unit for request, array, indices in plan.fast for unit in units_of(request, array, indices)
    )
    arrays: dict[str, jax.Array] = {}
    bytes_read = 0
    workers = max_workers or min(16, 4 * (os.cpu_count() or 1))
    sizes = [region_bytes(request, index) for request, _, indices in plan.fast for index in indices]
    window = window_bytes or max([DEFAULT_WINDOW_BYTES, *sizes])  # one region always goes
    # Closed on any error: its pools stop reading and let go of their buffers now, not when the
    # traceback holding this frame is freed.
    reading = contextlib.closing(read_ahead(units, workers, window))
    exchange = replicas.Exchange(plan, window_bytes or DEFAULT_WINDOW_BYTES)  # same everywhere
    error: Exception | None = None
    with (
        reading as pieces,
        Progress("restore_sharded", sum(sizes), enabled=show_progress) as progress,
    ):
        for request, _, indices in plan.fast:
            sharing = plan.shared.get(request.record.key)
            read = []
            try:
                if error is None:
                    read = [next(pieces) for _ in indices]
                    progress.advance(sum(data.nbytes for _, data in read))
                    if read:
                        bytes_read += _place(request, read, arrays, shared=sharing is not None)
            except Exception as caught:  # held until every process hears of it: see below
                if not plan.shared:
                    raise
                error = caught
            if sharing is not None:  # a collective: every process gets here, or raises with all
                regions = {repr(index): data for (_, _, index), data in read}
                arrays.update(exchange.add(request, regions, error))
    if error is not None:
        raise error
    if plan.checks is not None:  # the files regions cut, once every piece of them is read
        plan.checks.finish()
    if plan.via_orbax:
        loaded, nbytes = _read_with_orbax(
            plan.step_dir, plan.via_orbax, plan.checkpointable, plan.tree_paths or {}
        )
        arrays.update(loaded)
        bytes_read += nbytes
    return arrays, bytes_read


def _place(
    request: ReadRequest, read: list, arrays: dict[str, jax.Array], *, shared: bool = False
) -> int:
    """Puts one array's regions on their devices (unless `shared`: the `Exchange` does); returns
    the bytes read from storage for it."""
    regions = {repr(index): data for (_, _, index), data in read}
    if not shared:
        arrays[request.record.key] = _on_devices(request, regions)
    reader = read[0][0][1]
    if isinstance(reader, ComputedArray):  # a value computed on the host: every region is read
        reader.release()
    return sum(data.size for data in regions.values()) * np_dtype(request.record.dtype).itemsize


def _on_devices(request: ReadRequest, regions: dict[str, np.ndarray]) -> jax.Array:
    """One call puts every region on the devices that hold it (adopted without a copy on CPU);
    devices that hold the same region get the same buffer."""
    target = request.target
    devices, keys, shapes = _device_regions(target.sharding, target.shape)
    values = [regions[key] for key in keys]
    wrong = [
        f"{v.shape} {v.dtype}"
        for v, shape in zip(values, shapes, strict=True)
        if v.shape != shape or v.dtype != target.dtype
    ]
    if wrong:  # nothing checks this further down: a region of another shape would be misread
        raise CorruptCheckpointError(
            f"{request.record.key}: read regions {', '.join(wrong[:4])} where the devices hold "
            f"{shapes[0]} {target.dtype}. No variable was modified."
        )
    return orbax_compat.put_on_devices(target, values, devices)


@functools.lru_cache(maxsize=1024)
def _device_regions(
    sharding: jax.sharding.Sharding, shape: tuple[int, ...]
) -> tuple[list, list[str], list[tuple[int, ...]]]:
    """This process's devices of `sharding`, and for each, `repr` and shape of the region it holds."""
    mapping = sharding.addressable_devices_indices_map(shape)
    shapes = [tuple(hi - lo for lo, hi in bounds(cast(Index, i), shape)) for i in mapping.values()]
    return list(mapping), [repr(index) for index in mapping.values()], shapes


def _read_with_orbax(
    step_dir: Path,
    requests: Sequence[ReadRequest],
    checkpointable: str = STATE,
    tree_paths: dict[str, str] | None = None,
) -> tuple[dict[str, jax.Array], int]:
    paths = {r.record.key: (tree_paths or {}).get(r.record.key, r.record.key) for r in requests}
    abstract = state_keys.nest({paths[r.record.key]: r.target for r in requests})
    before = _tensorstore_bytes_read()
    try:
        context = ocp.Context()
        context.pytree.loading.partial_load = True
        with context, quiet.no_data_files_notices():
            loaded = ocp.load(step_dir, abstract, checkpointable_name=checkpointable)
    except Exception as error:  # tensorstore raises plain Exceptions; re-raised, never swallowed
        keys = ", ".join(r.record.key for r in requests[:10])
        more = f" and {len(requests) - 10} more" if len(requests) > 10 else ""
        raise CorruptCheckpointError(
            f"Cannot read arrays of checkpoint step '{step_dir}' ({keys}{more}): "
            f"{_tensorstore_reason(error)}. No variable was modified."
        ) from error
    flat = state_keys.flatten(loaded, list(paths.values()))
    return {key: flat[path] for key, path in paths.items()}, _tensorstore_bytes_read() - before


_TS_SPEC = re.compile(
    r" ?\[tensorstore_spec(?:\[\d+\])?='(?:[^'\\]|\\.)*'\]"
)  # the store's whole spec


def _tensorstore_reason(error: BaseException) -> str:
    """Tensorstore's message without the dump of the whole store's spec it appends."""
    reason = str(error).split("See full TensorStore details")[0]
    reason = _TS_SPEC.sub("", reason).strip().rstrip(".;:,")
    return reason if len(reason) <= 600 else reason[:600] + " ..."


def _tensorstore_bytes_read() -> int:
    metrics = ts.experimental_collect_matching_metrics(_TS_BYTES_READ)
    return sum(
        int(v.get("value", 0))
        for m in metrics
        if m["name"] in _TS_STORAGE_BYTES_READ
        for v in m.get("values", [])
    )
