"""The files of a step's arrays, written by the process's pool of threads: each shard file (or
its link to the previous step's, `incremental`), the `zarr.json` of each array, then the files that
list them all, every file and directory fsynced before `ArrayFiles.finish` returns.

`shard_writer` decides what a save writes (Orbax's leaf handler, staged copies); `shard_files`
writes one file; this module writes them all, concurrently, and keeps what it wrote for the
commit's region check (`take_written`).

```python
write_arrays(state_dir, arrays, shards)  # durable when it returns
```
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import functools
import os
from collections import defaultdict
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from keras_orbax._src.format import crc
from keras_orbax._src.runtime import thread_pools
from keras_orbax._src.storage import durable, locations
from keras_orbax._src.write import incremental, shard_files
from keras_orbax._src.write.shard_files import Shard
from keras_orbax._src.write.shard_metadata import SavedArray, array_files, step_files

# Files in flight. Large shards: enough to keep the disk's queue full while others fsync. Small
# ones: each costs a journal commit more than its bytes, and concurrent fsyncs share commits
# (500 Dense(64) layers: 16 threads 4.5-8.4 s, 64 threads 3.2-3.7 s).
_WORKERS, _WORKERS_SMALL, _SMALL_BYTES = 16, 64, 1 << 20


def _writer_pool(workers: int) -> ThreadPoolExecutor:
    """The writer's threads, by count, kept for the process's life (`runtime.thread_pools`)."""
    return thread_pools.shared(f"write{workers}", workers)


def write_arrays(
    directory: Any,
    arrays: list[SavedArray],
    shards: list[Shard],
    plan: incremental.Plan | None = None,
    synced: durable.Synced | None = None,
    recycled: str | None = None,
    recorded: Sequence[crc.Crc] = crc.RECORDED,
) -> None:
    """Writes every file of `arrays` this process owns under `directory` (a step's `state/`),
    durably: each file and each directory is fsync-ed (an object is durable once written)
    before this returns, each file noted in `synced`. With `plan`, a shard unchanged since the
    previous step is linked; with `recycled` (a retired step's `state/`), a shard is written into
    that step's file where it may (`recycled_step`). Each shard file's entry holds the CRCs of
    `recorded`."""
    small = sum(s.data.nbytes for s in shards) < _SMALL_BYTES * max(1, len(shards))
    local_small = small and not locations.is_remote(directory)  # fsyncs shared: local files only
    workers = _WORKERS_SMALL if local_small else _WORKERS
    with ArrayFiles(
        directory,
        workers=workers,
        plan=plan,
        synced=synced,
        recycled=recycled,
        recorded=recorded,
    ) as files:
        files.add(arrays, shards)
        files.finish()


class ArrayFiles:
    """The files of a step's arrays under `directory` (its `state/`), written a few arrays at a
    time (`add`), then, in `finish`, the files that list them all (`_sharding`,
    `array_metadatas/process_<i>`, this process's checksums): durable when `finish` returns.

    With `in_flight_bytes`, `add` returns only once at most that many bytes of shards are still
    being written, so a caller that hands over one array at a time and lets it go holds about
    that much beyond the array it is reading (`convert`). Without it, every shard is written
    concurrently and waited for in `finish` (`save`: all the arrays exist already). With `plan`,
    each shard whose bytes are those of the previous step's file is linked to that file (in
    object storage: copied on the server from that step's object; `incremental`). With
    `synced`, every file it fsyncs is noted there; with `recycled`, shards are written into a
    retired step's files where they may (`recycled_step`), recording the CRCs of `recorded`
    (`write_arrays`). The threads are the process's
    (`_writer_pool`); leaving the `with` block cancels this writer's writes not yet started and
    waits for the others.

    ```python
    with ArrayFiles(state_dir, in_flight_bytes=64 << 20) as files:
        for name, value in arrays:
            files.add([describe(name, value)], host_shards([Param(name, value)], copy=False))
        files.finish()
    ```
    """

    def __init__(
        self,
        directory: Any,
        *,
        workers: int = _WORKERS,
        in_flight_bytes: int | None = None,
        plan: incremental.Plan | None = None,
        synced: durable.Synced | None = None,
        recycled: str | None = None,
        recorded: Sequence[crc.Crc] = crc.RECORDED,
    ) -> None:
        self._remote = locations.is_remote(directory)
        self._synced = synced
        self._recycled = None if self._remote else recycled
        self._recorded = crc.RECORDED if self._remote else recorded
        self._plan = plan
        # Paths are strings: pathlib's joins were a quarter of this thread's time (5000 arrays).
        self._root = os.fspath(directory)
        self._store = locations.kvstore(directory) if self._remote else None
        self._pool = _writer_pool(workers)
        self._submitted: list[Future[Any]] = []
        self._once = shard_files.Once()
        self._made: dict[str, None] = {}  # directories made (relative), parents first
        # Those this writer created, below `directory`: nothing but it adds entries to them.
        self._own: set[str] = set()
        self._arrays: list[SavedArray] = []
        self._checksums: dict[str, dict[str, Any]] = {}
        self._pending: collections.deque[tuple[list[Future[Any]], int]] = collections.deque()
        self._in_flight, self._limit = 0, in_flight_bytes

    def __enter__(self) -> ArrayFiles:
        return self

    def __exit__(self, *exc: object) -> None:
        for future in self._submitted:
            future.cancel()
        concurrent.futures.wait(self._submitted)

    def _submit(self, fn: Callable[..., Any], *args: Any) -> Future[Any]:
        future = self._pool.submit(fn, *args)
        self._submitted.append(future)
        return future

    def add(self, arrays: list[SavedArray], shards: list[Shard]) -> None:
        """Writes the shard files and `zarr.json` of `arrays` (`shards`: this process's)."""
        self._arrays += arrays
        nbytes = sum(s.data.nbytes for s in shards)
        self._pending.append((self._write(array_files(arrays), shards), nbytes))
        self._in_flight += nbytes
        while self._limit is not None and self._in_flight > self._limit and self._pending:
            self._collect_oldest()

    def finish(self) -> None:
        """Writes the files that list every array added, waits for all, and makes them durable.

        Raises:
            OSError: a file could not be written (the first such error).
        """
        self._pending.append((self._write(step_files(self._arrays), []), 0))
        while self._pending:
            self._collect_oldest()
        name = shard_files.checksums_name()
        if self._store is not None and self._plan is not None:  # what the next save's copies check
            incremental.record_versions(self._root, self._checksums)
        content = shard_files.checksums_json(
            self._checksums, incremental_save=self._plan is not None
        )
        _written[self._root] = (self._arrays, list(self._checksums))
        if self._store is not None:
            self._store.write(name, content).result()
            return
        for relative in _ancestors(name):
            self._make_dir(relative)
        shard_files.write_file(f"{self._root}/{name}", content, synced=self._synced)
        fsyncs = [
            self._submit(durable.fsync_path, path, self._synced) for path in self._once.written
        ]
        # A directory this writer created is complete now: noted, it is not fsynced again at the
        # commit. `directory` itself is not (Orbax writes its tree metadata there).
        fsyncs += [
            self._submit(
                durable.fsync_path, f"{self._root}/{d}", self._synced if d in self._own else None
            )
            for d in self._made
        ]
        for future in fsyncs:
            future.result()

    def _collect_oldest(self) -> None:
        futures, nbytes = self._pending.popleft()
        for future in futures:
            written = future.result()
            if written is not None:
                self._checksums[written[0]] = written[1]
        self._in_flight -= nbytes

    def _write(self, files: list[tuple[str, bytes]], shards: list[Shard]) -> list[Future[Any]]:
        """Starts writing `shards` (each future gives its name and checksum) and writes or starts
        writing `files`."""
        if self._store is not None:
            store = self._store
            started = [self._submit(self._shard_write(shard)) for shard in shards]
            return started + [self._submit(shard_files.put_file, store, *file) for file in files]
        # Each file's write by its directory (relative to `directory`, "" for itself); the
        # directories to make are those and every one above them.
        writes: dict[str, list[Callable[[], Any]]] = defaultdict(list)
        for shard in shards:
            writes[_parent(shard.relative)].append(self._shard_write(shard))
        metadata: dict[str, list[tuple[str, bytes]]] = defaultdict(list)
        for name, content in files:
            metadata[_parent(name)].append((f"{self._root}/{name}", content))
        names = [*(s.relative for s in shards), *(name for name, _ in files)]
        dirs = sorted({parent for name in names for parent in _ancestors(name)})  # parents first
        # Directories are made here one by one (a parent's lock orders them anyway; 5000 arrays:
        # 0.1-1 ms of kernel CPU each), and the shard files of each written by the pool as soon
        # as it exists, overlapping the two (5000 Dense(64): 9.7 -> 6.8 s, medians of 10
        # alternating); the metadata files here, each content once (`shard_files.Once`).
        started = []
        for relative in dirs:
            self._make_dir(relative)
            started += [self._submit(write) for write in writes[relative]]
            for path, content in metadata[relative]:
                self._once.write(path, content)
        return started

    def _shard_write(self, shard: Shard) -> Callable[[], Any]:
        """Writing `shard`'s file or object; with a plan, carried over if unchanged."""
        if self._store is not None:
            write = functools.partial(shard_files.put_shard, self._store)
        else:
            write = functools.partial(
                shard_files.write_shard,
                self._root,
                synced=self._synced,
                recycled=self._recycled,
                recorded=self._recorded,
            )
        if self._plan is None:
            return functools.partial(_once_filled, shard, functools.partial(write, shard))
        return functools.partial(
            _once_filled,
            shard,
            functools.partial(self._plan.write_or_link, self._root, shard, write, self._recorded),
        )

    def _make_dir(self, relative: str) -> None:
        if relative not in self._made:
            with contextlib.suppress(FileExistsError):
                os.mkdir(f"{self._root}/{relative}")
                if relative:
                    self._own.add(relative)
            self._made[relative] = None


# The arrays and shard files each `ArrayFiles` wrote, by its directory (a step's `state/`), until
# the step's commit takes them (`take_written`) to check them against those due.
_written: dict[str, tuple[list[SavedArray], list[str]]] = {}


def take_written(directory: Any) -> tuple[list[SavedArray], list[str]] | None:
    """What the writer of `directory` (a step's `state/`) wrote: every array it was given (this
    process's shards of them or none) and the names of this process's shard files; None where
    keras-orbax's writer did not write it (the compact format: Orbax's tensorstore)."""
    return _written.pop(os.fspath(locations.as_path(os.fspath(directory))), None)


def _parent(relative: str) -> str:
    return relative.rpartition("/")[0]


def _ancestors(relative: str) -> list[str]:
    """The directories above the file `relative`, from `directory` itself ("") down: each is made
    before the file and fsync-ed after it (`c/0/1/2` of a 3-D array has three below the array's)."""
    parts = relative.split("/")[:-1]
    return ["/".join(parts[:n]) for n in range(len(parts) + 1)]


def _once_filled(shard: Shard, write: Callable[[], Any]) -> Any:
    """`write()` once `shard`'s bytes have arrived (a background save's fetch from the device)."""
    if shard.filled is not None:
        shard.filled.result()
    return write()
