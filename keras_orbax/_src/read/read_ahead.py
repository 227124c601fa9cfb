"""Reading the regions of many arrays ahead of placing them: grouped into units, read by a pool of
threads in waves of a byte budget (`read_arrays` in `_read` places each array as its regions come).

A unit is what one thread reads at once: one region, several regions of an array that cut the
same stored rows (`coalesce`), or a batch of small regions (a future each would cost more than
its read). Small arrays kept in one file are read by `SmallFiles` and cut on the calling thread.
Units whose regions go in short runs are read by one thread per core (`Unit.is_cpu_bound`).

```python
units = batched([u for r, a, indices in plan.fast for u in units_of(r, a, indices)])
for (request, array, index), region in read_ahead(units, workers=8, window=512 << 20):
    ...  # regions come in the order of `units`
```
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
from collections.abc import Callable, Generator
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import TYPE_CHECKING, Any

import numpy as np

from keras_orbax._src.format.zarr_shards import FastArray
from keras_orbax._src.read import coalesce
from keras_orbax._src.read.contiguous import ContiguousArray
from keras_orbax._src.read.whole_file import WholeFileReader
from keras_orbax._src.runtime import thread_pools
from keras_orbax._src.storage import locations
from keras_orbax._src.storage.byte_runs import Index, bounds, short_runs
from keras_orbax._src.storage.small_files import SmallFiles

if TYPE_CHECKING:
    from keras_orbax._src.model.matching import ReadRequest

Task = tuple["ReadRequest", Any, Index]  # one region of one array (a FastArray or other reader)


@dataclasses.dataclass(frozen=True)
class Unit:
    """Regions that the reading threads read together: small regions one after another by one
    thread (`tasks` alone, see `batched`), or several regions of one array that cut the same
    stored rows (`together`, `coalesce`)."""

    tasks: list[Task]
    together: coalesce.Together | None = None
    size: int = -1  # bytes of its regions; worked out here unless given
    cuts: bool = False  # its region takes some stored block in short runs (`_cuts`)

    def __post_init__(self) -> None:
        if self.size < 0:
            size = sum(region_bytes(request, index) for request, _, index in self.tasks)
            object.__setattr__(self, "size", size)

    @property
    def is_small(self) -> bool:
        """Small regions of local files: reading them is mostly Python, not waiting on storage."""
        return self.together is None and self.size <= BATCH_BYTES and self._local

    @property
    def is_cpu_bound(self) -> bool:
        """Regions placed in short runs (scattered by numpy, or read run by run) from local files:
        the reading threads spend their time in Python and copies, not waiting on storage, and
        more of them than cores only pass the GIL around (the 256 MiB embedding of
        reshard_benchmark.py on 2 cores, every layout: 0.16-0.26 s with 2 threads against
        0.19-0.30 s with 8)."""
        return (self.together is not None or self.cuts) and self._local

    @property
    def _local(self) -> bool:
        """Read from local files, not object storage (whose requests want many in flight)."""
        return not any(
            isinstance(a, FastArray | WholeFileReader) and locations.is_remote(a.directory)
            for _, a, _ in self.tasks
        )

    def start(self, pool: _Submitted, files: SmallFiles) -> Callable[[], list[np.ndarray]]:
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


def units_of(request: ReadRequest, array: Any, indices: list[Index]) -> list[Unit]:
    """The regions `indices` of one array: read together where they cut the same stored rows, else
    each alone."""
    if WholeFileReader.tiles(array, indices) and array.chunk_bytes <= BATCH_BYTES:
        whole = WholeFileReader(array, len(indices))  # kept in one unit: read by one thread
        size = math.prod(array.shape) * np.dtype(request.target.dtype).itemsize
        return [Unit([(request, whole, index) for index in indices], size=size)]
    one_shard_each = isinstance(array, FastArray) and all(map(array.is_one_shard, indices))
    if isinstance(array, FastArray | ContiguousArray) and len(indices) > 1 and not one_shard_each:
        together = coalesce.plan(array.blocks, array.shape, array.dtype, indices)
        if together is not None:
            return [Unit([(request, array, index) for index in indices], together)]
        return [Unit([(request, array, index)], cuts=_cuts(array, index)) for index in indices]
    return [Unit([(request, array, index)]) for index in indices]


def _cuts(array: FastArray | ContiguousArray, index: Index) -> bool:
    """Whether the region `index` takes some stored block in short runs."""
    region = bounds(index, array.shape)
    shape = tuple(hi - lo for lo, hi in region)
    item = array.dtype.itemsize
    return any(short_runs(b.box(region), b.shape, shape, item) for b in array.blocks(index))


def _read_each(tasks: list[Task]) -> list[np.ndarray]:
    return [array.read(index, np.dtype(request.target.dtype)) for request, array, index in tasks]


BATCH_BYTES, _BATCH_REGIONS = 1 << 20, 64
# Threads for batches of small regions of arrays kept in several files (an array in one file is read
# by `SmallFiles`, its regions cut on the calling thread): each region costs some 20 us of Python
# around a short read, so more threads only pass the GIL around (5000 variables, 12,500 regions in
# the page cache: 1.41 s with 16 threads, 1.13-1.22 s with 4, 1.03-1.08 s with 2, 1.02 s with 1);
# a few keep reads of files not in the page cache overlapping.
_SMALL_WORKERS = 2


def batched(units: list[Unit]) -> list[Unit]:
    """Consecutive single regions joined into units of up to `_BATCH_REGIONS` regions and
    `BATCH_BYTES`: a future per small region costs more in the pool's lock than its read (5000
    variables, 12,500 regions: 0.55 s waiting on the lock)."""
    joined: list[Unit] = []
    tasks: list[Task] = []
    nbytes = 0
    for unit in units:
        joins = unit.together is None and unit.size <= BATCH_BYTES
        if tasks and (
            not joins or len(tasks) == _BATCH_REGIONS or nbytes + unit.size > BATCH_BYTES
        ):
            joined.append(Unit(tasks, size=nbytes))
            tasks, nbytes = [], 0
        if joins:
            tasks += unit.tasks
            nbytes += unit.size
        else:
            joined.append(unit)
    if tasks:
        joined.append(Unit(tasks, size=nbytes))
    return joined


def read_ahead(
    units: list[Unit], workers: int, window: int
) -> Generator[tuple[Task, np.ndarray], None, None]:
    """Each region of each unit, in order, read by a pool of threads (small arrays' files by
    `SmallFiles`, then cut on this thread) in waves of at most `window` bytes (at least one unit
    each).

    A wave is read whole before any of its regions is handed on: placing arrays on their devices
    while the readers run makes the two pass the GIL back and forth (a device put waits for it each
    time it comes back from C++), which cost more than the reads themselves with thousands of
    small variables (12,500 regions: 0.6 s of placing where 0.2 s does it alone).

    The threads are the process's (`runtime.thread_pools`), kept between restores. A caller that may stop early
    (an error) closes it (`contextlib.closing`): the reads it started are then cancelled or waited
    for, not left writing whenever the generator is freed.
    """
    sizes = [unit.size for unit in units]
    files = SmallFiles()
    pool = _Submitted(thread_pools.shared("read", workers))
    small_pool = _Submitted(thread_pools.shared("small", min(workers, _SMALL_WORKERS)))
    cpu_pool = _Submitted(thread_pools.shared("cpu", min(workers, _cores())))

    def pool_for(unit: Unit) -> _Submitted:
        if unit.is_small:
            return small_pool
        return cpu_pool if unit.is_cpu_bound else pool

    try:
        following = 0
        while following < len(units):
            wave: list[tuple[Unit, Callable[[], list[np.ndarray]]]] = []
            nbytes = 0
            while following < len(units) and (not wave or nbytes + sizes[following] <= window):
                unit = units[following]
                wave.append((unit, unit.start(pool_for(unit), files)))
                nbytes += sizes[following]
                following += 1
            read = [regions() for _, regions in wave]
            for submitted in (pool, small_pool, cpu_pool):
                submitted.futures.clear()  # done: the regions are held by `read` alone
            for (unit, _), regions in zip(wave, read, strict=True):
                yield from zip(unit.tasks, regions, strict=True)
    finally:  # stopped early: no read of this restore goes on writing after it returns
        for submitted in (pool, small_pool, cpu_pool):
            submitted.settle()


class _Submitted:
    """What one `read_ahead` submits to a shared pool, so that it can wait for its own reads."""

    def __init__(self, pool: ThreadPoolExecutor) -> None:
        self.pool = pool
        self.futures: list[Future] = []

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        future = self.pool.submit(fn, *args)
        self.futures.append(future)
        return future

    def settle(self) -> None:
        """Cancels what has not started, waits for what has."""
        for future in self.futures:
            future.cancel()
        wait(self.futures)
        self.futures.clear()


def _cores() -> int:
    """The cores this process may run on (its affinity, where the OS has one: Linux)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def region_bytes(request: ReadRequest, index: Index) -> int:
    shape = request.target.shape
    counts = [len(range(*s.indices(n))) for s, n in zip(index, shape, strict=True)]
    return math.prod(counts) * np.dtype(request.target.dtype).itemsize
