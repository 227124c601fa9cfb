"""`StepSink`: the commit protocol (`storage.commit.Sink`) for the steps of a checkpoint root.

A step is written and committed by Orbax's `training.Checkpointer` (a temporary directory, barriers
across processes, process 0's metadata and rename), so its stages sit at fixed places inside
Orbax's save, with the same fault points (`storage.commit.fault_point`) as an export's:

1. **stage**: every process writes its shard files into Orbax's temporary directory, each fsynced
   (`shard_writer`, `"fast"`), or Orbax's tensorstore does (`"compact"`).
2. **agree** (`agree_on_write`, between those writes and Orbax's commit barrier): every process
   reports its outcome (`multihost.gather_outcomes`, keyed by Orbax's operation id: a background
   save agrees from Orbax's thread); then **regions**: each reports the shard files it wrote and
   still finds by name, and every process checks every report against the files each was due to
   write, computed from the arrays' shardings (`storage.commit.check_regions`); for `"compact"`,
   whose files Orbax's tensorstore names, each process due to write data reports its OCDBT
   database, found whole by name (`ocdbt_regions`). A failure is `SaveFailedError` on every
   process, before any enters Orbax's barrier.
3. **rename**: Orbax's finalize (its barriers, metadata and rename; for `"compact"`, process 0
   records the CRCs of every file of the merged databases before the rename, `ocdbt_checksums`),
   bounded from the agreement on by `KERAS_ORBAX_SYNC_TIMEOUT_S`: the handler's barriers
   (`orbax_compat.pytree_handler_with_array_writer`), then the `AsyncCheckpointer`'s two around
   process 0's rename (`orbax_barriers.bound_commit_barriers`).
4. **fsync**: every file and directory of the renamed step, and its root (`DurableResponse`).
5. **prune**: `ModelCheckpoint`'s retention, once the step is durable (`training/retention.py`).

```python
sink = StepSink(root, "fast")
with sink.open_checkpointer() as checkpointer:
    save_async(checkpointer, sink.root, step, checkpointables, durable.Synced()).result()
```
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
from collections.abc import Callable
from typing import Any, Literal

import orbax.checkpoint.experimental.v1 as ocp

from keras_orbax._src.compat import orbax_barriers, orbax_compat
from keras_orbax._src.format import step_dirs
from keras_orbax._src.format.step_record import STATE
from keras_orbax._src.format.zarr_shards import ONE_FILE_SEPARATOR, chunk_key
from keras_orbax._src.model import shardings
from keras_orbax._src.runtime import multihost
from keras_orbax._src.storage import commit, durable, locations, step_leftovers
from keras_orbax._src.write import (
    data_state_writer,
    files_writer,
    ocdbt_checksums,
    ocdbt_regions,
    shard_writer,
)
from keras_orbax._src.write.shard_metadata import SavedArray
from keras_orbax.errors import SaveFailedError

SaveFormat = Literal["fast", "compact"]
# "fast": one uncompressed file per shard, chunk = shard (one file for an array of <= 1 MiB), so
# restore reads each file once, straight into the buffer its device uses (docs/format.md); keras-orbax
# writes these files itself (`shard_writer`). "compact": Orbax's defaults, zstd-compressed chunks in one
# OCDBT database per process: smaller, fewer files.
FORMATS: dict[str, dict[str, bool]] = {
    "fast": {
        "use_zarr3": True,
        "use_compression": False,
        "use_ocdbt": False,
        "use_replica_parallel": False,
    },
    "compact": {"use_zarr3": True, "use_compression": True, "use_ocdbt": True},
}


class StepSink(commit.Sink):
    """The steps of the checkpoint root `destination`, written in `format` through Orbax.

    One sink serves every save of one checkpointer (`ModelCheckpoint` keeps one for the run);
    the regions checked are those of the save being agreed on.
    """

    unchanged = "the step is not committed"

    def __init__(self, destination: Any, format: SaveFormat = "fast") -> None:
        check_format(format, destination)
        self.root = step_dirs.CheckpointRoot.of(destination)
        self.destination, self.format = self.root.path, format
        self._arrays: list[SavedArray] = []
        self._databases: set[int] = set()  # "compact": the processes due to write a database

    def open_checkpointer(
        self,
        preservation_policy: Any = None,
        *,
        leaf_handler: type = shard_writer.FastArrayLeafHandler,
        commit_timeout_s: int | None = None,
    ) -> ocp.training.Checkpointer:
        """An Orbax `training.Checkpointer` that writes keras-orbax's array format and commits
        through this sink (`agree_on_write` before Orbax's commit barrier).

        `leaf_handler` writes the fast format's arrays (`array_writer` holds the step open
        instead); `commit_timeout_s` replaces Orbax's limit on the time from a save's start to its
        commit.
        """
        context = ocp.Context()
        # Orbax signals that a save's directories exist under a process-wide operation id: two
        # saves in flight at once (a local tier and the persistent one, two callbacks) would wait
        # on each other's signal and write into a directory not yet made. Made before the save
        # returns instead (one mkdir of each; the writes still run in the background).
        context.async_options.create_directories_asynchronously = False
        if commit_timeout_s is not None:
            context.async_options.timeout_secs = commit_timeout_s
        # Orbax's last two barriers of a save (after every process agreed, around process 0's
        # rename) wait `KERAS_ORBAX_SYNC_TIMEOUT_S` at most, not what is left of `timeout_secs`.
        orbax_barriers.bound_commit_barriers(
            context, multihost.DEFAULT_TIMEOUT_S, commit.fault_point
        )
        for option, value in FORMATS[self.format].items():
            setattr(context.array.saving, option, value)
        # The shard files written by keras-orbax ("fast") or by Orbax ("compact"); either way
        # every process's outcome agreed on (`agree_on_write`) before Orbax commits the step.
        # Both formats hold each process's input position (`data_state_writer`).
        # "compact": process 0 records a CRC of every file of the merged step (`ocdbt_checksums`).
        fast = self.format == "fast"
        handler = leaf_handler if fast else ocdbt_regions.CompactArrayLeafHandler
        registry = _registry(handler, self.agree_on_write, None if fast else ocdbt_checksums.record)
        context.checkpointables_options.registry = data_state_writer.register(registry)
        if locations.is_remote(self.destination):  # no atomic rename: a marker file commits
            context.atomicity.mode = ocp.options.AtomicityMode.COMMIT_FILE
        return ocp.training.Checkpointer(
            self.destination,
            context=context,
            preservation_policy=preservation_policy,
        )

    def agree_on_write(
        self, directory: Any, operation_id: str, error: BaseException | None, wait_s: float | None
    ) -> None:
        """The step's "agree" and "regions" stages, between this process's writes (into the
        step's `state/`, `directory`) and Orbax's commit: every process reports whether its shard
        files were written and fsynced, then which of those it still finds by name; if any failed
        or any process's files are not those it was due to write, every process raises
        `SaveFailedError` and none enters Orbax's commit barrier. Processes that are only slower
        are waited for as long as Orbax's own limit on the write (`wait_s`).

        Raises:
            SaveFailedError: a process failed (its error named), or wrote other files than it was
                due to; the step is not committed.
            ProcessSyncError: a process did not report within `wait_s`.
        """
        # Taken whatever follows: nothing kept.
        written = files_writer.take_written(directory)
        compact = ocdbt_regions.take_arrays(directory)
        commit.fault_point("agree")
        multihost.agree_on_outcome(
            "writing the step's files", operation_id, error, wait_s=wait_s, fallback=SaveFailedError
        )
        commit.fault_point("regions")
        if written is not None:  # "fast": keras-orbax's writer knows what each process owns
            self._arrays, self._databases = written[0], set()
            self._check_regions(operation_id, lambda: _still_there(directory, written[1]))
        elif compact is not None:  # "compact": each process's OCDBT database
            self._arrays, self._databases = [], ocdbt_regions.processes_due(compact)
            self._check_regions(operation_id, lambda: self._databases_found(directory))
        commit.fault_point("rename")  # Orbax's finalize: its metadata, then the rename

    def _check_regions(self, operation_id: str, found: Callable[[], list[str]]) -> None:
        """Every process reports the regions it `found` (its own, each looked up by name); every
        process checks every report against `regions_due`."""
        report, failed = None, None
        try:
            report = commit.digest(found())
        except Exception as error:  # EIO, a damaged database: reported to every process
            failed = error
        reports = multihost.gather_outcomes(
            "checking the step's regions",
            f"{operation_id}/regions",
            failed,
            report,
            wait_s=multihost.DEFAULT_TIMEOUT_S,  # every process has ended its writes
            fallback=SaveFailedError,
            every_report=True,
        )
        self.check(reports)

    def regions_due(self, process: int) -> list[str]:
        """The shard files (relative to the step's `state/`) that `process` writes of the save being
        agreed on: replica 0 of each distinct shard, as `shard_writer` picks it (JAX numbers the
        replicas of a shard in the order of `devices_indices_map`); a packed array's one file by
        the process holding it. For `"compact"`: its OCDBT database, if it holds replica 0 of some
        shard (`ocdbt_regions.processes_due`)."""
        if process in self._databases:
            return [ocdbt_regions.database(process)]
        return [name for array in self._arrays for name in _due(array, process)]

    def _databases_found(self, directory: Any) -> list[str]:
        """This process's OCDBT database, whole (`ocdbt_regions.databases_found`), if it is due
        one: a process that writes only others' replicas may have one too, not due."""
        process = multihost.process_index()
        if process not in self._databases:
            return []
        return ocdbt_regions.databases_found(directory, process)


def _due(array: SavedArray, process: int) -> list[str]:
    keys = _due_chunks(
        array.sharding, tuple(array.shape), tuple(array.chunk), array.packed, process
    )
    return [f"{array.name}/{key}" for key in keys]


@functools.lru_cache(maxsize=1024)
def _due_chunks(
    sharding: Any, shape: tuple[int, ...], chunk: tuple[int, ...], packed: bool, process: int
) -> tuple[str, ...]:
    """The chunk keys `process` writes of an array of `shape` and `sharding`: computed once per
    layout (a model's thousands of arrays have a few)."""
    if packed:
        holder = next(iter(sharding.devices_indices_map(shape))).process_index
        return (chunk_key((0,) * len(shape), ONE_FILE_SEPARATOR),) if holder == process else ()
    return tuple(
        chunk_key(tuple(a // n if n else 0 for (a, _), n in zip(bounds, chunk, strict=True)))
        for writer, bounds in shardings.replica_zero(sharding, shape)
        if writer == process
    )


def _still_there(directory: Any, names: list[str]) -> list[str]:
    """`names` (files this process wrote under `directory`) that are still there, each looked up by
    name: never a listing. An object in object storage is there once written."""
    if locations.is_remote(directory):
        return names
    root = os.fspath(locations.as_path(directory))
    return [name for name in names if _exists(f"{root}/{name}")]


def _exists(path: str) -> bool:
    try:
        os.stat(path)
    except FileNotFoundError:
        return False
    return True  # another OSError (EIO) is raised by os.stat, and reported


def _registry(
    leaf_handler: type,
    before_commit: orbax_compat.BeforeCommit,
    after_finalize: Callable[[Any], None] | None = None,
) -> Any:
    """Orbax's handlers, with `state` saved by a PyTreeHandler whose `jax.Array` leaves go to
    `leaf_handler`, whose commit waits for `before_commit`, and whose finalize ends with
    `after_finalize`."""
    handler = orbax_compat.pytree_handler_with_array_writer(
        leaf_handler,
        before_commit,
        after_agreement_s=multihost.DEFAULT_TIMEOUT_S,
        after_finalize=after_finalize,
    )
    registry = ocp.handlers.local_registry(include_global_registry=False)
    registry.add(handler, checkpointable_name=STATE)
    default = ocp.handlers.local_registry()
    for handler_type, name in default.get_all_entries():
        if name != STATE:
            registry.add(
                handler_type,
                checkpointable_name=name,
                secondary_typestrs=default.get_secondary_typestrs(handler_type),
            )
    return registry


def open_checkpointer(
    directory: str | os.PathLike,
    format: SaveFormat = "fast",
    preservation_policy: Any = None,
    *,
    leaf_handler: type = shard_writer.FastArrayLeafHandler,
    commit_timeout_s: int | None = None,
) -> ocp.training.Checkpointer:
    """`StepSink(directory, format).open_checkpointer(...)`."""
    return StepSink(directory, format).open_checkpointer(
        preservation_policy, leaf_handler=leaf_handler, commit_timeout_s=commit_timeout_s
    )


# Orbax numbers each save and each deletion with one process-wide counter (`OperationIdGenerator`)
# that its handlers read back while the operation runs: two in flight at once in one process (two
# `ModelCheckpoint`s of one `fit`, each with its own directory, one saving while the other saves
# or deletes a step retention no longer keeps) waited on each other's signals and wrote into each
# other's temporary directories (FileNotFoundError, then Orbax's 300 s timeouts). So a process
# runs one Orbax save or deletion at a time, a save from its start to its commit.
_ONE_SAVE = threading.Lock()


def orbax_operation() -> contextlib.AbstractContextManager:
    """Held for an Orbax operation other than a save (a deletion): none runs meanwhile."""
    return _ONE_SAVE


def save_async(
    checkpointer: ocp.training.Checkpointer,
    root: step_dirs.CheckpointRoot,
    step: int,
    checkpointables: dict[str, Any],
    synced: durable.Synced,
    **options: Any,
) -> DurableResponse | None:
    """`checkpointer.save_checkpointables_async(step, checkpointables, **options)`, once no other
    save of this process is in flight; the next may start once `result()` has seen this one
    committed or failed."""
    _ONE_SAVE.acquire()
    try:
        response = checkpointer.save_checkpointables_async(step, checkpointables, **options)
    except BaseException:
        _ONE_SAVE.release()
        raise
    if response is None:
        _ONE_SAVE.release()
        return None
    return DurableResponse(response, root, step, synced, _ONE_SAVE.release)


class DurableResponse:
    """Orbax's response to a save, whose `result()` waits for the commit and then makes the step
    durable (`durable.step_committed`: Orbax fsyncs neither its own files nor the rename).

    Hand the checkpointer no preservation policy: Orbax would delete older steps before the commit
    is reported, so before this fsync. `ModelCheckpoint` deletes them once `result()` has returned
    (`training/retention.py`). `synced`: the files the writer fsynced already
    (`shard_writer.noting_fsyncs`), not fsynced again.
    """

    def __init__(
        self,
        response: ocp.AsyncResponse,
        directory: Any,
        step: int,
        synced: durable.Synced | None = None,
        ended: Callable[[], None] | None = None,
    ) -> None:
        self._response, self._synced, self._ended = response, synced, ended
        self._step_dir = step_dirs.CheckpointRoot.of(directory).step_dir(step)

    def result(self) -> None:
        # A failed save removes what it staged (the caller holds the step's writer lock).
        with step_leftovers.removing_staged(self._step_dir.parent, int(self._step_dir.name)):
            try:
                self._response.result()
            finally:
                ended, self._ended = self._ended, None
                if ended is not None:  # Orbax's part is over: the next save may start
                    ended()
        commit.fault_point("fsync")
        if not locations.is_remote(self._step_dir):  # an object is durable once written
            durable.step_committed(self._step_dir, self._synced)


def check_format(format: str, directory: str | os.PathLike) -> None:
    """Raises ValueError unless `format` is one of `FORMATS` and can be written to `directory`."""
    if format not in FORMATS:
        raise ValueError(f"format must be one of {sorted(FORMATS)}. Received: format={format!r}")
    if format == "compact" and os.fspath(directory).startswith("s3://"):
        # Orbax builds a local file path for the arrays of an s3:// checkpoint in this format.
        raise ValueError(
            "format='compact' cannot be written to s3:// (Orbax's tensorstore path for it is "
            "local-only); use the default format='fast'. "
            f"Received: format={format!r}, directory={os.fspath(directory)!r}"
        )
