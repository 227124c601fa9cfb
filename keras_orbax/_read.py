"""Reading the arrays of one step onto their target shardings, each shard straight onto its device.

Two paths, chosen per array:
- Fast format (`_fast_format`): each distinct shard this process's devices need is read once from the
  saved shard files, exactly its bytes, into an aligned host buffer that the device adopts; devices
  that hold the same shard share that read. Any target layout: a shard that matches a saved one is one
  `preadv`; regions that cut the same saved rows are read together (`_coalesce`); small arrays, each
  one file, are read many at once (`_small_files`) and cut on the calling thread.
- Orbax: the `"compact"` format and anything else, with a `jax.ShapeDtypeStruct` target,
  so tensorstore reads only the chunks each device needs.
Either way no host or device ever holds a full copy of a sharded array. Where several processes hold
replicas of a region, `_replicas.share` lets one of them read it and the others receive it.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, cast

import jax
import numpy as np
import orbax.checkpoint.experimental.v1 as ocp
import tensorstore as ts

from keras_orbax import _coalesce, _compat_orbax, _keys, _replicas, _storage
from keras_orbax._contiguous import ContiguousArray
from keras_orbax._dtypes import np_dtype
from keras_orbax._fast_format import FastArray, WholeFileReader
from keras_orbax._metadata import STATE, VariableRecord
from keras_orbax._progress import Progress
from keras_orbax._runs import Index, bounds
from keras_orbax._small_files import SmallFiles
from keras_orbax.errors import CorruptCheckpointError

_TS_BYTES_READ = "/tensorstore/kvstore/"
# Bytes from storage itself (not from a layer over it, such as OCDBT, which would count them twice).
_TS_STORAGE_BYTES_READ = {f"/tensorstore/kvstore/{d}/bytes_read" for d in ("file", "gcs", "s3")}
_Task = tuple["ReadRequest", Any, Index]  # one region of one array (a FastArray or other reader)


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
    fast: list[tuple[ReadRequest, Any, list[Index]]]  # with the regions this process reads
    via_orbax: list[ReadRequest]
    checkpointable: str = STATE  # the Orbax checkpointable holding the arrays read via Orbax
    tree_paths: dict[str, str] | None = None  # key -> path in that tree, where it is not the key
    shared: Mapping[str, _replicas.Sharing] = dataclasses.field(default_factory=dict)

    @property
    def received_bytes(self) -> int:
        """Bytes of regions this process's devices get from other processes instead of storage."""
        return sum(sharing.received for sharing in self.shared.values())


def plan_reads(
    step_dir: Path,
    requests: Sequence[ReadRequest],
    opener: Callable[[VariableRecord], Any] | None = None,
) -> ReadPlan:
    """Chooses the read path of each array and checks the files this process will read.

    `opener` gives the reader of each array of another source (`.weights.h5`, ...): anything with
    `check(indices)` and `read(index, dtype)`, as `FastArray`. Without it, arrays are read from the
    keras-orbax step at `step_dir`.

    Raises:
        CorruptCheckpointError: a shard file this process needs is missing or truncated.
    """
    fast, via_orbax = [], []
    regions: dict[tuple[Any, tuple[int, ...]], list[Index]] = {}  # many arrays share both
    state = step_dir / STATE
    base = os.fspath(state)
    spec_paths = [f"{base}/{request.record.array}/zarr.json" for request in requests]
    specs = None if opener or _storage.is_remote(step_dir) else SmallFiles()
    if specs is not None:  # read all at once: thousands of arrays, thousands of files
        for path in spec_paths:
            specs.start(path)
    for request, spec_path in zip(requests, spec_paths, strict=True):
        if request.record.nbytes == 0:  # a zero-size variable: nothing is stored, nothing to read
            array: Any = EmptyArray(request.record.shape)
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

    Regions are read by a pool of threads across all arrays at once, in waves of at most
    `window_bytes` (default: 512 MiB or the largest region, whichever is larger; one region always
    goes), each wave read before its arrays are put on their devices. So host memory for reads stays
    within the window plus the regions of the one array being placed (which, on the CPU backend,
    are the devices' own buffers). Collective when some arrays go through Orbax (the compact
    format) or `plan.shared` holds some (one process reads each replicated region, the others
    receive it, a window of arrays at a time): call on every process. `show_progress` draws bytes
    read and the rate on a terminal.

    Raises:
        CorruptCheckpointError: an array file is unreadable.
    """
    units = _batched(
        [unit for request, array, indices in plan.fast for unit in _units(request, array, indices)]
    )
    arrays: dict[str, jax.Array] = {}
    bytes_read = 0
    workers = max_workers or min(16, 4 * (os.cpu_count() or 1))
    # A unit of at most _BATCH_BYTES holds no region larger than the default window.
    largest = [_region_bytes(r, i) for u in units if u.size > _BATCH_BYTES for r, _, i in u.tasks]
    window = window_bytes or max([DEFAULT_WINDOW_BYTES, *largest])
    pieces = _read_ahead(units, workers, window)
    exchange = _replicas.Exchange(plan, window_bytes or DEFAULT_WINDOW_BYTES)  # same everywhere
    error: Exception | None = None
    with Progress("restore_sharded", sum(u.size for u in units), enabled=show_progress) as progress:
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
    release = getattr(read[0][0][1], "release", None)
    if release is not None:  # a value computed on the host: every region is read
        release()
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
    return _compat_orbax.put_on_devices(target, values, devices)


@functools.lru_cache(maxsize=1024)
def _device_regions(
    sharding: jax.sharding.Sharding, shape: tuple[int, ...]
) -> tuple[list, list[str], list[tuple[int, ...]]]:
    """This process's devices of `sharding`, and for each, `repr` and shape of the region it holds."""
    mapping = sharding.addressable_devices_indices_map(shape)
    shapes = [tuple(hi - lo for lo, hi in bounds(cast(Index, i), shape)) for i in mapping.values()]
    return list(mapping), [repr(index) for index in mapping.values()], shapes


@dataclasses.dataclass(frozen=True)
class Unit:
    """Regions that the reading threads read together: small regions one after another by one
    thread (`tasks` alone, see `_batched`), or several regions of one array that cut the same
    stored rows (`together`, `_coalesce`)."""

    tasks: list[_Task]
    together: _coalesce.Together | None = None
    size: int = -1  # bytes of its regions; worked out here unless given

    def __post_init__(self) -> None:
        if self.size < 0:
            size = sum(_region_bytes(request, index) for request, _, index in self.tasks)
            object.__setattr__(self, "size", size)

    @property
    def is_small(self) -> bool:
        """Small regions of local files: reading them is mostly Python, not waiting on storage
        (object storage is: its requests want many threads in flight)."""
        return (
            self.together is None
            and self.size <= _BATCH_BYTES
            and not any(_storage.is_remote(getattr(a, "directory", "")) for _, a, _ in self.tasks)
        )

    def start(self, pool: ThreadPoolExecutor, files: SmallFiles) -> Callable[[], list[np.ndarray]]:
        """Submits the reads to `pool`, or has `files` read small arrays' files (then the regions
        are cut on the calling thread); returns what waits for the regions, in the order of
        `tasks`."""
        if self.together is None:
            readers = {id(a): a for _, a, _ in self.tasks}.values()  # one per array
            if self.is_small and all(isinstance(a, WholeFileReader) for a in readers):
                for reader in readers:
                    reader.start(files)
                return functools.partial(_read_each, self.tasks)
            return pool.submit(_read_each, self.tasks).result
        dtype = np.dtype(self.tasks[0][0].target.dtype)
        together = self.together
        futures = [pool.submit(job) for job in together.jobs()]

        def regions() -> list[np.ndarray]:
            for future in futures:
                future.result()
            return together.regions(dtype)

        return regions


def _units(request: ReadRequest, array: Any, indices: list[Index]) -> list[Unit]:
    """The regions `indices` of one array: read together where they cut the same stored rows, else
    each alone."""
    if WholeFileReader.tiles(array, indices) and array.chunk_bytes <= _BATCH_BYTES:
        whole = WholeFileReader(array, len(indices))  # kept in one unit: read by one thread
        size = math.prod(array.shape) * np.dtype(request.target.dtype).itemsize
        return [Unit([(request, whole, index) for index in indices], size=size)]
    one_shard_each = isinstance(array, FastArray) and all(map(array.is_one_shard, indices))
    if isinstance(array, FastArray | ContiguousArray) and len(indices) > 1 and not one_shard_each:
        together = _coalesce.plan(array.blocks, array.shape, array.dtype, indices)
        if together is not None:
            return [Unit([(request, array, index) for index in indices], together)]
    return [Unit([(request, array, index)]) for index in indices]


def _read_each(tasks: list[_Task]) -> list[np.ndarray]:
    return [array.read(index, np.dtype(request.target.dtype)) for request, array, index in tasks]


_BATCH_BYTES, _BATCH_REGIONS = 1 << 20, 64
# Threads for batches of small regions of arrays kept in several files (an array in one file is read
# by `SmallFiles`, its regions cut on the calling thread): each region costs some 20 us of Python
# around a short read, so more threads only pass the GIL around (5000 variables, 12,500 regions in
# the page cache: 1.41 s with 16 threads, 1.13-1.22 s with 4, 1.03-1.08 s with 2, 1.02 s with 1);
# a few keep reads of files not in the page cache overlapping.
_SMALL_WORKERS = 2


def _batched(units: list[Unit]) -> list[Unit]:
    """Consecutive single regions joined into units of up to `_BATCH_REGIONS` regions and
    `_BATCH_BYTES`: a future per small region costs more in the pool's lock than its read (5000
    variables, 12,500 regions: 0.55 s waiting on the lock)."""
    batched: list[Unit] = []
    tasks: list[_Task] = []
    nbytes = 0
    for unit in units:
        joins = unit.together is None and unit.size <= _BATCH_BYTES
        if tasks and (
            not joins or len(tasks) == _BATCH_REGIONS or nbytes + unit.size > _BATCH_BYTES
        ):
            batched.append(Unit(tasks, size=nbytes))
            tasks, nbytes = [], 0
        if joins:
            tasks += unit.tasks
            nbytes += unit.size
        else:
            batched.append(unit)
    if tasks:
        batched.append(Unit(tasks, size=nbytes))
    return batched


def _read_ahead(units: list[Unit], workers: int, window: int) -> Iterator[tuple[_Task, np.ndarray]]:
    """Each region of each unit, in order, read by a pool of threads (small arrays' files by
    `SmallFiles`, then cut on this thread) in waves of at most `window` bytes (at least one unit
    each).

    A wave is read whole before any of its regions is handed on: placing arrays on their devices
    while the readers run makes the two pass the GIL back and forth (a device put waits for it each
    time it comes back from C++), which cost more than the reads themselves with thousands of
    small variables (12,500 regions: 0.6 s of placing where 0.2 s does it alone).
    """
    sizes = [unit.size for unit in units]
    files = SmallFiles()
    with (
        ThreadPoolExecutor(workers) as pool,
        ThreadPoolExecutor(min(workers, _SMALL_WORKERS)) as small_pool,
    ):
        following = 0
        while following < len(units):
            wave: list[tuple[Unit, Callable[[], list[np.ndarray]]]] = []
            nbytes = 0
            while following < len(units) and (not wave or nbytes + sizes[following] <= window):
                unit = units[following]
                wave.append((unit, unit.start(small_pool if unit.is_small else pool, files)))
                nbytes += sizes[following]
                following += 1
            read = [regions() for _, regions in wave]
            for (unit, _), regions in zip(wave, read, strict=True):
                yield from zip(unit.tasks, regions, strict=True)


def _region_bytes(request: ReadRequest, index: Index) -> int:
    shape = request.target.shape
    counts = [len(range(*s.indices(n))) for s, n in zip(index, shape, strict=True)]
    return math.prod(counts) * np.dtype(request.target.dtype).itemsize


def _read_with_orbax(
    step_dir: Path,
    requests: Sequence[ReadRequest],
    checkpointable: str = STATE,
    tree_paths: dict[str, str] | None = None,
) -> tuple[dict[str, jax.Array], int]:
    paths = {r.record.key: (tree_paths or {}).get(r.record.key, r.record.key) for r in requests}
    abstract = _keys.nest({paths[r.record.key]: r.target for r in requests})
    before = _tensorstore_bytes_read()
    try:
        context = ocp.Context()
        context.pytree.loading.partial_load = True
        with context:
            loaded = ocp.load(step_dir, abstract, checkpointable_name=checkpointable)
    except Exception as error:  # tensorstore raises plain Exceptions; re-raised, never swallowed
        keys = ", ".join(r.record.key for r in requests[:10])
        raise CorruptCheckpointError(
            f"Cannot read arrays of checkpoint step '{step_dir}' ({keys}): {error}. "
            "No variable was modified."
        ) from error
    flat = _keys.flatten(loaded, list(paths.values()))
    return {key: flat[path] for key, path in paths.items()}, _tensorstore_bytes_read() - before


def _tensorstore_bytes_read() -> int:
    metrics = ts.experimental_collect_matching_metrics(_TS_BYTES_READ)
    return sum(
        int(v.get("value", 0))
        for m in metrics
        if m["name"] in _TS_STORAGE_BYTES_READ
        for v in m.get("values", [])
    )
