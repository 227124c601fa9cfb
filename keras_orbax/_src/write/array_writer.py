"""`save_arrays`: one committed step from arrays that arrive one at a time (`convert`).

The step is the one `save` writes, by the same writer: Orbax's `training.Checkpointer` from
`step_sink.open_checkpointer` commits it (temporary directory and rename, or the commit marker in
object storage; `_METADATA`; `_CHECKPOINT_METADATA` with the keras-orbax record),
`files_writer.ArrayFiles` writes each shard file with its checksum and the arrays' metadata files,
the writer lock is held throughout, and the step is made durable before it is reported committed.

Only the way the arrays reach the files differs. `save` gives Orbax the tree of arrays. Here the
arrays do not exist yet: each is read from a source when its turn comes and let go once written,
so memory holds about one at a time. Orbax gets a tree of the same keys whose leaves are one scalar
placeholder, and its array leaf handler (`_HeldOpen`) writes nothing: it hands the step's
temporary `state/` directory to the caller and waits while the caller's thread takes each array
and writes its files there. Orbax then writes its own metadata (each array's `write_shape` it reads
from the `array_metadatas` written here) and commits. A failure before that is passed to Orbax as
the handler's error: nothing is committed, and what the attempt wrote is removed.

Orbax's partial save (`ocp.partial`, what `convert` used before) cannot do this: it saves through
a `PyTreeHandler` of its own (not the context's registry, so not the shard writer), merges its
per-call directories by renaming files into one (the calls' checksum files would collide), and
commits by renaming a directory, which in object storage is a copy that appears object by object.
The arrays are read in the caller's thread, not Orbax's: the caller's thread-local state (Keras's
active distribution) and the source's own errors stay the caller's.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import contextvars
import dataclasses
import logging
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import jax
import numpy as np

from keras_orbax._src.compat import orbax_compat
from keras_orbax._src.format import step_dirs
from keras_orbax._src.format.dtypes import np_dtype
from keras_orbax._src.format.own_state import KERAS_STATE, OwnState, StepFiles
from keras_orbax._src.format.step_record import FORMAT_NAME, STATE, StepRecord
from keras_orbax._src.model import state_keys
from keras_orbax._src.runtime import multihost, quiet
from keras_orbax._src.storage import locations, step_leftovers
from keras_orbax._src.storage.writer_lock import writer_lock
from keras_orbax._src.write import files_writer, shard_writer, step_sink
from keras_orbax._src.write import incremental as incremental_saves
from keras_orbax.errors import KerasOrbaxError, SaveFailedError, StepExistsError

# Shards still being written when `add` returns: the memory held beyond the array being read.
_IN_FLIGHT_BYTES = 4 << 20
# The arrays are written inside the save's commit window, which Orbax limits to 20 minutes by
# default: too short for a large conversion. (Orbax passes it to JAX's barriers in milliseconds,
# as an int32: 7 days fits.)
_COMMIT_TIMEOUT_S = 7 * 24 * 3600
_ORBAX_LOGGER = logging.getLogger("absl")


class _Hold:
    """What Orbax's save and the caller pass each other: the directory the arrays go to, and
    whether they were all written (or why not)."""

    def __init__(self) -> None:
        self.directory: concurrent.futures.Future[Any] = concurrent.futures.Future()
        self.written: concurrent.futures.Future[None] = concurrent.futures.Future()


_HOLD: contextvars.ContextVar[_Hold | None] = contextvars.ContextVar(
    "keras_orbax_held_step", default=None
)


class _Abandoned(Exception):
    """Ends Orbax's save of a step whose arrays could not all be written (the cause: the caller's
    error, raised to the caller)."""


class _HeldOpen(orbax_compat.array_leaf_handler()):  # type: ignore[misc]
    """Orbax's array leaf handler, writing no array: it hands the caller the directory the arrays
    go to and waits until the caller has written them, or has failed to."""

    async def serialize(self, params: Sequence[Any], serialization_context: Any) -> Any:
        hold = _HOLD.get()
        if hold is None:
            raise RuntimeError("This checkpointer saves only the steps of `save_arrays`.")
        parent = serialization_context.parent_dir

        async def wait() -> None:
            try:
                await parent.await_creation()
            except BaseException as error:
                _settle(hold.directory, error=error)
                raise
            _settle(hold.directory, locations.as_path(parent.path))
            await asyncio.wrap_future(hold.written)

        return wait()


def _settle(
    future: concurrent.futures.Future[Any], value: Any = None, *, error: Any = None
) -> None:
    """Gives `future` its outcome unless it has one (Orbax may call `serialize` more than once)."""
    with contextlib.suppress(concurrent.futures.InvalidStateError):
        if error is None:
            future.set_result(value)
        else:
            future.set_exception(error)


class _Caller:
    """The caller's side: `arrays`, taken one at a time, and `on_written`. Remembers whether an
    error came from them: it is then the caller's own, and reaches the caller unchanged."""

    def __init__(
        self,
        arrays: Iterable[tuple[str, jax.Array]],
        on_written: Callable[[str], None] | None,
    ) -> None:
        self._arrays, self._on_written = iter(arrays), on_written
        self.failed = False

    def __iter__(self) -> Iterator[tuple[str, jax.Array]]:
        return self

    def __next__(self) -> tuple[str, jax.Array]:
        try:
            return next(self._arrays)
        except StopIteration:
            raise
        except BaseException:
            self.failed = True
            raise

    def written(self, key: str) -> None:
        if self._on_written is None:
            return
        try:
            self._on_written(key)
        except BaseException:
            self.failed = True
            raise


def save_arrays(
    directory: str | os.PathLike,
    step: int,
    record: StepRecord,
    arrays: Iterable[tuple[str, jax.Array]],
    *,
    on_written: Callable[[str], None] | None = None,
    incremental: bool = True,
    metrics: dict[str, Any] | None = None,
    keras_state: OwnState | None = None,
) -> Any:
    """Writes `arrays` as the committed step `step` of `directory`, described by `record`.

    Call on every process: each writes the shards its devices hold. `arrays` yields `(key, array)`
    for each key of `record.variables` (zero-size ones may be left out), in any order, and is
    advanced only once the previous array has been handed to the writer: an array let go by its
    producer is freed once written, so memory holds about the largest array.

    Args:
        directory: The checkpoint root; the step is written to `<directory>/<step>`.
        step: The step number.
        record: The step's keras-orbax record (each array's key, path, shape, dtype, role).
        arrays: The arrays, one at a time.
        on_written: Called with each key once its array has been handed to the writer.
        incremental: Link each shard file unchanged since the latest committed step before
            `step` (in object storage: copy it on the server) instead of writing it
            (`incremental`).
        metrics: Stored with the step as Orbax's step metrics (what `inspect` shows).
        keras_state: What the model's layers keep besides their variables, written into the
            step's `keras_state/` (`format.own_state`).

    Returns:
        The step's directory.

    Raises:
        StepExistsError: `step` is committed already.
        StepLockedError: another writer is saving `step` to `directory` right now.
        ValueError: `arrays` gave a key that `record` lacks, a key twice, an array whose shape or
            dtype is not the record's, or not every key.
        SaveFailedError: the write failed (e.g. a full disk).
        In every case, and for an error raised by `arrays` itself (passed on unchanged), nothing
        was committed and the committed steps are intact.
    """
    keys = [key for key, v in record.variables.items() if _size(v.shape)]  # Orbax refuses empty
    if not keys:
        raise ValueError(f"Step {step} would hold no array: every variable of its record is empty.")
    variables = {
        key: dataclasses.replace(v, array=key.replace("/", "."))
        for key, v in record.variables.items()
    }
    record = dataclasses.replace(record, step=step, variables=variables)
    caller = _Caller(arrays, on_written)
    root = step_dirs.CheckpointRoot.of(directory)  # its steps listed once, under the lock
    try:
        with writer_lock(root, step), quiet.saving(root):
            if step in root.listed_again():
                raise StepExistsError(
                    f"Step {step} is already committed in '{root}'; nothing was written. "
                    f"Received: step={step}"
                )
            try:
                plan = incremental_saves.plan_for(root, step) if incremental else None
                # No other Orbax save or deletion of this process meanwhile (step_sink.save_async).
                with step_sink.orbax_operation():
                    _save_held(root, step, record, keys, caller, plan, metrics, keras_state)
            except BaseException:
                _remove_unfinished(root, step)
                raise
    except (KerasOrbaxError, ValueError):
        raise
    except Exception as error:
        if caller.failed:
            raise
        steps = root.steps()
        intact = f" The last committed step, {steps[-1]}, is intact." if steps else ""
        raise SaveFailedError(
            f"Saving step {step} to '{root}' failed: {type(error).__name__}: {error}. "
            f"Nothing was committed.{intact}"
        ) from error
    return root.step_dir(step)


def _save_held(
    directory: step_dirs.CheckpointRoot,
    step: int,
    record: StepRecord,
    keys: list[str],
    caller: _Caller,
    plan: incremental_saves.Plan | None = None,
    metrics: dict[str, Any] | None = None,
    keras_state: OwnState | None = None,
) -> None:
    """Orbax's save of `step`, held open while the caller's arrays are written into it, then
    committed."""
    hold = _Hold()
    checkpointer = step_sink.open_checkpointer(
        directory, leaf_handler=_HeldOpen, commit_timeout_s=_COMMIT_TIMEOUT_S
    )
    placeholder = jax.numpy.zeros((), np.uint8)  # each leaf: only the keys matter to Orbax
    token = _HOLD.set(hold)
    try:
        kept = {KERAS_STATE: StepFiles(keras_state)} if keras_state else {}
        response = checkpointer.save_checkpointables_async(
            step,
            {STATE: state_keys.nest(dict.fromkeys(keys, placeholder))} | kept,
            force=True,
            metrics=metrics,
            custom_metadata={FORMAT_NAME: record.to_json()},
        )
    except BaseException:
        checkpointer.close()
        raise
    finally:
        _HOLD.reset(token)
    try:
        _write(_directory(hold, response), record, caller, plan)
    except BaseException as error:
        _abandon(hold, response, checkpointer, error)
        raise
    hold.written.set_result(None)
    with checkpointer:
        step_sink.DurableResponse(response, directory, step).result()


def _directory(hold: _Hold, response: Any) -> Any:
    """Where the arrays go, once Orbax has made it.

    Raises:
        The error that ended Orbax's save before it asked for the arrays.
    """
    while True:
        try:
            return hold.directory.result(timeout=1.0)
        except concurrent.futures.TimeoutError:
            pass
        try:
            response.result(timeout=0)
        except concurrent.futures.TimeoutError:
            continue
        raise RuntimeError("Orbax finished the save without asking for its arrays.")


def _write(
    state_dir: Any, record: StepRecord, caller: _Caller, plan: incremental_saves.Plan | None
) -> None:
    """Writes each of the caller's arrays into `state_dir`, letting each go once it is written."""
    seen: set[str] = set()
    in_flight = _IN_FLIGHT_BYTES
    with files_writer.ArrayFiles(state_dir, in_flight_bytes=in_flight, plan=plan) as files:
        for key, value in caller:
            _check(record, key, value, seen)
            seen.add(key)
            if value.size:
                files.add(*shard_writer.shards_of(record.variables[key].array, value))
            del value  # before the next array is read
            caller.written(key)
        missing = [k for k, v in record.variables.items() if k not in seen and _size(v.shape)]
        if missing:
            raise ValueError(
                f"{len(missing)} arrays of step {record.step} were never given, e.g. "
                f"{missing[:5]}; nothing was committed."
            )
        files.finish()


def _check(record: StepRecord, key: str, value: Any, seen: set[str]) -> None:
    """Raises ValueError unless `value` is a `jax.Array` that `record` describes under `key`,
    given for the first time."""
    saved = record.variables.get(key)
    if saved is None or key in seen:
        why = "was given twice" if saved is not None else "is not in the step's record"
        raise ValueError(f"Array '{key}' {why}; nothing was committed. Received: key={key!r}")
    if not isinstance(value, jax.Array):
        raise ValueError(
            f"Array '{key}' must be a jax.Array; nothing was committed. "
            f"Received: {type(value).__name__}"
        )
    if tuple(value.shape) != tuple(saved.shape) or np.dtype(value.dtype) != np_dtype(saved.dtype):
        raise ValueError(
            f"Array '{key}' is {tuple(value.shape)} {np.dtype(value.dtype)}, but the step's record "
            f"says {tuple(saved.shape)} {saved.dtype}; nothing was committed."
        )


def _abandon(hold: _Hold, response: Any, checkpointer: Any, cause: BaseException) -> None:
    """Ends Orbax's save of the step uncommitted, without the error log lines Orbax writes for
    each of its threads that the abandoned save stops: the caller gets `cause` itself."""
    abandoned = _Abandoned(f"{type(cause).__name__}: {cause}")
    log_filter = _AbandonedFilter(abandoned)
    _ORBAX_LOGGER.addFilter(log_filter)
    try:
        hold.written.set_exception(abandoned)
        for finish in (response.result, checkpointer.close):
            with contextlib.suppress(_Abandoned):
                finish()
    finally:
        _ORBAX_LOGGER.removeFilter(log_filter)


class _AbandonedFilter(logging.Filter):
    """Drops Orbax's records of `abandoned` (its threads log the error each time they pass it on)."""

    def __init__(self, abandoned: _Abandoned) -> None:
        super().__init__()
        self._abandoned = abandoned

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        return exc is not self._abandoned and str(self._abandoned) not in record.getMessage()


def _remove_unfinished(directory: step_dirs.CheckpointRoot, step: int) -> None:
    """Removes what a failed attempt at `step` left, unless the step got committed: Orbax's
    temporary directory (local; the writer lock makes it this attempt's), or, in object storage,
    the step's objects written in place before the commit marker. Process 0 removes them."""
    if not multihost.is_primary() or step in directory.listed_again():
        return
    root = directory.path
    if locations.is_remote(root):
        unfinished = root / str(step)
        if unfinished.exists():
            unfinished.rmtree()
        return
    step_leftovers.remove_staged(root, step)


def _size(shape: Sequence[int]) -> int:
    return int(np.prod(shape, dtype=np.int64))
