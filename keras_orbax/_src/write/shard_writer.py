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
import collections
import concurrent.futures
import contextlib
import contextvars
import functools
import os
import threading
from collections import defaultdict
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, NamedTuple

import jax
import numpy as np

from keras_orbax._src.compat import orbax_compat
from keras_orbax._src.storage import durable, locations
from keras_orbax._src.write import incremental, shard_files, staging
from keras_orbax._src.write.shard_files import Shard
from keras_orbax._src.write.shard_metadata import SavedArray, array_files, step_files

# Files in flight. Large shards: enough to keep the disk's queue full while others fsync. Small
# ones: each costs a journal commit more than its bytes, and concurrent fsyncs share commits
# (500 Dense(64) layers: 16 threads 4.5-8.4 s, 64 threads 3.2-3.7 s).
_WORKERS, _WORKERS_SMALL, _SMALL_BYTES = 16, 64, 1 << 20
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
# The writer's threads, by count, kept for the process's life: a save's pool of 16-64 threads
# started and joined at every save was part of its cost (docs/benchmarks.md).
_pools: dict[int, ThreadPoolExecutor] = {}
_pools_lock = threading.Lock()


def _writer_pool(workers: int) -> ThreadPoolExecutor:
    with _pools_lock:
        pool = _pools.get(workers)
        if pool is None:
            pool = _pools[workers] = ThreadPoolExecutor(workers, f"keras_orbax_write{workers}")
        return pool


def _forget_pools() -> None:
    """In a forked child: the parent's threads are not there, so neither are its pools."""
    global _pools, _pools_lock
    _pools, _pools_lock = {}, threading.Lock()


os.register_at_fork(after_in_child=_forget_pools)


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
        plan, synced = incremental.active(), _SYNCED.get()

        async def write() -> None:
            await parent.await_creation()
            path = locations.as_path(parent.path)
            await asyncio.to_thread(write_arrays, path, arrays, shards, plan, synced)

        return write()


def shards_of(name: str, value: jax.Array) -> tuple[list[SavedArray], list[Shard]]:
    """What `ArrayFiles.add` takes to write `value` under the Orbax parameter name `name`: its
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
    host = _on_host([s.data for _, s in picked])
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
    held = staging.active()
    if not copy:
        host = [np.ascontiguousarray(data) for data in host]
    elif held is not None:  # a background save of the callback: pinned, or its warm buffers
        host = held.keep(host, [p.value for p in unpacked])
    else:
        host = [np.array(data, order="C") for data in host]
    values = {p.name: p.value for p in unpacked}
    shards = []
    for (name, shard), data in zip(picked, host, strict=True):
        chunk = shard.data.shape
        coords = tuple(
            (index.start or 0) // n if n else 0 for index, n in zip(shard.index, chunk, strict=True)
        )
        layout = _layout(values[name], chunk, packed=False)
        shards.append(Shard(name, coords, data, layout=layout))
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


def write_arrays(
    directory: Any,
    arrays: list[SavedArray],
    shards: list[Shard],
    plan: incremental.Plan | None = None,
    synced: durable.Synced | None = None,
) -> None:
    """Writes every file of `arrays` this process owns under `directory` (a step's `state/`),
    durably: each file and each directory is fsync-ed (an object is durable once written)
    before this returns, each file noted in `synced`. With `plan`, a shard unchanged since the
    previous step is linked."""
    small = sum(s.data.nbytes for s in shards) < _SMALL_BYTES * max(1, len(shards))
    local_small = small and not locations.is_remote(directory)  # fsyncs shared: local files only
    workers = _WORKERS_SMALL if local_small else _WORKERS
    with ArrayFiles(directory, workers=workers, plan=plan, synced=synced) as files:
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
    each shard is fingerprinted and, if unchanged since the previous step, linked to that step's
    file (in object storage: copied on the server from that step's object; `incremental`). With
    `synced`, every file it fsyncs is noted there. The threads are the process's
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
    ) -> None:
        self._remote = locations.is_remote(directory)
        self._synced = synced
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
        content = shard_files.checksums_json(self._checksums, fingerprinted=self._plan is not None)
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
            write = functools.partial(shard_files.write_shard, self._root, synced=self._synced)
        if self._plan is None:
            return functools.partial(write, shard)
        return functools.partial(self._plan.write_or_link, self._root, shard, write)

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
