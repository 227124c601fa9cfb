"""Reading the regions of many arrays ahead of placing them: grouped into units, read by a pool of
threads in waves of a byte budget (`read_arrays` in `_read` places each array as its regions come).

A unit is what one thread reads at once: one region, several regions of an array that cut the
same stored rows (`coalesce`), or a batch of small regions (a future each would cost more than
its read). Small arrays kept in one file are read by `SmallFiles` and cut on the calling thread.
Units whose regions go in short runs are read by one thread per core (`Unit.is_cpu_bound`).

```python
units = batched(u for r, a, indices in plan.fast for u in units_of(r, a, indices))
for (request, array, index), region in read_ahead(units, workers=8, window=512 << 20):
    ...  # regions come in the order of `units`
```
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
from collections.abc import Callable, Generator, Iterable, Iterator
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


def batched(units: Iterable[Unit]) -> Iterator[Unit]:
    """Consecutive single regions joined into units of up to `_BATCH_REGIONS` regions and
    `BATCH_BYTES`: a future per small region costs more in the pool's lock than its read (5000
    variables, 12,500 regions: 0.55 s waiting on the lock). Lazy: `units` are planned as
    `read_ahead` gets to them."""
    tasks: list[Task] = []
    nbytes = 0
    for unit in units:
        joins = unit.together is None and unit.size <= BATCH_BYTES
        if tasks and (
            not joins or len(tasks) == _BATCH_REGIONS or nbytes + unit.size > BATCH_BYTES
        ):
            yield Unit(tasks, size=nbytes)
            tasks, nbytes = [], 0
        if joins:
            tasks += unit.tasks
            nbytes += unit.size
        else:
            yield unit
    if tasks:
        yield Unit(tasks, size=nbytes)


def read_ahead(
    units: Iterable[Unit], workers: int, window: int
) -> Generator[tuple[Task, np.ndarray], None, None]:
    """Each region of each unit, in order, read by a pool of threads (small arrays' files by
    `SmallFiles`, then cut on this thread) in waves of at most half of `window` bytes (at least
    one unit each), with at most `window` bytes read and not yet handed on.

    A wave is read whole before any of its regions is handed on, and the next wave of large
    regions is started first, so that the disk does not wait while the wave's last reads finish
    and its regions are placed. A wave of mostly small regions is started only once the one
    before it is handed on: placing arrays on their devices while those readers run makes the two
    pass the GIL back and forth (a device put waits for it each time it comes back from C++),
    which cost more than the reads themselves with thousands of small variables (12,500 regions:
    0.6 s of placing where 0.2 s does it alone). `units` are taken lazily, a wave ahead of the one
    being read, so that planning them (`units_of`) overlaps the reads.

    The threads are the process's (`runtime.thread_pools`), kept between restores. A caller that
    may stop early (an error) closes it (`contextlib.closing`): the reads it started are then
    cancelled or waited for, not left writing whenever the generator is freed.
    """
    files = SmallFiles()
    pools = {
        "read": _Submitted(thread_pools.shared("read", workers)),
        "small": _Submitted(thread_pools.shared("small", min(workers, _SMALL_WORKERS))),
        "cpu": _Submitted(thread_pools.shared("cpu", min(workers, _cores()))),
    }

    def pool_for(unit: Unit) -> _Submitted:
        if unit.is_small:
            return pools["small"]
        return pools["cpu" if unit.is_cpu_bound else "read"]

    waves = _waves(units, max(window // 2, 1))
    try:
        reading = _Wave.start(next(waves, []), pool_for, files)
        planned = next(waves, [])
        while reading.started:
            following = None
            if planned and _overlaps(reading.units, planned, window):
                following = _Wave.start(planned, pool_for, files)
                planned = next(waves, [])
            read = reading.wait()
            for submitted in pools.values():
                submitted.forget_done()  # their regions are held by `read` alone
            for (unit, _), regions in zip(reading.started, read, strict=True):
                yield from zip(unit.tasks, regions, strict=True)
            del read
            if following is None:
                following = _Wave.start(planned, pool_for, files)
                planned = next(waves, [])
            reading = following
    finally:  # stopped early: no read of this restore goes on writing after it returns
        for submitted in pools.values():
            submitted.settle()


def _waves(units: Iterable[Unit], limit: int) -> Iterator[list[Unit]]:
    """`units` in consecutive waves of at most `limit` bytes, at least one unit each."""
    wave: list[Unit] = []
    nbytes = 0
    for unit in units:
        if wave and nbytes + unit.size > limit:
            yield wave
            wave, nbytes = [], 0
        wave.append(unit)
        nbytes += unit.size
    if wave:
        yield wave


def _overlaps(wave: list[Unit], following: list[Unit], window: int) -> bool:
    """Whether `following` may be read while `wave` is read and handed on: most of its units are
    large regions (see `read_ahead`; a model's norms and biases come between its kernels), and the
    two fit in the window together."""
    size = sum(u.size for u in wave) + sum(u.size for u in following)
    small = sum(u.is_small for u in following)
    return size <= window and 2 * small <= len(following)


@dataclasses.dataclass
class _Wave:
    """Units whose reads have started, and what waits for each one's regions."""

    started: list[tuple[Unit, Callable[[], list[np.ndarray]]]]

    @classmethod
    def start(
        cls, units: list[Unit], pool_for: Callable[[Unit], _Submitted], files: SmallFiles
    ) -> _Wave:
        return cls([(unit, unit.start(pool_for(unit), files)) for unit in units])

    @property
    def units(self) -> list[Unit]:
        return [unit for unit, _ in self.started]

    def wait(self) -> list[list[np.ndarray]]:
        return [regions() for _, regions in self.started]


class _Submitted:
    """What one `read_ahead` submits to a shared pool, so that it can wait for its own reads."""

    def __init__(self, pool: ThreadPoolExecutor) -> None:
        self.pool = pool
        self.futures: list[Future] = []

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        future = self.pool.submit(fn, *args)
        self.futures.append(future)
        return future

    def forget_done(self) -> None:
        self.futures = [future for future in self.futures if not future.done()]

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
